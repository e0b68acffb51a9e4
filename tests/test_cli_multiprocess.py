"""``lit-grpo fit`` (and ``sft fit``, ``rm fit``, ``dpo fit``) on 2 processes exactly as users type it (issue 19).

The real console script in a subprocess, DDP and FSDP2 (ModelParallelStrategy)
on gloo, with everything a user has on: the progress bar, the CSV logger,
``PlotCallback``, sample completions, checkpoints and the adapter export. A
collective that only some ranks reach hangs there and nowhere else, so each
run has a deadline: the test fails, it never hangs. The last two tests hang a
run on purpose (rank 0 waits in a barrier the other rank never joins) and
check that it ends: by the collective timeout with a line naming the hook, and
by SIGTERM to rank 0.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).parent.parent
TESTS = Path(__file__).parent
DEADLINE_S = 300  # a run here takes ~40 s; a hang is what takes longer


def cli_args(tiny: str, root: Path, *extra: str) -> list[str]:
    """Overrides that shrink a shipped config to the tiny model, 2 ranks, 2 epochs."""
    return [
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.max_epochs",
        "2",
        "--trainer.check_val_every_n_epoch",
        "1",
        "--trainer.default_root_dir",
        str(root),
        "--model.policy.name_or_path",
        tiny,
        "--model.policy.dtype",
        "float32",
        "--data.prompts_per_epoch",
        "2",
        "--data.batch_size",
        "8",
        "--data.held_out.size",
        "4",
        "--data.sampling.max_new_tokens",
        "8",
        # A random model never answers right; the text length still differs within a group.
        "--data.rewards",
        json.dumps(
            [
                {
                    "class_path": "lit_grpo.rewards.FromCallable",
                    "init_args": {"function": "distributed_worker.text_length"},
                }
            ]
        ),
        "--export_adapter",
        str(root / "adapter"),
        "--collective_timeout",
        "120",
        *extra,
    ]


def start(args: list[str], command: tuple[str, ...] = ("fit",), log: Path | None = None) -> subprocess.Popen:
    """Start ``lit-grpo`` in a session of its own; its output to ``log`` for a run nobody reads until it ends."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [shutil.which("lit-grpo"), *command, *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=log.open("w") if log else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    process.log = log
    return process


def finish(process: subprocess.Popen, deadline_s: float = DEADLINE_S) -> tuple[int, str]:
    """Wait for the run and for every rank it started; kill and fail past the deadline."""
    try:
        output, _ = process.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output = process.log.read_text() if process.log else output
        pytest.fail(f"lit-grpo fit still running after {deadline_s} s (a hang):\n{output[-6000:]}")
    output = process.log.read_text() if process.log else output
    assert ranks_gone(process.pid), f"a rank outlived rank 0:\n{output[-3000:]}"
    return process.returncode, output


def ranks_gone(group: int, wait_s: float = 30.0) -> bool:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    os.killpg(group, signal.SIGKILL)
    return False


METRICS = ("train/loss_epoch", "train/kl", "reward/total", "val/accuracy", "time/policy_backward")


def assert_outputs(root: Path, output: str, metrics: tuple[str, ...] = METRICS) -> None:
    """What a user finds after the run: curves, metrics, samples, checkpoints, the adapter."""
    run = next((root / "lightning_logs").iterdir())
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    for name in metrics:
        epochs = {row["epoch"] for row in rows if row.get(name)}
        assert {"0", "1"} <= epochs, (name, epochs)
    assert (run / "curves.png").stat().st_size > 0
    assert {json.loads(line)["epoch"] for line in (run / "samples.jsonl").read_text().splitlines()} == {0, 1}
    assert (root / "checkpoints" / "last.ckpt").exists()
    adapter = load_file(root / "adapter" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    # Full (gathered) shapes, and trained: lora_B starts at zero.
    assert lora_b and all(t.shape[1] == 16 for t in lora_b) and any(t.abs().max() > 0 for t in lora_b)
    assert "epoch 1:" in output and "\n  adapter: " in output


def test_ddp_cli_run_as_users_type_it(tiny_model_dir, tmp_path):
    code, output = finish(
        start(
            [
                "--config",
                "configs/quickstart.yaml",
                "--trainer.strategy",
                "ddp",
                *cli_args(tiny_model_dir, tmp_path, "--trainer.logger.init_args.save_dir", str(tmp_path)),
            ]
        )
    )
    assert code == 0, output[-6000:]
    assert_outputs(tmp_path, output)


def test_ddp_cli_run_with_a_tool(tiny_model_dir, tmp_path):
    # configs/tools.yaml: every completion is an episode (the random model never calls the calculator).
    code, output = finish(
        start(
            [
                "--config",
                "configs/tools.yaml",
                "--trainer.strategy",
                "ddp",
                *cli_args(tiny_model_dir, tmp_path, "--trainer.logger.init_args.save_dir", str(tmp_path)),
            ]
        )
    )
    assert code == 0, output[-6000:]
    # configs/tools.yaml trains with beta 0: no reference pass, so no train/kl
    assert_outputs(tmp_path, output, metrics=tuple(name for name in METRICS if name != "train/kl"))
    rows = list(csv.DictReader(next((tmp_path / "lightning_logs").iterdir()).joinpath("metrics.csv").open()))
    assert {row["epoch"] for row in rows if row.get("episode/turns_mean")} == {"0", "1"}


def test_fsdp2_cli_run_with_the_shipped_config(tiny_model_dir, tmp_path):
    # configs/fsdp.yaml is written for GPUs and a hub dataset; only what a CPU run
    # must change is overridden, the strategy and its device mesh stay as shipped.
    code, output = finish(
        start(
            [
                "--config",
                "configs/fsdp.yaml",
                "--trainer.precision",
                "32-true",
                "--trainer.logger",
                "lightning.pytorch.loggers.CSVLogger",
                "--trainer.logger.save_dir",
                str(tmp_path),
                "--trainer.callbacks+=lit_grpo.evaluation.plots.PlotCallback",
                "--data.source.dataset",
                "arithmetic",
                "--data.held_out.split",
                "null",
                "--data.source.columns",
                "null",
                "--data.prompt.template",
                "{prompt}",
                "--model.policy.gradient_checkpointing",
                "false",
                "--model.policy.lora.r",
                "16",
                *cli_args(tiny_model_dir, tmp_path),
            ]
        )
    )
    assert code == 0, output[-6000:]
    assert_outputs(tmp_path, output)
    assert list((tmp_path / "checkpoints" / "last.ckpt").glob("*.distcp"))  # sharded, as FSDP2 saves
    assert "returned a view tensor" not in output  # FSDP2's warning about the fused head's hidden states


def test_ppo_under_fsdp2_keeps_ranks_equal_and_resumes_from_its_sharded_checkpoint(tiny_model_dir, tmp_path):
    # PPO's shared critic (a second adapter) and value head next to the actor, all sharded by FSDP2.
    # Gathered shards read the same on every rank by construction; a weight left out of FSDP2
    # (as the value head once was) is a full copy per rank, trained on that rank's rows alone.
    def run(root: Path, epochs: int, *extra: str) -> str:
        root.mkdir()
        code, output = finish(
            start(
                [
                    "--config",
                    "configs/ppo_quickstart.yaml",
                    "--trainer.strategy.class_path",
                    "ModelParallelStrategy",
                    *cli_args(
                        tiny_model_dir,
                        root,
                        "--trainer.logger.init_args.save_dir",
                        str(root),
                        "--data.prompts_per_epoch",
                        "4",
                        "--data.batch_size",
                        "4",
                        "--trainer.max_epochs",
                        str(epochs),
                        "--trainer.callbacks+=rank_state.SaveRankState",
                        "--trainer.callbacks.folder",
                        str(root),
                        *extra,
                    ),
                ],
                command=("ppo", "fit"),
            )
        )
        assert code == 0, output[-6000:]
        return output

    first = tmp_path / "first"
    output = run(first, 2)
    run_dir = next((first / "lightning_logs").iterdir())
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert {row["epoch"] for row in rows if row.get("train/value_loss")} >= {"0", "1"}
    assert "\n  adapter: " in output
    assert list((first / "checkpoints" / "last.ckpt").glob("*.distcp"))  # sharded, as FSDP2 saves
    ranks = [torch.load(first / f"end-rank{r}.pt") for r in (0, 1)]
    assert "value_head.weight" in ranks[0]
    for name, tensor in ranks[0].items():
        assert torch.equal(tensor, ranks[1][name]), name
    for adapter in ("default", "critic"):  # both adapters trained (lora_B starts at zero)
        assert any(t.abs().max() > 0 for n, t in ranks[0].items() if f"lora_B.{adapter}" in n), adapter
    assert not torch.equal(torch.load(first / "start-rank0.pt")["value_head.weight"], ranks[0]["value_head.weight"])
    head = load_file(first / "adapter" / "critic" / "value_head.safetensors")
    assert torch.equal(head["weight"], ranks[0]["value_head.weight"])  # the whole head, gathered
    # Resumed from the sharded checkpoint, the run starts from exactly the weights the first one ended with.
    resumed = tmp_path / "resumed"
    assert "epoch 2:" in run(resumed, 3, "--ckpt_path", str(first / "checkpoints" / "last.ckpt"))
    for rank in (0, 1):
        start_state = torch.load(resumed / f"start-rank{rank}.pt")
        assert start_state.keys() == ranks[0].keys()
        for name, tensor in ranks[0].items():
            assert torch.equal(start_state[name], tensor), (rank, name)


def stalled_run(tiny: str, root: Path, *extra: str) -> subprocess.Popen:
    return start(
        [
            "--config",
            "configs/quickstart.yaml",
            "--trainer.strategy",
            "ddp",
            *cli_args(tiny, root, "--trainer.callbacks+=stalling_rank.StallingRank", *extra),
        ]
    )


def test_a_rank_conditional_collective_ends_in_an_error_naming_the_hook(tiny_model_dir, tmp_path):
    # Long enough for rank 1 to start (the timeout bounds the rendezvous too), short enough to wait for.
    code, output = finish(stalled_run(tiny_model_dir, tmp_path, "--collective_timeout", "15"))
    assert code == 1
    last = output.strip().splitlines()[-1]
    assert last.startswith("lit-grpo: rank 0: a collective failed in StallingRank.on_train_epoch_end"), last
    assert "Timed out waiting 15000ms" in last and "stalling_rank.py" in last


def test_sigterm_ends_every_rank_even_inside_a_collective(tiny_model_dir, tmp_path):
    marker = tmp_path / "rank0-in-barrier"
    # The grace shortened from its 25 s default, so the test waits less (the path is the same).
    process = stalled_run(
        tiny_model_dir, tmp_path, "--trainer.callbacks.marker", str(marker), "--preemption_grace", "5"
    )
    end = time.monotonic() + DEADLINE_S
    while not marker.exists() and process.poll() is None and time.monotonic() < end:
        time.sleep(0.5)
    assert marker.exists(), "rank 0 never reached the barrier"
    time.sleep(1.0)  # inside the barrier now: no Python code of rank 0 runs until it returns
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)  # rank 0 only, as `kill PID` does
    code, output = finish(process, deadline_s=60)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert time.monotonic() - sent < 20
    assert "ending this process and its child ranks" in output


def test_fsdp2_killed_inside_an_epoch_resumes_from_its_sharded_checkpoint_to_the_same_adapter(tiny_model_dir, tmp_path):
    # Both ranks SIGKILLed at once (the run's process group) inside the save of last.ckpt at step 7
    # (every shard written, rank 0's meta.pt not: written in place, the folder then held step 7's
    # weights with step 6's loop state), then resumed with --ckpt_path last from the sharded
    # checkpoint of step 6, inside epoch 1. 4 steps per epoch. The straight run goes alongside.
    def launch(root: Path, *extra: str, log: Path | None = None) -> subprocess.Popen:
        return start(
            [
                "--config",
                "configs/quickstart.yaml",
                "--trainer.strategy",
                '{"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}',
                *cli_args(
                    tiny_model_dir,
                    root,
                    "--trainer.logger",
                    "false",
                    "--trainer.callbacks=[]",
                    "--data.prompts_per_epoch",
                    "4",
                    "--data.batch_size",
                    "4",
                    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                    f"--trainer.callbacks.dirpath={root / 'checkpoints'}",
                    "--trainer.callbacks.every_n_train_steps=1",
                    "--trainer.callbacks.save_last=true",
                    *extra,
                ),
            ],
            log=log,
        )

    straight = launch(tmp_path / "straight", log=tmp_path / "straight.log")  # read once it ends
    chaos = tmp_path / "chaos"
    code, output = finish(
        launch(
            chaos,
            "--trainer.callbacks+=chaos.Chaos",
            "--trainer.callbacks.phase=sharded_checkpoint",
            "--trainer.callbacks.epoch=1",
            "--trainer.callbacks.index=7",
            "--trainer.callbacks.group=true",
        )
    )
    assert code == -9, f"the kill did not strike:\n{output[-3000:]}"
    assert list((chaos / "checkpoints" / "last.ckpt").glob("*.distcp"))  # sharded
    code, output = finish(launch(chaos, "--ckpt_path", "last"))
    assert code == 0, output[-6000:]
    code, output = finish(straight)
    assert code == 0, output[-6000:]
    expected, actual = (
        load_file(root / "adapter" / "adapter_model.safetensors") for root in (tmp_path / "straight", chaos)
    )
    assert any(t.abs().max() > 0 for name, t in expected.items() if "lora_B" in name)  # it trained
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


DDP, FSDP2 = ("--trainer.strategy", "ddp"), ("--trainer.strategy.class_path", "ModelParallelStrategy")


@pytest.mark.parametrize(
    "command, strategy",
    [("sft", DDP), ("rm", FSDP2), ("dpo", FSDP2)],
    ids=["sft-ddp", "rm-fsdp2", "dpo-fsdp2"],
)
def test_dataset_cli_runs_on_two_ranks(tiny_model_dir, tmp_path, command, strategy):
    # SFT, the reward model and DPO on 2 ranks, as users type them: the shipped configs shrunk to the
    # tiny model (the RM starts from the raw base here, not from an SFT adapter), progress bar on.
    # Under FSDP2 the reward model takes one full pass per conversation (no prefix cache) and its
    # head is a sharded unit of its own; the checkpoints are sharded.
    export = tmp_path / "export"
    code, output = finish(
        start(
            [
                "--config",
                f"configs/{command}_quickstart.yaml",
                *strategy,
                "--trainer.devices",
                "2",
                "--trainer.max_steps",
                "4",
                "--trainer.default_root_dir",
                str(tmp_path),
                "--trainer.logger",
                "lightning.pytorch.loggers.CSVLogger",
                "--trainer.logger.save_dir",
                str(tmp_path),
                "--model.policy.name_or_path",
                tiny_model_dir,
                "--model.policy.dtype",
                "float32",
                "--data.train_size",
                "64",
                "--data.val_size",
                "8",
                "--export_adapter",
                str(export),
                *(["--model.policy.init_adapter", "null"] if command == "rm" else []),
            ],
            command=(command, "fit"),
        )
    )
    assert code == 0, output[-6000:]
    assert "returned a view tensor" not in output
    rows = list(csv.DictReader(next((tmp_path / "lightning_logs").iterdir()).joinpath("metrics.csv").open()))
    assert any(row.get("val/loss") for row in rows) and any(row.get("train/loss_step") for row in rows)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.exists() and bool(list(last.glob("*.distcp"))) == (strategy == FSDP2)
    adapter = export
    if command == "rm":
        from lit_grpo.rewards.reward_model import ADAPTER_DIR, HEAD_FILE

        adapter = export / ADAPTER_DIR  # adapter + head
        head = load_file(adapter / HEAD_FILE)["weight"]
        assert head.abs().max() > 0
        assert_classifier_scores_as_adapter_and_head(export, tiny_model_dir, head)
    lora_b = [t for name, t in load_file(adapter / "adapter_model.safetensors").items() if "lora_B" in name]
    assert lora_b and any(t.abs().max() > 0 for t in lora_b)  # trained: lora_B starts at zero


def assert_classifier_scores_as_adapter_and_head(export: Path, base: str, head: torch.Tensor) -> None:
    """The sequence-classification export (under FSDP2: built from the gathered shards) scores as the
    base with the exported adapter and head do."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from lit_grpo.rewards.reward_model import ADAPTER_DIR, backbone_scores, encode_conversations

    classifier = AutoModelForSequenceClassification.from_pretrained(export).eval()
    assert classifier.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids, mask = encode_conversations(tokenizer, ["What is 12 + 30?"] * 2, ["12 + 30 = 42", "12 + 30 = 43"], None, None)
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export / ADAPTER_DIR).eval()
    linear = torch.nn.Linear(head.shape[1], 1, bias=False)
    linear.weight.data.copy_(head)
    with torch.no_grad():
        expected = backbone_scores(policy, linear, ids, mask, tokenizer.pad_token_id)
        torch.testing.assert_close(
            classifier(input_ids=ids, attention_mask=mask).logits[:, 0], expected, rtol=1e-5, atol=1e-5
        )


def test_sigterm_to_rank_0_stops_both_ranks_at_one_step_with_a_checkpoint_that_resumes(tiny_model_dir, tmp_path):
    # `kill PID` reaches rank 0 only (inside backward of its first micro-batch): rank 0 passes it
    # on, the ranks agree at the next optimizer step, rank 0 writes last.ckpt, both exit 143.
    def run(*extra: str) -> tuple[int, str]:
        return finish(
            start(
                [
                    "--config",
                    "configs/quickstart.yaml",
                    "--trainer.strategy",
                    "ddp",
                    *cli_args(
                        tiny_model_dir,
                        tmp_path,
                        "--trainer.logger.init_args.save_dir",
                        str(tmp_path),
                        "--data.batch_size",
                        "4",
                        *extra,
                    ),
                ]
            )
        )

    code, output = run(
        "--trainer.callbacks+=chaos.Chaos",
        "--trainer.callbacks.phase=backward",
        "--trainer.callbacks.strike=SIGTERM",
        "--trainer.callbacks.rank=0",
    )
    assert code == 128 + signal.SIGTERM, output[-6000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("lit-grpo: stopped by SIGTERM at step 1 (epoch 0); checkpoint saved to "), last
    assert last.endswith("--ckpt_path last"), last
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1
    code, output = run("--ckpt_path", "last")
    assert code == 0, output[-6000:]
    assert "epoch 1:" in output and "\n  adapter: " in output


def test_ddp_samples_one_rollout_ahead_with_data_staleness_1(tiny_model_dir, tmp_path):
    # Each rank's worker samples epoch 1's rollout while epoch 0 trains; epoch 1 trains on it.
    code, output = finish(
        start(
            [
                "--config",
                "configs/quickstart.yaml",
                "--trainer.strategy",
                "ddp",
                *cli_args(
                    tiny_model_dir,
                    tmp_path,
                    "--trainer.logger.init_args.save_dir",
                    str(tmp_path),
                    "--data.staleness",
                    "1",
                ),
            ]
        )
    )
    assert code == 0, output[-6000:]
    assert_outputs(tmp_path, output)
    rows = list(csv.DictReader(next((tmp_path / "lightning_logs").iterdir()).joinpath("metrics.csv").open()))
    staleness = {row["epoch"]: float(row["rollout/staleness"]) for row in rows if row.get("rollout/staleness")}
    assert staleness == {"0": 0.0, "1": 1.0}
