"""DDP and FSDP2 (ModelParallelStrategy) on 2 CPU processes with gloo.

Each test starts ``tests/distributed_worker.py`` as a real subprocess (Lightning
launches the second rank) and checks what every rank wrote.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("distributed_worker.py")


def launch(strategy: str, model_dir: str, out: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(WORKER), "--strategy", strategy, "--model", model_dir, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=WORKER.parent.parent,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def records(out: Path, run: str) -> list[dict]:
    return [json.loads((out / f"{run}-rank{rank}.json").read_text()) for rank in (0, 1)]


def assert_trained(ranks: list[dict]) -> None:
    for record in ranks:
        assert record["epochs"] == [0, 1]
        losses = [x for epoch in record["losses"].values() for x in epoch]
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    # The ranks sampled different prompts; sync_dist makes the logged rollout
    # metrics (and the torchmetrics val accuracy) the same on both.
    for key in ("rollout/tokens_per_s", "completion/length_mean", "val/accuracy"):
        assert ranks[0]["metrics"][key] == ranks[1]["metrics"][key], key


def test_ddp_trains_and_keeps_ranks_in_sync(tiny_model_dir, tmp_path):
    launch("ddp", tiny_model_dir, tmp_path)
    assert_trained(records(tmp_path, "ddp"))
    rank0, rank1 = (torch.load(tmp_path / f"ddp-rank{r}.pt") for r in (0, 1))
    lora_b = [name for name in rank0 if "lora_B" in name]
    # lora_B starts at zero: non-zero means the adapters did train.
    assert lora_b and any(rank0[name].abs().max() > 0 for name in lora_b)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    # Resumed from the checkpoint saved inside epoch 0 (each rank's rollout came back
    # from rank 0's file), the run ends with the uninterrupted run's weights, bitwise.
    for rank in (0, 1):
        resumed = torch.load(tmp_path / f"ddp-resumed-rank{rank}.pt")
        assert resumed.keys() == rank0.keys()
        for name in rank0:
            assert torch.equal(resumed[name], rank0[name]), (rank, name)


def test_fsdp2_trains_and_resumes_from_a_sharded_checkpoint(tiny_model_dir, tmp_path):
    launch("fsdp", tiny_model_dir, tmp_path)
    assert_trained(records(tmp_path, "fsdp"))
    checkpoint = tmp_path / "ckpt" / "epoch=0.ckpt"
    assert checkpoint.is_dir() and list(checkpoint.glob("*.distcp"))  # sharded (DCP), not one file
    for first, resumed in zip(records(tmp_path, "fsdp"), records(tmp_path, "resumed")):
        assert resumed["epochs"] == [1]  # continues after the checkpointed epoch
        # Each rank's weight and Adam-moment shards are back exactly as saved...
        assert resumed["start_checksum"] == first["saved"]["0"]
        # ...and so are the prompt position and the sampling seed: the resumed
        # epoch's rollout and first step are identical to the uninterrupted run's.
        assert resumed["losses"]["1"][0] == first["losses"]["1"][0]
