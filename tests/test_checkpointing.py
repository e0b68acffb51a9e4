"""A kill -9 in the middle of writing a checkpoint leaves the previous one loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lit_grpo.training.checkpointing import AtomicCheckpointIO

# Saves checkpoint "A", then saves "B" but stops once B's bytes are in the
# temporary file (at its fsync, before the rename) until the parent kills it.
_WRITER = textwrap.dedent(
    """
    import os, pathlib, sys, time
    import torch
    from lit_grpo.training.checkpointing import AtomicCheckpointIO

    target, marker = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])

    def stall(fd):
        marker.write_text("writing")
        time.sleep(600)

    io = AtomicCheckpointIO()
    io.save_checkpoint({"name": "A", "weights": torch.arange(1000.0)}, target)
    os.fsync = stall
    io.save_checkpoint({"name": "B", "weights": torch.zeros(100_000)}, target)
    """
)


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    target, marker = tmp_path / "ckpts" / "last.ckpt", tmp_path / "marker"
    process = subprocess.Popen([sys.executable, "-c", _WRITER, str(target), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None, "the writer exited before reaching the second save"
            assert time.monotonic() < deadline, "the writer never reached the second save"
            time.sleep(0.05)
        partial = target.with_name(".last.ckpt.tmp")
        assert partial.stat().st_size > 400_000  # B was written, not yet renamed over A
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
    checkpoint = AtomicCheckpointIO().load_checkpoint(target, weights_only=True)
    assert checkpoint["name"] == "A"
    torch.testing.assert_close(checkpoint["weights"], torch.arange(1000.0))
    # The next save goes through and leaves no temporary file behind.
    AtomicCheckpointIO().save_checkpoint({"name": "C"}, target)
    assert torch.load(target)["name"] == "C"
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def test_failed_save_removes_its_temporary_file(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"name": "A"}, target)
    with pytest.raises(Exception):  # a lambda cannot be pickled
        AtomicCheckpointIO().save_checkpoint({"name": "B", "bad": lambda: None}, target)
    assert torch.load(target)["name"] == "A"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_cli_trainer_is_crash_safe_by_default(tmp_path, tiny_model_dir):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.cli import GRPOCli
    from lit_grpo.data.grpo import OnPolicyDataModule

    cli = GRPOCli(
        GRPOModule,
        OnPolicyDataModule,
        run=False,
        args=[
            f"--model.policy.name_or_path={tiny_model_dir}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
        ],
    )
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    (checkpoint,) = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint)]
    # one file, last.ckpt, rewritten each epoch: what --ckpt_path last resumes
    assert (checkpoint.filename, checkpoint.save_top_k, checkpoint.save_last) == ("last", 1, None)
    assert checkpoint.dirpath == str(tmp_path / "checkpoints")


def test_atomic_folder_replaces_the_previous_export_or_keeps_it(tmp_path):
    from lit_grpo.training.checkpointing import atomic_folder

    target = tmp_path / "adapter"
    with atomic_folder(target) as folder:
        (folder / "weights").write_text("first")
    assert (target / "weights").read_text() == "first"
    with pytest.raises(RuntimeError), atomic_folder(target) as folder:
        (folder / "weights").write_text("half")
        raise RuntimeError("killed while writing")
    assert (target / "weights").read_text() == "first"  # the previous export is intact
    with atomic_folder(target) as folder:
        (folder / "weights").write_text("second")
    assert (target / "weights").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # nothing left beside it


@pytest.mark.parametrize("swap", ["exchange", "two_renames"])
def test_put_in_place_replaces_the_folder_whole(tmp_path, monkeypatch, swap):
    # Linux swaps the two folders in one step (renameat2 RENAME_EXCHANGE); elsewhere the previous
    # folder is renamed aside first. Either way the new files are there, the old ones gone.
    from lit_grpo.training import checkpointing

    if swap == "two_renames":
        monkeypatch.setattr(checkpointing, "_renameat2", lambda: None)
    elif checkpointing._renameat2() is None:
        pytest.skip("no renameat2 here")
    target, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.tmp"
    for folder, text in ((target, "old"), (new, "new")):
        folder.mkdir()
        (folder / "shard").write_text(text)
    (target / "only_in_old").write_text("stale")
    checkpointing.put_in_place(new, target)
    assert sorted(p.name for p in target.iterdir()) == ["shard"] and (target / "shard").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    # A sharded checkpoint over a single-file one (a DDP run's last.ckpt in the same folder).
    single = tmp_path / "single.ckpt"
    single.write_text("one file")
    new.mkdir()
    (new / "shard").write_text("sharded")
    checkpointing.put_in_place(new, single)
    assert (single / "shard").read_text() == "sharded"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "single.ckpt"]
