"""ppo_loss: hand-computed cases (the arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo.objectives import grpo_loss, ppo_loss


def _loss(logprobs, old, adv, mask, values, old_values, returns, **kw):
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return ppo_loss(t(logprobs), t(old), t(adv), t(mask), t(values), t(old_values), t(returns), **kw)


def test_value_loss_takes_the_larger_of_clipped_and_unclipped():
    # token 1: V=1.0, V_old=0.5, R=0.0: clip(V) = 0.7 -> max(1.0, 0.49) = 1.0 (unclipped larger)
    # token 2: V=0.0, V_old=0.5, R=0.0: clip(V) = 0.3 -> max(0.0, 0.09) = 0.09 (clipped larger)
    # token 3: padding.  value loss = (1.0 + 0.09) / 2 = 0.545; policy term 0 (A = 0)
    out = _loss(
        [[0.0, 0.0, 5.0]],
        [[0.0, 0.0, -5.0]],
        [[0.0, 0.0, 9.0]],
        [[1, 1, 0]],
        [[1.0, 0.0, 7.0]],
        [[0.5, 0.5, 0.0]],
        [[0.0, 0.0, 3.0]],
        value_clip=0.2,
        vf_coef=0.5,
    )
    assert out.metrics["value_loss"].item() == pytest.approx(0.545)
    assert out.loss.item() == pytest.approx(0.5 * 0.545)
    assert out.metrics["value_clip_fraction"].item() == pytest.approx(0.5)
    assert out.metrics["value/mean"].item() == pytest.approx(0.5)


def test_policy_term_is_clipped_per_token_with_its_own_advantage():
    # token 1: ratio = e > 1.2, A = +1 -> -min(e, 1.2) = -1.2
    # token 2: ratio = 1/e = 0.37 < 0.8, A = -2: ratio*A = -0.74, clipped 0.8*A = -1.6 -> -min = +1.6
    # bnpo mean: (-1.2 + 1.6) / 2 = 0.2
    out = _loss(
        [[1.0, -1.0]], [[0.0, 0.0]], [[1.0, -2.0]], [[1, 1]], [[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], vf_coef=0.0
    )
    assert out.metrics["policy_loss"].item() == pytest.approx(0.2)
    assert out.loss.item() == pytest.approx(0.2)
    assert out.metrics["clip_ratio/high"].item() == pytest.approx(0.5)
    assert out.metrics["clip_ratio/low"].item() == pytest.approx(0.5)
    assert out.metrics["ratio/mean"].item() == pytest.approx((math.e + 1 / math.e) / 2)


def test_constant_token_advantages_match_grpo_loss():
    torch.manual_seed(0)
    logprobs, old = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([0.5, -1.0, 2.0])
    zeros = torch.zeros(3, 5)
    for loss_type in ("bnpo", "grpo", "dr_grpo"):
        ours = ppo_loss(
            logprobs,
            old,
            adv[:, None].expand(3, 5),
            mask,
            zeros,
            zeros,
            zeros,
            loss_type=loss_type,
            max_completion_length=5,
        )
        theirs = grpo_loss(logprobs, old, adv, mask, beta=0.0, loss_type=loss_type, max_completion_length=5)
        torch.testing.assert_close(ours.loss, theirs.loss)


def test_gradients_reach_policy_and_values_and_explained_variance():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    values = torch.tensor([[0.0, 2.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 3.0]])
    out = ppo_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([[1.0, 1.0]]),
        torch.ones(1, 2),
        values,
        values.detach(),
        returns,
        vf_coef=1.0,
    )
    out.loss.backward()
    # d/dV mean((V - R)^2) = (V - R) = -1 per token (clip inactive at V = V_old)
    torch.testing.assert_close(values.grad, torch.tensor([[-1.0, -1.0]]))
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.5]]))  # -A / 2 tokens
    # R - V = [1, 1] has no variance: everything is explained
    assert out.metrics["explained_variance"].item() == pytest.approx(1.0)


def test_bad_inputs_name_the_field():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"returns shape \(2, 2\) does not match logprobs shape \(2, 3\)"):
        ppo_loss(x, x, x, x, x, x, torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"value_clip must be >= 0, got -1"):
        ppo_loss(x, x, x, x, x, x, x, value_clip=-1)
