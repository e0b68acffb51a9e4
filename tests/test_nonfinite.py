"""A NaN/inf gradient skips the optimizer step, is counted and logged, and K in a
row stop training with an error while the last good checkpoint stays intact.

Checked under automatic optimization with gradient clipping and gradient
accumulation both on: the guard looks at the accumulated gradient before
Lightning clips it and before ``optimizer.step()``.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import PolicySpec
from lit_grpo.rewards import Accuracy
from lit_grpo.training.checkpointing import AtomicCheckpointIO
from lit_grpo.training.guard import NonFiniteStepsError


class PoisonedGRPO(GRPOModule):
    """GRPOModule whose loss is NaN on chosen ``(epoch, batch_idx)`` micro-batches."""

    def __init__(self, poison: set[tuple[int, int]], **kwargs) -> None:
        super().__init__(**kwargs)
        self.poison = poison

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if (self.current_epoch, batch_idx) in self.poison else loss


def test_nonfinite_steps_are_skipped_counted_and_stop_training(tmp_path, tiny_model_dir):
    # 2 prompts x 4 completions = 8 rows, micro-batches of 2, 2 per optimizer step:
    # 4 micro-batches and 2 optimizer steps per epoch.
    # Epoch 0: micro-batch 0 (first half of step 1) is NaN -> step 1 skipped, step 2 applied
    # (which resets the run of consecutive skips).
    # Epoch 1: every micro-batch is NaN -> 2 skips in a row = max_nonfinite_steps -> error.
    poison = {(0, 0)} | {(1, b) for b in range(4)}
    # The LR halves with every optimizer step taken (a per-step schedule).
    module = PoisonedGRPO(
        poison,
        policy=PolicySpec(name_or_path=tiny_model_dir),
        max_nonfinite_steps=2,
        progress=False,
        validate_before_training=False,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        scheduler=lambda optimizer: torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.5),
    )
    data = OnPolicyDataModule(
        source=SourceSpec(train_size=40),
        held_out=HeldOutSpec(size=4),
        prompts_per_epoch=2,
        batch_size=2,
        sampling=SamplingSpec(group_size=4, max_new_tokens=4),
        rewards=[Accuracy()],
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=3,
        reload_dataloaders_every_n_epochs=1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[checkpoint],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=tmp_path,
    )
    with pytest.raises(
        NonFiniteStepsError,
        match=r"2 consecutive optimizer steps had a NaN/inf gradient "
        r"\(model.max_nonfinite_steps=2\); training stopped",
    ):
        trainer.fit(module, data)

    assert module.guard.skipped == 3
    assert trainer.callback_metrics["train/skipped_steps"] == 1  # logged at the end of epoch 0
    # Lightning counts a skipped step in global_step, like an AMP step skipped for inf,
    # but the per-step LR schedule only moves with the steps taken: 1 of 3.
    assert trainer.global_step == 3
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 1
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(5e-5)

    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert (saved["epoch"], saved["global_step"]) == (0, 2)  # the last good checkpoint, intact
    assert saved["nonfinite_guard"] == {"skipped": 1, "consecutive": 0}
    weights = saved["state_dict"]
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    # Adam counted one step per parameter, not two: the skipped step never reached it.
    steps = {float(state["step"]) for state in saved["optimizer_states"][0]["state"].values()}
    assert steps == {1.0}
    # The weights in memory are those of the checkpoint: nothing NaN was applied after it.
    for name, value in module.state_dict().items():
        assert torch.equal(value, weights[name]), name
