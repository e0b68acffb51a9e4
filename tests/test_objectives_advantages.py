"""group_advantages: hand-computed scales, collapsed groups, errors."""

import math

import pytest
import torch

from lit_grpo.objectives import group_advantages, grpo_loss

# Two groups of G=2: (0, 2) has mean 1, population std 1; (1, 5) has mean 3, std 2.
REWARDS = torch.tensor([0.0, 2.0, 1.0, 5.0])


def test_group_scale_hand_computed():
    # (0-1)/1, (2-1)/1, (1-3)/2, (5-3)/2 = -1, 1, -1, 1
    out = group_advantages(REWARDS, group_size=2, eps=0.0)
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    assert not out.collapsed.any()


def test_group_scale_default_eps():
    # eps=1e-4 in the denominator: 1 / (1 + 1e-4) and 2 / (2 + 1e-4)
    out = group_advantages(REWARDS, group_size=2)
    expected = torch.tensor([-1 / 1.0001, 1 / 1.0001, -2 / 2.0001, 2 / 2.0001])
    torch.testing.assert_close(out.advantages, expected)


def test_batch_scale_hand_computed():
    # batch mean 2; deviations -2, 0, -1, 3 -> var (4+0+1+9)/4 = 3.5 (population)
    # centred within groups: -1, 1, -2, 2, all divided by sqrt(3.5) = 1.8708
    out = group_advantages(REWARDS, group_size=2, scale="batch", eps=0.0)
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0]) / math.sqrt(3.5)
    torch.testing.assert_close(out.advantages, expected)


def test_none_scale_is_centred_only():
    # Dr. GRPO: r - group mean = 0-1, 2-1, 1-3, 5-3
    out = group_advantages(REWARDS, group_size=2, scale="none")
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 1.0, -2.0, 2.0]))


def test_population_not_sample_std():
    # (0, 1, 2): population std sqrt(2/3) = 0.8165; sample std would be 1.
    out = group_advantages(torch.tensor([0.0, 1.0, 2.0]), group_size=3, eps=0.0)
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 0.0, 1.0]) / math.sqrt(2 / 3))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_collapsed_group_is_exactly_zero(scale):
    # [0.1]*8 in float32: a float32 mean/std would give std ~1e-9 and
    # (0.1 - mean) / (1e-9 + 1e-4) ~ 1e-5 noise; collapsed means exactly 0.0.
    rewards = torch.tensor([0.1] * 8 + [0.0, 1.0] * 4, dtype=torch.float32)
    out = group_advantages(rewards, group_size=8, scale=scale)
    assert torch.equal(out.advantages[:8], torch.zeros(8))
    assert out.collapsed.tolist() == [True] * 8 + [False] * 8
    assert (out.advantages[8:] != 0).all()
    logprobs = torch.zeros(16, 3, requires_grad=True)
    loss = grpo_loss(logprobs, logprobs.detach(), out.advantages, torch.ones(16, 3), beta=0.0).loss
    loss.backward()
    assert torch.isfinite(loss)
    # A=0 for the collapsed rows: -min(1*0, 1*0) has zero gradient.
    assert torch.equal(logprobs.grad[:8], torch.zeros(8, 3))


@pytest.mark.parametrize("value,group_size", [(0.1, 8), (0.3, 8), (0.7, 8), (0.1, 7)])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_single_collapsed_group_float32(value, group_size, scale):
    # One group alone: torch's float32 std of [0.1]*8 is 7.45e-9, of [0.7]*8 6e-8,
    # so a float32 formula gives |A| ~ 7e-5 .. 6e-4 (and 7e-9 / 0 -> huge with eps=0).
    rewards = torch.full((group_size,), value, dtype=torch.float32)
    for eps in (1e-4, 0.0):
        out = group_advantages(rewards, group_size, scale=scale, eps=eps)
        assert torch.equal(out.advantages, torch.zeros(group_size)) and out.collapsed.all()


def test_rounding_noise_counts_as_collapsed():
    # 0.1 + 0.2 = 0.30000000000000004 != 0.3: std 2.8e-17, far below 1e-6 * (1 + 0.3)
    out = group_advantages(torch.tensor([0.1 + 0.2, 0.3], dtype=torch.float64), group_size=2)
    assert torch.equal(out.advantages, torch.zeros(2, dtype=torch.float64))
    assert out.collapsed.all()


def test_small_real_difference_is_not_collapsed():
    # (0, 1e-3): std 5e-4 > 1e-6 * (1 + 5e-4); A = +-5e-4 / (5e-4 + 1e-4) = +-0.8333
    out = group_advantages(torch.tensor([0.0, 1e-3]), group_size=2)
    torch.testing.assert_close(out.advantages, torch.tensor([-5 / 6, 5 / 6]))
    assert not out.collapsed.any()


def test_dtypes():
    assert group_advantages(torch.tensor([0, 1]), 2).advantages.dtype == torch.float32
    f64 = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert group_advantages(f64, 2).advantages.dtype == torch.float64


def test_errors_say_what_was_given():
    with pytest.raises(ValueError, match="group_size must be >= 2.*got 1"):
        group_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="N=10.*group_size=4"):
        group_advantages(torch.zeros(10), group_size=4)
    with pytest.raises(ValueError, match=r"\['batch', 'group', 'none'\].*'std'"):
        group_advantages(torch.zeros(4), group_size=2, scale="std")
    with pytest.raises(ValueError, match=r"1-D.*\(2, 2\)"):
        group_advantages(torch.zeros(2, 2), group_size=2)
