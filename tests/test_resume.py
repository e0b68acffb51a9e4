"""Exact resume: a run killed with SIGKILL and resumed from ``last`` ends with the
same adapter weights, bit for bit, as a run that was never interrupted.

Real ``lit-grpo fit`` subprocesses on a tiny model: one straight run, and one
killed after epoch 0's checkpoint is on disk and before epoch 1's (so in the
middle of epoch 1's rollout or training), then resumed with ``--ckpt_path last``.
Everything that decides the future must come back from the checkpoint: adapter
weights, optimizer state, the DataModule's prompt position, and the RNG, which
is re-seeded from ``(seed, epoch, rank)`` at each rollout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# The tiny random model never answers the arithmetic right, so accuracy would be 0
# everywhere, every advantage 0, and the adapter would never move: an exactness
# test that could not fail. This reward differs between random completions.
_REWARD = """
def letter_share(prompts, completions, **columns):
    return [sum(ch.isalpha() for ch in text) / max(len(text), 1) for text in completions]
"""


def fit_command(model_dir: str, root: Path, *extra: str) -> list[str]:
    reward = (
        '[{"class_path": "lit_grpo.rewards.FromCallable", "init_args": {"function": "resume_reward.letter_share"}}]'
    )
    return [
        sys.executable,
        "-m",
        "lit_grpo.cli",
        "fit",
        "--seed_everything=0",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.max_epochs=3",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={root}",
        f"--model.policy.name_or_path={model_dir}",
        "--model.policy.lora.r=4",
        "--model.progress=false",
        "--data.train_size=40",
        "--data.val_size=4",
        "--data.prompts_per_epoch=2",
        "--data.batch_size=4",
        "--data.sampling.group_size=4",
        "--data.sampling.max_new_tokens=8",
        f"--data.rewards={reward}",
        "--model.optimizer=torch.optim.AdamW",
        "--model.optimizer.lr=0.01",
        f"--export_adapter={root / 'adapter'}",
        *extra,
    ]


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the run ended before writing {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)


def adapter(root: Path) -> dict[str, torch.Tensor]:
    return load_file(root / "adapter" / "adapter_model.safetensors")


def test_killed_run_resumes_to_the_same_weights(tmp_path, tiny_model_dir):
    (tmp_path / "resume_reward.py").write_text(_REWARD)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(tmp_path)}
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight = subprocess.Popen(
        fit_command(tiny_model_dir, straight_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    killed = subprocess.Popen(
        fit_command(tiny_model_dir, killed_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(killed_dir / "checkpoints" / "last.ckpt", killed)
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait() == -signal.SIGKILL
    finally:
        if killed.poll() is None:
            killed.kill()
    checkpoints = sorted(p.name for p in (killed_dir / "checkpoints").iterdir())
    assert checkpoints == ["epoch=0-step=2.ckpt", "last.ckpt"]  # killed inside epoch 1
    assert not (killed_dir / "adapter").exists()

    resumed = subprocess.run(
        fit_command(tiny_model_dir, killed_dir, "--ckpt_path=last"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restoring states from the checkpoint path" in resumed.stderr + resumed.stdout
    _, straight_log = straight.communicate(timeout=600)
    assert straight.returncode == 0, straight_log[-3000:]

    expected, actual = adapter(straight_dir), adapter(killed_dir)
    assert any(w.abs().max() > 0 for name, w in expected.items() if "lora_B" in name)  # it trained
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name  # bitwise, not merely close


# ---------------------------------------------- dataset modules (SFT, reward model, DPO)
def _dataset_run(kind: str, model_dir: str, root: Path, ckpt_path: Path | None = None) -> dict[str, torch.Tensor]:
    """Two epochs of 3 batches of an SFT, reward-model or DPO run with a checkpoint after every step;
    the trainable weights at the end."""
    import lightning as L

    from lit_grpo.algorithms.dpo import DPOModule
    from lit_grpo.algorithms.reward_model import RewardModelModule
    from lit_grpo.algorithms.sft import SFTModule
    from lit_grpo.data.preferences import PreferenceDataModule
    from lit_grpo.data.reward_pairs import RewardDataModule
    from lit_grpo.data.sft import SFTDataModule
    from lit_grpo.model.policy import LoraSpec, PolicySpec

    module_class, data_class = {
        "sft": (SFTModule, SFTDataModule),
        "rm": (RewardModelModule, RewardDataModule),
        "rm-until": (RewardModelModule, RewardDataModule),
        "dpo": (DPOModule, PreferenceDataModule),
    }[kind]
    policy = PolicySpec(name_or_path=model_dir, lora=LoraSpec(r=4, alpha=8, dropout=0.1))  # dropout draws the RNG
    options, data_options = {}, {"train_size": 12}
    if kind == "rm-until":  # a stage that ends on its accuracy, and the suffix loss from the next one
        options = {"suffix_weight": 1.0, "suffix_stages": [1]}
        data_options = {
            "train_size": 24,
            "curriculum": [
                {"share": 0.5, "task_args": {"slips": ["off_by_1"]}, "until": {"accuracy": 0.5, "pairs": 8}},
                {},
            ],
        }
    module = module_class(policy=policy, progress=False, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **options)
    data = data_class(val_size=4, batch_size=4, **data_options)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[checkpoints] if ckpt_path is None else [],
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return weights, dict(data.curriculum.ends) if data.curriculum else {}


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo", "rm-until"])
def test_dataset_runs_resume_exactly_from_inside_an_epoch(tmp_path, tiny_model_dir, kind):
    import lightning as L

    L.seed_everything(0)
    straight, ends = _dataset_run(kind, tiny_model_dir, tmp_path / "ckpt")
    assert any(k.endswith("reward_head.weight") for k in straight) == kind.startswith("rm")
    assert (ends == {0: 2}) == (kind == "rm-until")  # epoch 1's stage 0 ended after 2 of its 3 batches
    # rm-until: epochs of 6 batches; in epoch 1 before the stage ended (step 7), as it did (8), after (10)
    steps = (1, 7, 8, 10) if kind == "rm-until" else (1, 5)
    for name in (f"epoch=0-step={steps[0]}", *(f"epoch=1-step={s}" for s in steps[1:])):
        L.seed_everything(123)  # the resumed run must not depend on the global RNG it starts with
        resumed, resumed_ends = _dataset_run(
            kind, tiny_model_dir, tmp_path / "unused", tmp_path / "ckpt" / f"{name}.ckpt"
        )
        assert straight.keys() == resumed.keys() and resumed_ends == ends
        for key in straight:
            assert torch.equal(straight[key], resumed[key]), (name, key)
