"""Sampling ahead of training (``data.staleness``): rollout n+k is sampled while rollout n trains.

The tags are checked (each micro-batch says which policy version sampled it),
a run killed with SIGKILL while the worker samples, inside backward and
before an optimizer step, then preempted with SIGTERM, resumes to the adapter
of a straight run bit for bit (the pending rollouts' prompts and frozen
weights are in the checkpoint), and what cannot sample ahead is refused in
one line.
"""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from test_chaos import alongside, finished, fit_command, run

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import LoraSpec, PolicySpec


def letters(prompts, completions, **columns):
    return [sum(ch.isalpha() for ch in text) / max(len(text), 1) for text in completions]


class Tags(L.Callback):
    """``(epoch, global step, the batch's policy version)`` of every micro-batch trained."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((trainer.current_epoch, trainer.global_step, batch["policy_version"]))


def fit(model_dir: str, root, staleness: int, epochs: int = 4, **data) -> tuple[Tags, L.Trainer]:
    L.seed_everything(0)
    module = GRPOModule(
        policy=PolicySpec(name_or_path=model_dir, lora=LoraSpec(r=4)), progress=False, validate_before_training=False
    )
    datamodule = OnPolicyDataModule(
        **{
            **dict(
                source=SourceSpec(train_size=20),
                held_out=HeldOutSpec(size=2),
                prompts_per_epoch=2,
                batch_size=8,
                staleness=staleness,
                rewards=[letters],
                sampling=SamplingSpec(group_size=4, max_new_tokens=8),
            ),
            **data,
        }
    )
    tags = Tags()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        reload_dataloaders_every_n_epochs=1,
        callbacks=[tags],
        default_root_dir=root,
    )
    trainer.fit(module, datamodule)
    return tags, trainer


def test_staleness_1_trains_each_epoch_on_the_rollout_the_previous_version_sampled(tiny_model_dir, tmp_path):
    # One optimizer step per epoch: epoch n trains at version n on what version n-1 sampled (epoch 0: 0).
    tags, trainer = fit(tiny_model_dir, tmp_path, staleness=1)
    assert tags.seen == [(0, 0, 0), (1, 1, 0), (2, 2, 1), (3, 3, 2)]
    metrics = trainer.callback_metrics
    assert float(metrics["rollout/staleness"]) == 1.0
    assert {"time/rollout_wait", "time/sampler_waited_for_weights", "sampler/is_capped_fraction"} <= set(metrics)


def test_staleness_2_samples_two_rollouts_ahead_and_0_none(tiny_model_dir, tmp_path):
    tags, _ = fit(tiny_model_dir, tmp_path, staleness=2)
    assert [version for *_, version in tags.seen] == [0, 0, 0, 1]
    tags, trainer = fit(tiny_model_dir, tmp_path, staleness=0, epochs=2)
    assert tags.seen == [(0, 0, 0), (1, 1, 1)]
    assert "rollout/staleness" not in trainer.callback_metrics


def ahead_command(model_dir: str, root, *extra: str) -> list[str]:
    return fit_command(model_dir, root, "--data.staleness=1", "--trainer.max_epochs=3", *extra)


def test_killed_and_preempted_under_staleness_1_resumes_to_the_straight_runs_adapter(tmp_path, tiny_model_dir):
    straight = alongside(ahead_command(tiny_model_dir, tmp_path / "straight"))
    root = tmp_path / "struck"
    # The first kill lands before epoch 1's first step, so the second run waits for epoch 1's rollout,
    # relaunched from the checkpoint, when SIGTERM comes: a job relaunched is still pending in its save.
    for phase, epoch, index, strike in [
        ("rollout", 1, 5, "SIGKILL"),  # the worker sampling epoch 2's rollout while epoch 1 trains
        ("rollout", 1, 5, "SIGTERM"),  # preempted while the worker samples: its job stays pending
        ("backward", 1, 2, "SIGKILL"),  # inside epoch 1, epoch 2's rollout pending
        ("backward", 2, 0, "SIGTERM"),  # preempted: saves at the next step and exits 143
        ("optimizer", 2, 2, "SIGKILL"),  # before the last step (the resumed loop counts from 0)
    ]:
        result = run(
            ahead_command(
                tiny_model_dir,
                root,
                "--ckpt_path=last",
                "--trainer.callbacks+=chaos.Chaos",
                f"--trainer.callbacks.phase={phase}",
                f"--trainer.callbacks.epoch={epoch}",
                f"--trainer.callbacks.index={index}",
                f"--trainer.callbacks.strike={strike}",
            )
        )
        expected = -9 if strike == "SIGKILL" else 143
        assert result.returncode == expected, f"{phase} {epoch} {index}:\n{result.stderr[-3000:]}"
    resumed = run(ahead_command(tiny_model_dir, root, "--ckpt_path=last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    finished(straight)
    expected = load_file(tmp_path / "straight" / "adapter" / "adapter_model.safetensors")
    got = load_file(root / "adapter" / "adapter_model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize(
    ("data", "module", "message"),
    [
        ({"staleness": -1}, {}, r"data.staleness=-1; expected >= 0"),
        ({"staleness": 1}, {"lora": None}, r"data.staleness=1: full fine-tuning has no adapter to freeze"),
    ],
)
def test_what_cannot_sample_ahead_is_refused_in_one_line(tiny_model_dir, tmp_path, data, module, message):
    with pytest.raises(ValueError, match=message):
        policy = dataclasses.replace(PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4)), **module)
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            reload_dataloaders_every_n_epochs=1,
            default_root_dir=tmp_path,
        )
        trainer.fit(
            GRPOModule(policy=policy, progress=False, validate_before_training=False),
            OnPolicyDataModule(
                source=SourceSpec(train_size=20),
                held_out=HeldOutSpec(size=2),
                prompts_per_epoch=2,
                batch_size=8,
                rewards=[letters],
                sampling=SamplingSpec(group_size=4, max_new_tokens=4),
                **data,
            ),
        )
