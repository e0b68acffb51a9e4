"""Advantage estimators beside GRPO's :func:`group_advantages` (pure torch).

A config names one with ``data.advantage.estimator: grpo | rloo | reinforce_pp | gae``.
They need different inputs and return different shapes, so there is
deliberately no common signature; the rollout code calls the one named:

* ``grpo`` -- :func:`group_advantages` ``(rewards [N], group_size)`` ->
  :class:`Advantages`, one scalar per completion.
* ``rloo`` -- :func:`rloo_advantages` ``(rewards [N], group_size)`` ->
  :class:`Advantages`, one scalar per completion.
* ``reinforce_pp`` -- :func:`reinforce_pp_advantages` ``(rewards [N],
  completion_mask [N, T], logprobs, ref_logprobs)`` (the log-probs only when
  ``beta > 0``) -> :class:`TokenAdvantages` ``[N, T]``. Needs no group: G = 1
  works.
* ``gae`` -- :func:`gae_advantages` ``(token_rewards [N, T], values [N, T],
  completion_mask)`` -> :class:`TokenAdvantages` ``[N, T]``; needs a critic
  for ``values``, and ``token_rewards`` from :func:`ppo_token_rewards`.

``grpo_loss`` takes one advantage per completion ``[N]`` or one per token
``[N, T]`` (what the token-level estimators give); ``ppo_loss`` takes ``[N, T]``.

The algorithms, and where they depart from their sources:

* RLOO (Kool et al. 2019; Ahmadian et al. 2024): ``A_i = r_i - mean of the
  other G-1 rewards of i's group = G/(G-1) * (r_i - mean_g)``. Sequence-level,
  like GRPO, with the KL kept in the loss; OpenRLHF's "rloo" instead puts a
  per-token KL into the reward.
* REINFORCE++ (Hu, 2025): per-token rewards from :func:`ppo_token_rewards`
  (the sequence reward on the last real token, minus ``beta`` times the k1 KL
  ``logprobs - ref_logprobs`` at every real token, as OpenRLHF and verl do),
  returns = their discounted reverse sum, advantages = the returns whitened
  over all real tokens of the batch. :func:`whiten` uses the *population*
  variance (as OpenRLHF; verl's ``masked_whiten`` uses Bessel's correction)
  and ``(x - mean) / sqrt(var + eps)``, ``eps = 1e-8``.
* GAE (Schulman et al. 2016): ``delta_t = r_t + gamma * V_{t+1} - V_t``,
  ``A_t = delta_t + gamma * lam * A_{t+1}``, ``V = 0`` after the last real
  token (the completion ends the episode), returns ``= A + V`` (the critic's
  targets). Not whitened here; call :func:`whiten` on the result if wanted.

Common to the token-level functions:

* A masked position is skipped, not a terminal: the recursions run over the
  real tokens only, as if padding were removed (a mask with holes, e.g. tool
  output inside a completion, links the real tokens on either side, as verl's
  GAE does). Padding positions of every output are exactly 0, whatever
  garbage (even NaN) the inputs hold there.
* Outputs are detached (advantages and returns are targets, never
  differentiated) and computed in at least float32; :func:`whiten`'s
  statistics in float64, so a batch of equal returns whitens to exactly 0.
* A row with no real token gets no reward: there is no token to carry it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lit_grpo.objectives.advantages import Advantages, group_advantages

WHITEN_EPS = 1e-8
"""Added to the variance in :func:`whiten`, inside the square root."""


class TokenAdvantages(NamedTuple):
    """Result of a token-level estimator.

    Attributes:
        advantages: ``[N, T]`` advantage per completion token, 0 at padding.
        returns: ``[N, T]`` return per completion token (the critic's target
            under GAE), 0 at padding.
    """

    advantages: Tensor
    returns: Tensor


def rloo_advantages(rewards: Tensor, group_size: int) -> Advantages:
    """REINFORCE leave-one-out: each reward minus the mean of its group's others.

    ``A_i = r_i - (sum_g - r_i) / (G - 1) = G / (G - 1) * (r_i - mean_g)``.
    Members of a collapsed group (all rewards equal, as judged by
    :func:`group_advantages`) get exactly 0.0.

    Args:
        rewards: ``[N]`` total reward per completion, the G completions of each
            prompt in consecutive rows (N = B * G).
        group_size: G, completions per prompt; at least 2.

    Returns:
        :class:`Advantages` ``(advantages [N], collapsed [N] bool)``, the
        advantages in the rewards' float dtype (float32 for integer rewards).

    Raises:
        ValueError: ``group_size < 2``, ``rewards`` not 1-D, or N not a
            multiple of ``group_size``.
    """
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 for rloo (the leave-one-out baseline needs "
            f"another member of the group), got {group_size}"
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    centred = group_advantages(rewards.detach().to(torch.float64), group_size, scale="none")
    advantages = centred.advantages * (group_size / (group_size - 1))  # [N]
    return Advantages(advantages=advantages.to(out_dtype), collapsed=centred.collapsed)


def ppo_token_rewards(
    rewards: Tensor,
    completion_mask: Tensor,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.0,
) -> Tensor:
    """Per-token rewards, InstructGPT style: sequence reward at the end, KL everywhere.

    ``r_t = [t is the last real token] * r - beta * (logprobs_t - ref_logprobs_t)``
    at real tokens (the k1 KL estimate), 0 at padding.

    Args:
        rewards: ``[N]`` total reward per completion.
        completion_mask: ``[N, T]`` 1 for real completion tokens (EOS
            included), 0 for padding; bool or numeric.
        logprobs: ``[N, T]`` log-probs of the sampled tokens under the rollout
            policy; read only when ``beta > 0``.
        ref_logprobs: ``[N, T]`` reference-policy log-probs; read only when
            ``beta > 0``.
        beta: KL coefficient in the reward; 0 ignores the log-probs.

    Returns:
        ``[N, T]`` detached per-token rewards, in the rewards' float dtype
        (float32 for integer rewards), promoted with the log-probs' when
        ``beta > 0``.

    Raises:
        ValueError: Mismatched shapes, ``beta < 0``, or ``beta > 0`` without
            both log-prob tensors.
    """
    _check_sequence_rewards(rewards, completion_mask)
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    real = completion_mask.bool()  # [N, T]
    # The last real token is the one with exactly one real token at or after it.
    real_from_here = real.flip(-1).cumsum(-1).flip(-1)  # [N, T]
    is_last = real & (real_from_here == 1)  # [N, T]
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if beta == 0:
        return torch.where(is_last, rewards.detach().to(dtype).unsqueeze(-1), 0.0)  # [N, T]
    if logprobs is None or ref_logprobs is None:
        raise ValueError(f"beta={beta} > 0 needs logprobs and ref_logprobs; pass them or set beta=0")
    _check_token_shapes(completion_mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    dtype = torch.promote_types(dtype, logprobs.dtype)
    kl = torch.where(real, (logprobs - ref_logprobs).detach().to(dtype), 0.0)  # [N, T], k1
    sequence = torch.where(is_last, rewards.detach().to(dtype).unsqueeze(-1), 0.0)  # [N, T]
    return sequence - beta * kl  # [N, T]


def discounted_returns(token_rewards: Tensor, completion_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reverse discounted sum of per-token rewards over each row's real tokens.

    ``G_t = r_t + gamma * G_{t'}``, ``t'`` the next real token after ``t``
    (``G = 0`` past the last). With ``gamma = 1`` it is the sum of the rewards
    from ``t`` to the end of the completion.

    Args:
        token_rewards: ``[N, T]`` reward per completion token.
        completion_mask: ``[N, T]`` 1 for real tokens, 0 for padding.
        gamma: Discount per real token, in [0, 1].

    Returns:
        ``[N, T]`` detached returns, 0 at padding.

    Raises:
        ValueError: Mismatched shapes or ``gamma`` outside [0, 1].
    """
    _check_token_shapes(completion_mask, token_rewards=token_rewards)
    _check_unit_interval("gamma", gamma)
    x = token_rewards.detach().to(_compute_dtype(token_rewards))  # [N, T]
    return _reverse_scan(x, completion_mask.bool(), gamma)


def whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = WHITEN_EPS) -> Tensor:
    """Whiten ``values`` with the mean and population variance of its masked entries.

    ``(x - mean) / sqrt(var + eps)`` over the positions where ``mask`` is 1,
    the statistics computed in float64; with ``shift_mean=False`` the mean is
    added back (only the scale changes). Masked-out positions are 0. If no
    position is real the result is all 0.

    Args:
        values: ``[...]`` values to whiten, e.g. ``[N, T]`` returns.
        mask: Same shape as ``values``; 1 (or True) where a value counts.
        shift_mean: Subtract the mean (True) or keep it (False).
        eps: Added to the variance inside the square root.

    Returns:
        The whitened values, in ``values``' float dtype (float32 for integers).

    Raises:
        ValueError: ``mask`` and ``values`` differ in shape.
    """
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match values shape {tuple(values.shape)}")
    out_dtype = values.dtype if values.is_floating_point() else torch.float32
    real = mask.bool()  # [...]
    x = values.to(torch.float64)  # [...]
    count = real.sum().clamp(min=1)  # []
    mean = torch.where(real, x, 0.0).sum() / count  # []
    centred = torch.where(real, x - mean, 0.0)  # [...]
    var = centred.square().sum() / count  # [], population
    whitened = centred * torch.rsqrt(var + eps)  # [...]
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(real, whitened, 0.0).to(out_dtype)


def reinforce_pp_advantages(
    rewards: Tensor,
    completion_mask: Tensor,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    *,
    beta: float = 0.0,
    gamma: float = 1.0,
    eps: float = WHITEN_EPS,
) -> TokenAdvantages:
    """REINFORCE++: KL-shaped token rewards, discounted returns, batch-whitened.

    Args:
        rewards: ``[N]`` total reward per completion.
        completion_mask: ``[N, T]`` 1 for real completion tokens, 0 for padding.
        logprobs: ``[N, T]`` rollout-policy log-probs; needed iff ``beta > 0``.
        ref_logprobs: ``[N, T]`` reference log-probs; needed iff ``beta > 0``.
        beta: Coefficient of the k1 KL in the reward (:func:`ppo_token_rewards`).
        gamma: Discount per real token (:func:`discounted_returns`).
        eps: Variance epsilon of the whitening (:func:`whiten`).

    Returns:
        :class:`TokenAdvantages`: ``advantages`` (the returns whitened over
        every real token of the batch) and ``returns``, both ``[N, T]``,
        detached, 0 at padding.

    Raises:
        ValueError: As :func:`ppo_token_rewards` and :func:`discounted_returns`.
    """
    token_rewards = ppo_token_rewards(  # [N, T]
        rewards, completion_mask, logprobs, ref_logprobs, beta
    )
    returns = discounted_returns(token_rewards, completion_mask, gamma)  # [N, T]
    advantages = whiten(returns, completion_mask, eps=eps)  # [N, T]
    return TokenAdvantages(advantages=advantages, returns=returns)


def gae_advantages(
    token_rewards: Tensor, values: Tensor, completion_mask: Tensor, gamma: float, lam: float
) -> TokenAdvantages:
    """Generalised advantage estimation over each row's real tokens.

    ``delta_t = r_t + gamma * V_{t'} - V_t`` and
    ``A_t = delta_t + gamma * lam * A_{t'}``, ``t'`` the next real token
    (``V = A = 0`` past the last one). ``lam = 1`` gives discounted returns
    minus values; ``lam = 0`` the one-step TD error.

    Args:
        token_rewards: ``[N, T]`` reward per completion token, e.g. from
            :func:`ppo_token_rewards`.
        values: ``[N, T]`` critic values of the states before each token.
        completion_mask: ``[N, T]`` 1 for real completion tokens, 0 for padding.
        gamma: Discount per real token, in [0, 1].
        lam: GAE's lambda, in [0, 1]: bias (0) against variance (1).

    Returns:
        :class:`TokenAdvantages`: ``advantages`` and ``returns = advantages +
        values`` (the critic's targets), both ``[N, T]``, detached, 0 at padding.

    Raises:
        ValueError: Mismatched shapes, or ``gamma``/``lam`` outside [0, 1].
    """
    _check_token_shapes(completion_mask, token_rewards=token_rewards, values=values)
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    dtype = _compute_dtype(token_rewards, values)
    real = completion_mask.bool()  # [N, T]
    v = torch.where(real, values.detach().to(dtype), 0.0)  # [N, T]
    r = token_rewards.detach().to(dtype)  # [N, T]
    next_v = _next_real_values(v, real)  # [N, T]
    deltas = torch.where(real, r + gamma * next_v - v, 0.0)  # [N, T]
    advantages = _reverse_scan(deltas, real, gamma * lam)  # [N, T]
    returns = torch.where(real, advantages + v, 0.0)  # [N, T]
    return TokenAdvantages(advantages=advantages, returns=returns)


def _reverse_scan(x: Tensor, real: Tensor, discount: float) -> Tensor:
    """``out_t = x_t + discount * out_{t'}`` over real positions, 0 at padding."""
    out = torch.zeros_like(x)  # [N, T]
    carry = x.new_zeros(x.shape[0])  # [N]
    for t in reversed(range(x.shape[1])):
        carry = torch.where(real[:, t], x[:, t] + discount * carry, carry)
        out[:, t] = carry
    return torch.where(real, out, 0.0)


def _next_real_values(values: Tensor, real: Tensor) -> Tensor:
    """Value at the next real position after each ``t``; 0 past the last."""
    out = torch.zeros_like(values)  # [N, T]
    carry = values.new_zeros(values.shape[0])  # [N]
    for t in reversed(range(values.shape[1])):
        out[:, t] = carry
        carry = torch.where(real[:, t], values[:, t], carry)
    return out


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_token_shapes(completion_mask: Tensor, **tensors: Tensor) -> None:
    if completion_mask.dim() != 2:
        raise ValueError(f"completion_mask must be [N, T], got shape {tuple(completion_mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != completion_mask.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} does not match completion_mask shape "
                f"{tuple(completion_mask.shape)}"
            )


def _check_sequence_rewards(rewards: Tensor, completion_mask: Tensor) -> None:
    _check_token_shapes(completion_mask)
    if rewards.shape != completion_mask.shape[:1]:
        raise ValueError(
            f"rewards shape {tuple(rewards.shape)} does not match completion_mask shape "
            f"{tuple(completion_mask.shape)} (expected rewards [N] for a mask [N, T])"
        )
