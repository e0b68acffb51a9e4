"""Chaos: a run SIGKILLed again and again, at every kind of moment, ends where an
uninterrupted run ends, bit for bit.

Real ``lit-grpo fit`` subprocesses on the tiny model, 2 epochs of 4 optimizer
steps, a checkpoint after every step (so most kills land inside an epoch). One
run goes straight through. The other is killed five times (``tests/chaos.py``
strikes inside a rollout, inside ``backward``, half-way through writing a
checkpoint, before an optimizer step, and half-way through writing the
exported adapter) and each time resumed with ``--ckpt_path last``, as a user
would. Then the adapters must be equal bitwise, every checkpoint on disk must
load, and no temporary file may be left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

TESTS = Path(__file__).parent

# (phase, epoch, index): see tests/chaos.py. Steps per epoch: 4 (global steps 1-4, 5-8).
KILLS = [
    ("backward", 0, 1),  # second micro-batch of epoch 0, resumes from step 1 (inside the epoch)
    ("checkpoint", 0, 2),  # half of epoch=0-step=2.ckpt written
    ("optimizer", 0, 3),  # the last step of epoch 0, resumes from step 3
    ("rollout", 1, 3),  # epoch 1's rollout, resumes from the end of epoch 0
    ("export", 0, 0),  # fit is done: half of adapter_model.safetensors written
]


def fit_command(model_dir: str, root: Path, *extra: str) -> list[str]:
    reward = '[{"class_path": "lit_grpo.rewards.FromCallable", "init_args": {"function": "chaos.letter_share"}}]'
    return [
        sys.executable,
        "-m",
        "lit_grpo.cli",
        "fit",
        "--seed_everything=0",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.max_epochs=2",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={root}",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root / 'checkpoints'}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.save_last=true",
        f"--model.policy.name_or_path={model_dir}",
        "--model.policy.lora.r=4",
        "--model.policy.lora.dropout=0.1",
        "--model.progress=false",
        "--model.validate_before_training=false",
        "--data.source.train_size=40",
        "--data.held_out.size=4",
        "--data.prompts_per_epoch=2",
        "--data.batch_size=2",
        "--data.sampling.group_size=4",
        "--data.sampling.max_new_tokens=8",
        f"--data.rewards={reward}",
        "--model.optimizer=torch.optim.AdamW",
        "--model.optimizer.lr=0.01",
        f"--export_adapter={root / 'adapter'}",
        *extra,
    ]


ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(TESTS)}


def run(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=timeout)


def alongside(command: list[str]) -> subprocess.Popen:
    """The straight run, started beside the interrupted ones (they strike on events, not on time)."""
    return subprocess.Popen(command, env=ENV, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finished(process: subprocess.Popen) -> None:
    _, log = process.communicate(timeout=300)
    assert process.returncode == 0, log[-3000:]


def test_five_kills_in_five_phases_resume_to_the_same_adapter(tmp_path, tiny_model_dir):
    straight_dir, chaos_dir = tmp_path / "straight", tmp_path / "chaos"
    straight = alongside(fit_command(tiny_model_dir, straight_dir))
    started = time.monotonic()
    for phase, epoch, index in KILLS:
        result = run(
            fit_command(
                tiny_model_dir,
                chaos_dir,
                "--ckpt_path=last",
                "--trainer.callbacks+=chaos.Chaos",
                f"--trainer.callbacks.phase={phase}",
                f"--trainer.callbacks.epoch={epoch}",
                f"--trainer.callbacks.index={index}",
            )
        )
        assert result.returncode == -9, f"{phase} {epoch} {index} did not strike:\n{result.stderr[-3000:]}"
        if phase == "export":  # the first export, killed half-way: no adapter folder at all, not a part of one
            assert not (chaos_dir / "adapter").exists()
    result = run(fit_command(tiny_model_dir, chaos_dir, "--ckpt_path=last"))
    assert result.returncode == 0, result.stderr[-3000:]
    finished(straight)
    print(f"{len(KILLS)} kills and resumes in {time.monotonic() - started:.0f} s")

    expected, actual = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (straight_dir, chaos_dir))
    assert any(w.abs().max() > 0 for name, w in expected.items() if "lora_B" in name)  # it trained
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name  # bitwise, not merely close

    checkpoints = sorted(p.name for p in (chaos_dir / "checkpoints").iterdir())
    assert checkpoints == sorted([f"epoch={s // 5}-step={s}.ckpt" for s in range(1, 9)] + ["last.ckpt"])
    for name in checkpoints:
        torch.load(chaos_dir / "checkpoints" / name, weights_only=False)  # each one loads
    leftovers = [p for p in chaos_dir.rglob("*") if p.name.endswith((".tmp", ".old")) or ".tmp-" in p.name]
    assert not leftovers
