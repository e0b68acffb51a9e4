"""Length handling in a run's metrics: DAPO's overlong filtering and soft overlong penalty."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import PolicySpec
from lit_grpo.rewards import OverlongPenalty

MAX_NEW_TOKENS = 6


@pytest.fixture()
def often_ending_model_dir(tmp_path, tiny_model_dir) -> str:
    """The tiny random model with a sixth of its vocabulary ending a completion, so that
    some completions end early and some run to the limit (truncated)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config.eos_token_id = list(range(0, model.config.vocab_size, 6))
    model.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_overlong_filtering_and_penalty_are_logged(tmp_path, often_ending_model_dir):
    module = GRPOModule(
        policy=PolicySpec(name_or_path=often_ending_model_dir),
        progress=False,
        log_samples=0,
        validate_before_training=False,
    )
    data = OnPolicyDataModule(
        prompts_per_epoch=4,
        batch_size=16,
        held_out=HeldOutSpec(size=1),
        source=SourceSpec(train_size=8),
        sampling=SamplingSpec(group_size=4, max_new_tokens=MAX_NEW_TOKENS, mask_truncated=True),
        # the ramp spans the whole budget: a completion of n tokens gets -n / 6
        rewards=[OverlongPenalty(max_len=MAX_NEW_TOKENS, buffer=MAX_NEW_TOKENS)],
    )
    trainer = L.Trainer(
        max_epochs=1,
        reload_dataloaders_every_n_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, data)
    logged, stats = trainer.callback_metrics, data.last_stats
    names = (
        "reward/overlong_penalty",
        "rollout/truncated_fraction",
        "rollout/masked_token_fraction",
        "completion/length_mean",
    )
    for name in names:
        assert name in logged, name
        torch.testing.assert_close(float(logged[name]), stats[name])
    truncated, length = stats["rollout/truncated_fraction"], stats["completion/length_mean"]
    assert 0 < truncated < 1  # a mix: some completions ended, some ran into the limit
    # the mean of -n_i / 6 over the rows is -(mean length) / 6
    assert stats["reward/overlong_penalty"] == pytest.approx(-length / MAX_NEW_TOKENS)
    # every truncated row has 6 tokens, all dropped: 6 * truncated rows / all tokens, above the row fraction
    assert stats["rollout/masked_token_fraction"] == pytest.approx(MAX_NEW_TOKENS * truncated / length)
    assert stats["rollout/masked_token_fraction"] > truncated


def test_no_masked_token_fraction_without_overlong_filtering(tmp_path, tiny_model_dir):
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir), progress=False, log_samples=0, validate_before_training=False
    )
    data = OnPolicyDataModule(
        prompts_per_epoch=1,
        batch_size=2,
        held_out=HeldOutSpec(size=1),
        source=SourceSpec(train_size=2),
        sampling=SamplingSpec(group_size=2, max_new_tokens=2),
        rewards=[OverlongPenalty(max_len=2, buffer=1)],
    )
    trainer = L.Trainer(
        max_epochs=1,
        reload_dataloaders_every_n_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, data)
    assert "rollout/truncated_fraction" in data.last_stats
    assert "rollout/masked_token_fraction" not in data.last_stats
