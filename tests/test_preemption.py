"""Preemption: SIGTERM or SIGINT saves a checkpoint, the run exits non-zero, and ``--ckpt_path last``
resumes to the adapter a straight run ends on, bit for bit.

Real ``lit-grpo fit`` subprocesses on the tiny model with the command's own
checkpointing (no per-step ``ModelCheckpoint``): whatever resumes was written
by the signal itself. ``tests/chaos.py`` sends the signal at a chosen moment:
inside ``backward`` in the middle of a gradient-accumulation window (the stop
must wait for the optimizer step), inside a rollout (the rollout is abandoned
and its prompts given back), and during validation (the stop comes at the
epoch's end).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from safetensors.torch import load_file
from test_chaos import alongside, finished, fit_command, run


def preemptible_command(model_dir: str, root, *extra: str) -> list[str]:
    """The chaos runs' command with the command's default checkpoints: 2 epochs, 2 optimizer steps each
    (4 micro-batches, 2 accumulated per step), validation every epoch."""
    command = fit_command(model_dir, root, *extra)
    per_step = command.index("--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint")
    del command[per_step : per_step + 5]  # the chaos runs' checkpoint after every step
    return [*command, "--trainer.accumulate_grad_batches=2"]


def struck(model_dir: str, root, phase: str, epoch: int, index: int, strike: str = "SIGTERM") -> str:
    result = run(
        preemptible_command(
            model_dir,
            root,
            "--ckpt_path=last",
            "--trainer.callbacks+=chaos.Chaos",
            f"--trainer.callbacks.phase={phase}",
            f"--trainer.callbacks.epoch={epoch}",
            f"--trainer.callbacks.index={index}",
            f"--trainer.callbacks.strike={strike}",
        )
    )
    assert result.returncode == 128 + getattr(signal, strike), f"{phase} {epoch} {index}:\n{result.stderr[-3000:]}"
    return result.stderr.strip().splitlines()[-1]


def test_sigterm_and_sigint_save_and_the_resumed_run_ends_on_the_straight_runs_adapter(tmp_path, tiny_model_dir):
    straight = alongside(preemptible_command(tiny_model_dir, tmp_path / "straight"))
    root = tmp_path / "preempted"
    last = root / "checkpoints" / "last.ckpt"

    # Inside backward of the first micro-batch: the stop waits for the step after the second.
    line = struck(tiny_model_dir, root, "backward", 0, 0)
    assert line.startswith("lit-grpo: stopped by SIGTERM at step 1 (epoch 0); checkpoint saved to "), line
    assert line.endswith("--ckpt_path last") and str(last) in line, line
    assert torch.load(last, weights_only=False)["global_step"] == 1
    # SIGINT in epoch 0's validation: the epoch ends, then the run stops.
    line = struck(tiny_model_dir, root, "validation", 0, 0, strike="SIGINT")
    assert line.startswith("lit-grpo: stopped by SIGINT at step 2 (epoch 0)"), line
    # Inside epoch 1's rollout: abandoned at the next decoding step; nothing of epoch 1 trained.
    line = struck(tiny_model_dir, root, "rollout", 1, 3)
    assert line.startswith("lit-grpo: stopped by SIGTERM at step 2 (epoch 1)"), line

    resumed = run(preemptible_command(tiny_model_dir, root, "--ckpt_path=last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    finished(straight)
    expected = load_file(tmp_path / "straight" / "adapter" / "adapter_model.safetensors")
    got = load_file(root / "adapter" / "adapter_model.safetensors")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_an_epoch_is_saved_when_validation_runs_every_5_epochs(tmp_path, tiny_model_dir):
    result = run(
        preemptible_command(tiny_model_dir, tmp_path, "--trainer.max_epochs=1", "--trainer.check_val_every_n_epoch=5")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["epoch"] == 0 and checkpoint["global_step"] == 2


def plain_trainer_run(model_dir: str, root, signals: str, plugins: str = "[]", env: dict | None = None):
    """A plain-``Trainer`` GRPO fit on the tiny model in a fresh process (3 epochs of 2 steps), which sends
    itself ``signals[global_step]`` (a dict of signal names) at the start of those steps."""
    script = f"""
import os, signal
import lightning as L
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import LoraSpec, PolicySpec

class Signals(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        name = {signals}.get(trainer.global_step)
        if name:
            os.kill(os.getpid(), getattr(signal, name))

module = GRPOModule(policy=PolicySpec(name_or_path={model_dir!r}, lora=LoraSpec(r=4)), progress=False,
                    validate_before_training=False)
data = OnPolicyDataModule(source=SourceSpec(train_size=20), held_out=HeldOutSpec(size=2), prompts_per_epoch=2,
                          batch_size=4,
                          sampling=SamplingSpec(group_size=4, max_new_tokens=4))
trainer = L.Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_progress_bar=False,
                    reload_dataloaders_every_n_epochs=1, default_root_dir={str(root)!r},
                    plugins={plugins}, callbacks=[Signals()])
trainer.fit(module, data)
print("fit returned")
"""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)


def test_a_plain_trainer_stops_on_sigterm_with_a_checkpoint_and_exit_code_143(tmp_path, tiny_model_dir):
    result = plain_trainer_run(tiny_model_dir, tmp_path, '{1: "SIGTERM"}')
    assert result.returncode == 143, result.stderr[-3000:]
    assert "fit returned" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    path = tmp_path / "checkpoints" / "last.ckpt"
    assert last == (
        f"lit-grpo: stopped by SIGTERM at step 2 (epoch 0); checkpoint saved to {path}. "
        f"Resume with: trainer.fit(..., ckpt_path={str(path)!r})"
    ), last
    assert torch.load(path, weights_only=False)["global_step"] == 2


def test_lightnings_slurm_requeue_signal_still_saves_its_checkpoint_beside_ours(tmp_path, tiny_model_dir):
    # Under SLURM with auto_requeue, SIGUSR1 is Lightning's: it saves hpc_ckpt_1.ckpt and asks scontrol to
    # requeue (absent here: it warns); the SIGTERM that follows a requeue is ours: last.ckpt, exit 143.
    env = {
        **os.environ,
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "42",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
        "PATH": os.environ["PATH"],
    }
    result = plain_trainer_run(
        tiny_model_dir,
        tmp_path,
        '{1: "SIGUSR1", 2: "SIGTERM"}',
        plugins="[SLURMEnvironment(auto_requeue=True)]",
        env=env,
    )
    assert result.returncode == 143, result.stderr[-3000:]
    assert torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"] == 1
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3
