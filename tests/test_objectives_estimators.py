"""Advantage estimators: RLOO, REINFORCE++, GAE -- hand-computed, and GAE vs a naive loop."""

import math

import pytest
import torch

from lit_grpo.objectives import (
    discounted_returns,
    gae_advantages,
    group_advantages,
    ppo_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)

NAN = float("nan")

# ----------------------------------------------------------------------------- RLOO


def test_rloo_hand_computed():
    # Group (1, 0, 0, 1): 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3, -2/3, 2/3.
    # Group (0, 3, 6, 3): 0 - 12/3 = -4, 3 - 9/3 = 0, 6 - 6/3 = 4, 3 - 9/3 = 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 3.0, 6.0, 3.0])
    out = rloo_advantages(rewards, group_size=4)
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -4.0, 0.0, 4.0, 0.0])
    torch.testing.assert_close(out.advantages, expected)
    assert not out.collapsed.any()


def test_rloo_is_group_centred_times_g_over_g_minus_1():
    torch.manual_seed(0)
    for group_size in (2, 3, 8):
        rewards = torch.randn(5 * group_size)
        centred = group_advantages(rewards, group_size, scale="none").advantages
        out = rloo_advantages(rewards, group_size)
        torch.testing.assert_close(out.advantages, group_size / (group_size - 1) * centred)
        # And the literal definition: r_i minus the mean of the other G-1 rewards.
        grouped = rewards.double().view(-1, group_size)  # [B, G]
        others = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)  # [B, G]
        torch.testing.assert_close(out.advantages, (grouped - others).view(-1).float())


def test_rloo_collapsed_group_is_exactly_zero():
    # [0.1]*4 in float32: leave-one-out means equal 0.1 only up to rounding; collapsed -> 0.0.
    rewards = torch.tensor([0.1] * 4 + [0.0, 1.0, 0.0, 1.0])
    out = rloo_advantages(rewards, group_size=4)
    assert torch.equal(out.advantages[:4], torch.zeros(4))
    assert out.collapsed.tolist() == [True] * 4 + [False] * 4
    # Group (0, 1, 0, 1): 0 - 2/3, 1 - 1/3, ...
    torch.testing.assert_close(out.advantages[4:], torch.tensor([-2 / 3, 2 / 3, -2 / 3, 2 / 3]))


def test_rloo_dtypes():
    assert rloo_advantages(torch.tensor([0, 1]), 2).advantages.dtype == torch.float32
    f64 = torch.tensor([0.0, 1.0], dtype=torch.float64)
    # G=2: 0 - 1 = -1, 1 - 0 = 1.
    assert rloo_advantages(f64, 2).advantages.tolist() == [-1.0, 1.0]


def test_rloo_errors_name_the_field():
    with pytest.raises(ValueError, match="group_size must be >= 2 for rloo.*got 1"):
        rloo_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="N=10.*group_size=4"):
        rloo_advantages(torch.zeros(10), group_size=4)


# ----------------------------------------------------------------------------- token rewards

# Two completions in T=3: lengths 2 and 3 (row 0's last column is padding).
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
REWARDS = torch.tensor([1.0, 2.0])
# k1 KL = logprobs - ref_logprobs: [[0.5, -0.5, pad], [1.0, 0.0, 0.5]]; NaN padding must not leak.
LOGPROBS = torch.tensor([[-1.0, -2.0, NAN], [-1.0, -1.0, -1.0]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.5, NAN], [-2.0, -1.0, -1.5]])


def test_ppo_token_rewards_hand_computed():
    # Without KL: the reward sits on the last real token only.
    no_kl = ppo_token_rewards(REWARDS, MASK)
    assert torch.equal(no_kl, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]))
    # beta=0.5: -0.5 * [[0.5, -0.5], [1.0, 0.0, 0.5]] = [[-0.25, 0.25], [-0.5, 0, -0.25]]
    # plus the rewards at the end: [[-0.25, 1.25, 0], [-0.5, 0, 1.75]].
    kl = ppo_token_rewards(REWARDS, MASK, LOGPROBS, REF_LOGPROBS, beta=0.5)
    assert torch.equal(kl, torch.tensor([[-0.25, 1.25, 0.0], [-0.5, 0.0, 1.75]]))


def test_ppo_token_rewards_masks_with_holes_and_empty_rows():
    # Row 0 ends at t=2 although t=3 is padding and t=1 a hole; row 1 has no real token.
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    out = ppo_token_rewards(torch.tensor([3.0, 5.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_ppo_token_rewards_errors():
    with pytest.raises(ValueError, match="beta=0.1 > 0 needs logprobs and ref_logprobs"):
        ppo_token_rewards(REWARDS, MASK, LOGPROBS, None, beta=0.1)
    with pytest.raises(ValueError, match="beta must be >= 0, got -1"):
        ppo_token_rewards(REWARDS, MASK, beta=-1.0)
    with pytest.raises(ValueError, match=r"rewards shape \(3,\).*\(2, 3\)"):
        ppo_token_rewards(torch.zeros(3), MASK)
    with pytest.raises(ValueError, match=r"ref_logprobs shape \(2, 2\)"):
        ppo_token_rewards(REWARDS, MASK, LOGPROBS, torch.zeros(2, 2), beta=0.1)


def test_discounted_returns_hand_computed():
    token_rewards = torch.tensor([[0.0, 1.0, NAN], [0.0, 0.0, 2.0]])
    # gamma=1: [[1, 1, 0], [2, 2, 2]]
    assert torch.equal(discounted_returns(token_rewards, MASK), torch.tensor([[1.0, 1, 0], [2, 2, 2]]))
    # gamma=0.5: row 0 [0 + 0.5*1, 1]; row 1 [0 + 0.5*1, 0 + 0.5*2, 2]
    half = discounted_returns(token_rewards, MASK, gamma=0.5)
    assert torch.equal(half, torch.tensor([[0.5, 1.0, 0.0], [0.5, 1.0, 2.0]]))
    # A hole links the real tokens on either side: [1, hole, 2] with gamma=0.5 -> [1 + 0.5*2, 0, 2]
    holed = discounted_returns(torch.tensor([[1.0, 7.0, 2.0]]), torch.tensor([[1, 0, 1]]), 0.5)
    assert torch.equal(holed, torch.tensor([[2.0, 0.0, 2.0]]))


# ----------------------------------------------------------------------------- whiten


def test_whiten_masked_population_stats():
    torch.manual_seed(0)
    values = torch.randn(6, 9, dtype=torch.float64) * 3 + 5
    mask = torch.arange(9) < torch.tensor([0, 2, 9, 5, 1, 7]).unsqueeze(-1)  # [6, 9]
    values[~mask] = NAN
    real = values[mask]
    out = whiten(values, mask)
    assert torch.equal(out[~mask], torch.zeros((~mask).sum().item(), dtype=torch.float64))
    torch.testing.assert_close(out[mask].mean(), torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(out[mask].std(correction=0), torch.tensor(1.0, dtype=torch.float64))
    # Against the formula with the eps inside the square root.
    expected = (real - real.mean()) / torch.sqrt(real.var(correction=0) + 1e-8)
    torch.testing.assert_close(out[mask], expected)
    kept = whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(kept[mask], expected + real.mean())


def test_whiten_hand_computed_population_not_sample():
    # (0, 1, 2) and a padded 9: mean 1, population var 2/3 -> (-1, 0, 1) / sqrt(2/3 + 1e-8)
    out = whiten(torch.tensor([0.0, 1.0, 2.0, 9.0]), torch.tensor([1, 1, 1, 0]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0, 0.0]) / math.sqrt(2 / 3))


def test_whiten_equal_values_and_empty_mask_are_zero():
    # float32 0.1s: a float32 mean may differ from 0.1 by an ulp, times 1/sqrt(1e-8) = 1e4.
    assert torch.equal(whiten(torch.full((7, 5), 0.1), torch.ones(7, 5)), torch.zeros(7, 5))
    assert torch.equal(whiten(torch.ones(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))


# ----------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_without_kl_hand_computed():
    # Token rewards [[0, 1, -], [0, 0, 2]] -> returns [[1, 1, 0], [2, 2, 2]].
    # Real returns 1, 1, 2, 2, 2: mean 1.6, deviations -0.6 x2, 0.4 x3,
    # population var (2*0.36 + 3*0.16)/5 = 0.24 -> -0.6/sqrt(0.24) = -sqrt(1.5), 0.4/sqrt(0.24) = sqrt(2/3).
    out = reinforce_pp_advantages(REWARDS, MASK)
    assert torch.equal(out.returns, torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]]))
    lo, hi = -math.sqrt(1.5), math.sqrt(2 / 3)
    torch.testing.assert_close(out.advantages, torch.tensor([[lo, lo, 0.0], [hi, hi, hi]]))
    assert out.advantages[0, 2] == 0.0


def test_reinforce_pp_with_kl_hand_computed():
    # Token rewards (see test_ppo_token_rewards_hand_computed) [[-0.25, 1.25, -], [-0.5, 0, 1.75]]
    # -> returns [[1.0, 1.25, 0], [1.25, 1.75, 1.75]].
    # Real returns 1.0, 1.25, 1.25, 1.75, 1.75: mean 1.4, deviations -0.4, -0.15 x2, 0.35 x2,
    # var (0.16 + 2*0.0225 + 2*0.1225)/5 = 0.45/5 = 0.09, std 0.3
    # -> advantages -0.4/0.3 = -4/3, -0.15/0.3 = -0.5, 0.35/0.3 = 7/6.
    out = reinforce_pp_advantages(REWARDS, MASK, LOGPROBS, REF_LOGPROBS, beta=0.5)
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.25, 0.0], [1.25, 1.75, 1.75]]))
    expected = torch.tensor([[-4 / 3, -0.5, 0.0], [-0.5, 7 / 6, 7 / 6]])
    torch.testing.assert_close(out.advantages, expected)
    real = out.advantages[MASK.bool()]
    torch.testing.assert_close(real.mean(), torch.tensor(0.0))
    torch.testing.assert_close(real.std(correction=0), torch.tensor(1.0))
    assert out.advantages[0, 2] == 0.0 and out.returns[0, 2] == 0.0


def test_reinforce_pp_gamma():
    # gamma=0.5, no KL: returns [[0.5, 1, -], [0.5, 1, 2]]; real mean (0.5+1+0.5+1+2)/5 = 1,
    # deviations -0.5, 0, -0.5, 0, 1 -> var (0.25+0.25+1)/5 = 0.3.
    out = reinforce_pp_advantages(REWARDS, MASK, gamma=0.5)
    torch.testing.assert_close(out.returns, torch.tensor([[0.5, 1.0, 0.0], [0.5, 1.0, 2.0]]))
    s = math.sqrt(0.3)
    torch.testing.assert_close(out.advantages, torch.tensor([[-0.5 / s, 0, 0], [-0.5 / s, 0, 1 / s]]))


def test_reinforce_pp_equal_rewards_give_exactly_zero():
    # Every return is 0.1 (gamma=1, no KL): no signal, not 1e4 * rounding noise.
    mask = torch.arange(6) < torch.tensor([3, 6, 1, 4]).unsqueeze(-1)  # [4, 6]
    out = reinforce_pp_advantages(torch.full((4,), 0.1), mask)
    assert torch.equal(out.advantages, torch.zeros(4, 6))


def test_reinforce_pp_is_detached_and_reads_no_logprobs_without_kl():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    out = reinforce_pp_advantages(REWARDS, MASK, logprobs, logprobs.detach() - 1.0, beta=0.1)
    assert not out.advantages.requires_grad and not out.returns.requires_grad
    # beta=0 ignores log-probs of the wrong shape entirely.
    reinforce_pp_advantages(REWARDS, MASK, torch.zeros(5), None, beta=0.0)


# ----------------------------------------------------------------------------- GAE


def naive_gae(token_rewards, values, mask, gamma, lam):
    """A_t = sum_l (gamma*lam)^l delta_{t+l} over each row's real tokens, as Python floats."""
    n_rows, n_cols = len(mask), len(mask[0])
    advantages = [[0.0] * n_cols for _ in range(n_rows)]
    for i in range(n_rows):
        idx = [t for t in range(n_cols) if mask[i][t]]
        for k, t in enumerate(idx):
            total = 0.0
            for j, s in enumerate(idx[k:]):
                v_next = values[i][idx[k + j + 1]] if k + j + 1 < len(idx) else 0.0
                delta = token_rewards[i][s] + gamma * v_next - values[i][s]
                total += (gamma * lam) ** j * delta
            advantages[i][t] = total
    return torch.tensor(advantages, dtype=torch.float64)


def test_gae_hand_computed():
    # One row r = [0, 0, 1], V = [0.5, 0.5, 0.5], padding last.
    r = torch.tensor([[0.0, 0.0, 1.0, NAN]])
    v = torch.tensor([[0.5, 0.5, 0.5, NAN]])
    m = torch.tensor([[1, 1, 1, 0]])
    # gamma=0.5, lam=0.5: deltas t2 = 1 + 0.5*0 - 0.5 = 0.5, t1 = t0 = 0 + 0.5*0.5 - 0.5 = -0.25;
    # A2 = 0.5, A1 = -0.25 + 0.25*0.5 = -0.125, A0 = -0.25 + 0.25*(-0.125) = -0.28125;
    # returns = A + V = 0.21875, 0.375, 1.0.
    out = gae_advantages(r, v, m, gamma=0.5, lam=0.5)
    assert torch.equal(out.advantages, torch.tensor([[-0.28125, -0.125, 0.5, 0.0]]))
    assert torch.equal(out.returns, torch.tensor([[0.21875, 0.375, 1.0, 0.0]]))
    # gamma=1, lam=1: returns [1, 1, 1], A = returns - V = 0.5 each.
    out = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    assert torch.equal(out.advantages, torch.tensor([[0.5, 0.5, 0.5, 0.0]]))
    # lam=0, gamma=1: one-step TD, 0 + 0.5 - 0.5 = 0, 0, 1 + 0 - 0.5 = 0.5.
    out = gae_advantages(r, v, m, gamma=1.0, lam=0.0)
    assert torch.equal(out.advantages, torch.tensor([[0.0, 0.0, 0.5, 0.0]]))


def _ragged_case(seed, n_rows=7, n_cols=11, holes=False):
    gen = torch.Generator().manual_seed(seed)
    token_rewards = torch.randn(n_rows, n_cols, generator=gen, dtype=torch.float64)
    values = torch.randn(n_rows, n_cols, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, n_cols + 1, (n_rows,), generator=gen)
    lengths[0], lengths[1] = 0, n_cols  # an empty row and a full one
    mask = torch.arange(n_cols) < lengths.unsqueeze(-1)  # [N, T]
    if holes:
        mask &= torch.rand(n_rows, n_cols, generator=gen) > 0.3
    token_rewards[~mask] = NAN  # garbage at padding must not leak
    values[~mask] = NAN
    return token_rewards, values, mask


GAMMA_LAM = [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0), (0.0, 0.5), (1.0, 0.0)]


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_gae_matches_naive_loop(gamma, lam, holes):
    for seed in range(3):
        token_rewards, values, mask = _ragged_case(seed, holes=holes)
        out = gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)
        expected = naive_gae(token_rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        torch.testing.assert_close(out.advantages, expected)
        v = torch.where(mask, values, 0.0)
        torch.testing.assert_close(out.returns, torch.where(mask, expected + v, 0.0))
        zeros = torch.zeros((~mask).sum().item(), dtype=torch.float64)
        assert torch.equal(out.advantages[~mask], zeros) and torch.equal(out.returns[~mask], zeros)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_gae_lam_one_is_discounted_returns_minus_values(gamma):
    token_rewards, values, mask = _ragged_case(11, holes=True)
    out = gae_advantages(token_rewards, values, mask, gamma=gamma, lam=1.0)
    returns = discounted_returns(token_rewards, mask, gamma)  # [N, T]
    torch.testing.assert_close(out.returns, returns)
    torch.testing.assert_close(out.advantages, torch.where(mask, returns - values, 0.0))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_lam_zero_is_one_step_td(gamma):
    # Right-padded rows: delta_t = r_t + gamma * V_{t+1} - V_t, V = 0 from the first padding on.
    token_rewards, values, mask = _ragged_case(12)
    v = torch.where(mask, values, 0.0)  # [N, T]
    v_next = torch.cat([v[:, 1:], torch.zeros(v.shape[0], 1, dtype=v.dtype)], dim=1)  # [N, T]
    expected = torch.where(mask, token_rewards + gamma * v_next - v, 0.0)
    out = gae_advantages(token_rewards, values, mask, gamma=gamma, lam=0.0)
    torch.testing.assert_close(out.advantages, expected)


def test_gae_with_ppo_token_rewards_and_dtypes():
    # bf16 critic values, float32 rewards: computed and returned in float32, detached.
    values = torch.tensor([[0.5, 0.25, 0.0], [1.0, 0.5, 0.0]], dtype=torch.bfloat16, requires_grad=True)
    token_rewards = ppo_token_rewards(REWARDS, MASK)  # [[0, 1, 0], [0, 0, 2]]
    out = gae_advantages(token_rewards, values, MASK, gamma=1.0, lam=1.0)
    # returns [[1, 1, 0], [2, 2, 2]] - values [[0.5, 0.25, -], [1, 0.5, 0]]
    assert out.advantages.dtype == torch.float32 and not out.advantages.requires_grad
    assert torch.equal(out.advantages, torch.tensor([[0.5, 0.75, 0.0], [1.0, 1.5, 2.0]]))


def test_token_estimators_errors_name_the_field():
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got 1.5"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 3), MASK, gamma=1.0, lam=1.5)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got -0.1"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 3), MASK, gamma=-0.1, lam=1.0)
    with pytest.raises(ValueError, match=r"values shape \(2, 4\) does not match completion_mask shape \(2, 3\)"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), MASK, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"completion_mask must be \[N, T\], got shape \(3,\)"):
        discounted_returns(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 2"):
        reinforce_pp_advantages(REWARDS, MASK, gamma=2.0)
    with pytest.raises(ValueError, match=r"mask shape \(3,\) does not match values shape \(2, 3\)"):
        whiten(torch.zeros(2, 3), torch.ones(3))
