"""REINFORCE++ on GRPOModule: grpo_loss on per-token advantages, and the
``reinforce_pp`` estimator end to end on a tiny random Llama."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import AdvantageSpec, HeldOutSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import PolicySpec
from lit_grpo.objectives import grpo_loss, reinforce_pp_advantages


# ------------------------------------------------------------------ grpo_loss on [N, T] advantages
def test_token_advantages_hand_computed():
    logprobs = torch.tensor([[1.0, 0.0, 5.0]])
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, -2.0, float("nan")]])  # garbage at padding is ignored
    mask = torch.tensor([[1, 1, 0]])
    # token 0: ratio=e > 1.2, A=+1 -> -min(e, 1.2) = -1.2; token 1: ratio=1, A=-2 -> +2
    out = grpo_loss(logprobs, old, advantages, mask, beta=0.0, loss_type="bnpo")
    torch.testing.assert_close(out.loss, torch.tensor((-1.2 + 2.0) / 2))
    assert float(out.metrics["clip_ratio/high"]) == 0.5  # token 0 of 2 real tokens


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("importance_level", ["token", "sequence"])
def test_constant_token_advantages_equal_sequence_advantages(loss_type, importance_level):
    torch.manual_seed(0)
    logprobs = torch.randn(4, 5, requires_grad=True)
    old, ref = logprobs.detach() + 0.3 * torch.randn(4, 5), torch.randn(4, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    advantages = torch.tensor([0.5, -1.0, 2.0, 0.7])
    options = dict(
        ref_logprobs=ref,
        beta=0.04,
        loss_type=loss_type,
        importance_level=importance_level,
        max_completion_length=5,
        num_items=7,
    )
    sequence = grpo_loss(logprobs, old, advantages, mask, **options)
    token = grpo_loss(logprobs, old, advantages[:, None].expand(4, 5), mask, **options)
    torch.testing.assert_close(token.loss, sequence.loss)
    for name in sequence.metrics:
        torch.testing.assert_close(token.metrics[name], sequence.metrics[name])
    (grad_token,) = torch.autograd.grad(token.loss, logprobs)
    (grad_sequence,) = torch.autograd.grad(sequence.loss, logprobs)
    torch.testing.assert_close(grad_token, grad_sequence)


def test_token_advantages_of_another_width_are_refused():
    logprobs = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages shape \(2, 4\) does not match logprobs shape \(2, 3\)"):
        grpo_loss(logprobs, logprobs, torch.zeros(2, 4), torch.ones(2, 3), beta=0.0)


# ------------------------------------------------------------------ the estimator on GRPOModule
def length_reward(prompts, completions, **columns):
    return [float(len(c)) / 10 for c in completions]


def fit(tmp_path, tiny_model_dir, beta, group_size, epochs=1, callbacks=()):
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir),
        progress=False,
        beta=beta,
        validate_before_training=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    data = OnPolicyDataModule(
        prompts_per_epoch=4,
        batch_size=4,
        held_out=HeldOutSpec(size=4),
        source=SourceSpec(train_size=40),
        advantage=AdvantageSpec(estimator="reinforce_pp"),
        rewards=[length_reward],
        sampling=SamplingSpec(group_size=group_size, max_new_tokens=6),
    )
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    L.Trainer(
        max_epochs=epochs,
        reload_dataloaders_every_n_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
    ).fit(module, data)
    changed = {n for n, p in module.named_parameters() if not torch.equal(before[n], p)}
    return module, data, changed


def rollout_rewards(module, rows) -> torch.Tensor:
    texts = [
        module.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(rows["completion_ids"], rows["completion_mask"])
    ]
    return torch.tensor(length_reward(None, texts))


def test_without_kl_the_advantages_are_the_whitened_rewards_of_each_token(tmp_path, tiny_model_dir):
    L.seed_everything(0)
    module, data, changed = fit(tmp_path, tiny_model_dir, beta=0.0, group_size=1)  # G = 1: no group needed
    rows = data.last_result.rows
    mask = rows["completion_mask"]  # [4, C]
    assert rows["advantages"].shape == mask.shape and "ref_logprobs" not in rows and "old_logprobs" not in rows
    # gamma = 1 and no KL: every real token's return is its row's reward r_i. Whitening over
    # the real tokens weighs each row by its length n_i: mean = sum n_i r_i / sum n_i,
    # var = sum n_i (r_i - mean)^2 / sum n_i, A_i = (r_i - mean) / sqrt(var + 1e-8).
    r, n = rollout_rewards(module, rows).double(), mask.sum(-1).double()
    mean = (n * r).sum() / n.sum()
    std = math.sqrt(float((n * (r - mean) ** 2).sum() / n.sum()) + 1e-8)
    expected = ((r - mean) / std)[:, None] * mask  # [4, C], 0 at padding
    torch.testing.assert_close(rows["advantages"], expected.float())
    assert any(".lora_B." in name for name in changed)
    assert all("lora_" in name for name in changed)  # the base stayed frozen
    metrics = module.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and "train/kl" not in metrics


def test_kl_goes_into_the_rewards_and_the_policy_trains(tmp_path, tiny_model_dir):
    L.seed_everything(0)
    module, data, changed = fit(tmp_path, tiny_model_dir, beta=0.1, group_size=2, epochs=2)
    rows = data.last_result.rows
    mask = rows["completion_mask"]
    # The rollout stored the log-probs its per-token rewards read: pi_old and the reference's.
    expected = reinforce_pp_advantages(
        rollout_rewards(module, rows), mask, rows["old_logprobs"], rows["ref_logprobs"], beta=0.1
    )
    torch.testing.assert_close(rows["advantages"], expected.advantages)
    assert not torch.equal(
        expected.advantages, reinforce_pp_advantages(rollout_rewards(module, rows), mask).advantages
    )  # the KL counts
    assert any(".lora_B." in name for name in changed)
    metrics = module.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"])
    assert "train/kl" not in metrics  # the KL is in the rewards, so the loss has none
    k1 = (rows["old_logprobs"] - rows["ref_logprobs"])[mask.bool()].mean()
    assert math.isfinite(float(metrics["rollout/kl"])) and float(k1) == pytest.approx(data.last_stats["rollout/kl"])
