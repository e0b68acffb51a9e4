"""Same config, same seed, same machine: bitwise the same adapter, at 1 and at 2 threads.

The embedded SmolLM2-135M through the real ``lit-grpo fit`` with the shipped
quickstart config (dynamic sampling, the cosine schedule stepped per optimizer
step, the progress bar on), shrunk to 2 epochs of 2 optimizer steps. A kernel
whose result depends on how threads split its work shows here and not on the
tests' tiny models: one differing logit flips a sampled token and the runs part.
The one found (the backward of the shared-prompt cache's row gather added rows
with atomic float adds at 2 threads) is kept out by ``logprob_passes.cache_rows``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parent.parent
TESTS = Path(__file__).parent


def fit(root: Path, threads: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "lit_grpo.cli",
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--trainer.max_epochs=2",
        "--trainer.check_val_every_n_epoch=100",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={root}",
        "--trainer.callbacks=[]",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root / 'checkpoints'}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.save_last=true",
        "--model.validate_before_training=false",
        "--data.held_out.slices={}",
        "--data.held_out.size=4",
        "--data.prompts_per_epoch=2",
        "--data.batch_size=8",
        "--data.sampling.max_new_tokens=10",
        f"--export_adapter={root / 'adapter'}",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def adapter(root: Path) -> dict[str, torch.Tensor]:
    return load_file(root / "adapter" / "adapter_model.safetensors")


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert any(t.abs().max() > 0 for name, t in a.items() if "lora_B" in name)  # it trained
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, (
        f"{len(different)} tensors differ, max |d| {max((a[n] - b[n]).abs().max().item() for n in different):.2e}"
    )


def test_one_thread_and_two_threads_train_the_same_adapter_with_dynamic_sampling(tmp_path):
    # Two processes of the same config: bitwise the same adapter although the second splits every
    # kernel over another number of threads (a run against itself at 2 threads is test_chaos's straight
    # run against its resumed one).
    # They run side by side: how busy the cores are changes when a thread runs, never how a kernel
    # splits its work, so the comparison holds and the test takes one run's time, not two.
    runs = [fit(tmp_path / str(threads), threads) for threads in (2, 1)]
    for run in runs:
        _, log = run.communicate(timeout=900)
        assert run.returncode == 0, log[-4000:]
    assert_bitwise_equal(adapter(tmp_path / "2"), adapter(tmp_path / "1"))
