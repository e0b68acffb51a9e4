"""The PPO loss: token-level clipped surrogate plus a clipped value loss (pure torch).

Per token, with ``rho = exp(logprobs - old_logprobs)`` and one advantage per
token ``A_t`` (GAE, see :func:`~lit_grpo.objectives.gae_advantages`):

* policy: ``-min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A)``, aggregated
  by ``loss_type`` exactly as in :func:`~lit_grpo.objectives.grpo_loss`
  (the same table), with the same clip statistics;
* value: ``max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)``,
  the masked mean over real tokens, times ``vf_coef`` (the PPO2 / OpenAI
  baselines form; some implementations also halve it, we do not).

Deliberate choices: no KL term here (InstructGPT-style PPO puts the KL to the
reference into the per-token rewards, :func:`ppo_token_rewards`), and padding
is zeroed before ``exp`` as in ``grpo_loss``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_grpo.objectives.grpo import (
    _AGGREGATIONS,
    LossOutput,
    _check_choice,
    _check_norm,
    _clip_metrics,
    _masked_mean,
    at_least_fp32,
)

# The value statistics ppo_loss reports besides grpo_loss's clip metrics.
VALUE_METRICS = ("value_loss", "value_clip_fraction", "explained_variance", "value/mean")


def ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    value_clip: float = 0.2,
    vf_coef: float = 0.5,
    loss_type: str = "bnpo",
    max_completion_length: int | None = None,
    num_items: int | float | Tensor | None = None,
) -> LossOutput:
    """Clipped PPO surrogate on per-token advantages plus ``vf_coef`` x the clipped value loss.

    Args:
        logprobs: ``[N, T]`` log-probs of the sampled tokens under the current
            policy (with grad).
        old_logprobs: ``[N, T]`` log-probs under the rollout policy.
        advantages: ``[N, T]`` one advantage per token (0 at padding).
        completion_mask: ``[N, T]`` 1 for real completion tokens, 0 for padding.
        values: ``[N, T]`` current critic values (with grad).
        old_values: ``[N, T]`` critic values at rollout time (the clip centre).
        returns: ``[N, T]`` value targets (GAE advantages + old values).
        epsilon_low: Lower clip range of the ratio.
        epsilon_high: Upper clip range of the ratio.
        value_clip: Half-width of the value clip around ``old_values``.
        vf_coef: Weight of the value loss in the total.
        loss_type: Aggregation of the policy term (see ``grpo_loss``).
        max_completion_length: Required by ``dr_grpo``.
        num_items: Required by ``dapo``.

    Returns:
        :class:`LossOutput`: ``loss`` = policy + vf_coef * value loss;
        ``metrics``: ``policy_loss``, the clip metrics of ``grpo_loss``,
        ``value_loss`` (unweighted), ``value_clip_fraction`` (real tokens where
        the clipped branch is the larger), ``explained_variance``
        (``1 - Var(R - V) / Var(R)`` over real tokens) and ``value/mean``.

    Raises:
        ValueError: Unknown ``loss_type``, mismatched shapes, a negative
            clip or coefficient, or a missing normaliser.
    """
    _check_choice("loss_type", loss_type, _AGGREGATIONS)
    aggregation = _AGGREGATIONS[loss_type]
    norm = {"num_items": num_items, "max_completion_length": max_completion_length}.get(aggregation.norm_arg)
    _check_norm(loss_type, aggregation.norm_arg, norm)
    for name, value in (
        ("epsilon_low", epsilon_low),
        ("epsilon_high", epsilon_high),
        ("value_clip", value_clip),
        ("vf_coef", vf_coef),
    ):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    for name, tensor in (
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("completion_mask", completion_mask),
        ("values", values),
        ("old_values", old_values),
        ("returns", returns),
    ):
        if tensor.shape != logprobs.shape or logprobs.dim() != 2:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} does not match logprobs shape {tuple(logprobs.shape)} (all [N, T])"
            )

    logprobs, old_logprobs, advantages, values, old_values, returns = at_least_fp32(
        logprobs, old_logprobs, advantages, values, old_values, returns
    )
    real = completion_mask.bool()  # [N, T]
    mask = real.to(logprobs.dtype)  # [N, T]
    ratio = torch.exp(torch.where(real, logprobs - old_logprobs, 0.0))  # [N, T]
    adv = torch.where(real, advantages.to(logprobs.dtype), 0.0)  # [N, T]
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # [N, T]
    policy_loss = aggregation.reduce(-torch.minimum(ratio * adv, clipped * adv), mask, norm)

    value_loss, value_metrics = _clipped_value_loss(values, old_values, returns, real, value_clip)
    metrics = {"policy_loss": policy_loss.detach()}
    metrics.update(_clip_metrics(ratio.detach(), adv, mask, epsilon_low, epsilon_high))
    metrics.update(value_metrics)
    return LossOutput(loss=policy_loss + vf_coef * value_loss, metrics=metrics)


def _clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, real: Tensor, value_clip: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked token mean of ``max(unclipped, clipped)`` squared errors, and its statistics."""
    mask = real.to(values.dtype)  # [N, T]
    v = torch.where(real, values, 0.0)  # [N, T]
    old = torch.where(real, old_values.to(values.dtype), 0.0)  # [N, T]
    target = torch.where(real, returns.to(values.dtype), 0.0)  # [N, T]
    v_clipped = old + torch.clamp(v - old, -value_clip, value_clip)  # [N, T]
    unclipped_error = (v - target).square()  # [N, T]
    clipped_error = (v_clipped - target).square()  # [N, T]
    per_token = torch.maximum(unclipped_error, clipped_error)  # [N, T]
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    residual = (target - v).detach()  # [N, T]
    count = mask.sum().clamp(min=1.0)
    var_returns = (((target - (target * mask).sum() / count) * mask).square().sum() / count).detach()
    var_residual = ((residual - (residual * mask).sum() / count) * mask).square().sum() / count
    # 0 when the returns do not vary (nothing to explain); no host sync either way.
    explained = torch.where(var_returns > 0, 1.0 - var_residual / var_returns.clamp(min=1e-12), 0.0)
    return loss, {
        "value_loss": loss.detach(),
        "value_clip_fraction": _masked_mean((clipped_error > unclipped_error).to(mask.dtype), mask),
        "explained_variance": explained,
        "value/mean": _masked_mean(v.detach(), mask),
    }
