"""Group-relative advantages (docs/design.md, "The objective", 1).

Each completion's baseline is the mean reward of its own group of G samples
for the same prompt; no critic. Deliberate choices:

* Statistics are computed in float64, so a group of bit-identical float32
  rewards has a mean equal to each reward and a std of exactly 0 (summing up
  to 2**29 equal float32 values in float64 is exact).
* A group is "collapsed" when its population std is at most
  ``COLLAPSE_RTOL * (1 + |mean|)``: rewards that differ only by float
  rounding (``0.1 + 0.2`` vs ``0.3``) carry no signal. Its members get
  advantage exactly 0.0 under every ``scale`` -- the paper's formula would
  instead give ``(r - mean) / (1e-9 + eps)``, noise promoted to a gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

COLLAPSE_RTOL = 1e-6
"""Relative std below which a group's rewards count as all equal."""


class Advantages(NamedTuple):
    """Result of :func:`group_advantages`.

    Attributes:
        advantages: ``[N]`` advantage per completion, in the rewards' float
            dtype (float32 for integer rewards).
        collapsed: ``[N]`` bool, True for members of a group whose rewards were
            all equal (their advantage is exactly 0.0). ``collapsed.float().mean()``
            is the fraction of collapsed groups, since groups are equal-sized.
    """

    advantages: Tensor
    collapsed: Tensor


def _group_scale(grouped: Tensor, eps: float) -> Tensor:
    return grouped.std(dim=1, correction=0, keepdim=True) + eps  # [B, 1]


def _batch_scale(grouped: Tensor, eps: float) -> Tensor:
    return grouped.std(correction=0) + eps  # []


def _no_scale(grouped: Tensor, eps: float) -> Tensor:
    return grouped.new_ones(())  # [] -- Dr. GRPO: no std division


_SCALES = {"group": _group_scale, "batch": _batch_scale, "none": _no_scale}


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> Advantages:
    """Group-relative advantage of each completion.

    ``A_i = (r_i - mean_g) / (std + eps)`` with the population std of i's group
    (``scale="group"``), of all N rewards (``"batch"``), or no division at all
    (``"none"``, Dr. GRPO). Members of a collapsed group get exactly 0.0.

    Args:
        rewards: ``[N]`` total reward per completion, the G completions of each
            prompt in consecutive rows (N = B * G).
        group_size: G, completions per prompt; at least 2.
        scale: Which std divides the centred rewards: "group", "batch" or "none".
        eps: Added to the std so near-collapsed groups stay bounded.

    Returns:
        :class:`Advantages` ``(advantages [N], collapsed [N] bool)``.

    Raises:
        ValueError: ``rewards`` is not 1-D, ``group_size < 2``, N is not a
            multiple of ``group_size``, or ``scale`` is unknown.
    """
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {sorted(_SCALES)}, got {scale!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no statistics), got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"got N={rewards.numel()} rewards, not a multiple of group_size={group_size}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    grouped = rewards.detach().to(torch.float64).view(-1, group_size)  # [B, G]
    mean = grouped.mean(dim=1, keepdim=True)  # [B, 1]
    std = grouped.std(dim=1, correction=0, keepdim=True)  # [B, 1]
    collapsed = std <= COLLAPSE_RTOL * (1.0 + mean.abs())  # [B, 1]
    # Fill after dividing: with eps=0 a collapsed group is 0/0 = NaN until filled.
    advantages = (grouped - mean) / _SCALES[scale](grouped, eps)  # [B, G]
    advantages = advantages.masked_fill(collapsed, 0.0)  # [B, G]
    return Advantages(
        advantages=advantages.reshape(-1).to(out_dtype),  # [N]
        collapsed=collapsed.expand_as(grouped).reshape(-1),  # [N]
    )


def decoupled_group_advantages(rewards: Tensor, weights: Tensor, group_size: int, eps: float = 1e-4) -> Advantages:
    """GDPO's multi-reward advantages: each reward normalised in its group, then summed.

    Each reward k is centred on its group's mean and divided by its group's
    population std (+ ``eps``), a collapsed group (or a value that does not
    apply, NaN) giving 0; the weighted sum over rewards is then divided by
    its std over all N completions. One reward with a large spread no longer
    drowns the others, as it does when the rewards are summed first
    (Liu et al. 2026, "GDPO"; TRL's ``multi_objective_aggregation:
    normalize_then_sum``).

    Args:
        rewards: ``[N, K]`` raw values of K rewards per completion (NaN where one
            does not apply), the G completions of a prompt in consecutive rows.
        weights: ``[K]`` the rewards' weights.
        group_size: G, at least 2.
        eps: Added to every std.

    Returns:
        :class:`Advantages`; ``collapsed`` marks groups where every reward collapsed.

    Raises:
        ValueError: ``rewards`` is not 2-D, ``weights`` does not have K entries,
            ``group_size < 2``, or N is not a multiple of it.
    """
    if rewards.dim() != 2 or weights.shape != rewards.shape[1:]:
        raise ValueError(
            f"rewards must be [N, K] and weights [K], got {tuple(rewards.shape)} and {tuple(weights.shape)}"
        )
    if group_size < 2 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"group_size={group_size} must be >= 2 and divide N={rewards.shape[0]}")
    grouped = rewards.detach().to(torch.float64).view(-1, group_size, rewards.shape[1])  # [B, G, K]
    applies = ~torch.isnan(grouped)  # [B, G, K]
    count = applies.sum(1, keepdim=True).clamp(min=1)  # [B, 1, K]
    values = grouped.nan_to_num(0.0)
    mean = values.sum(1, keepdim=True) / count  # [B, 1, K]
    std = (((values - mean) * applies) ** 2).sum(1, keepdim=True).div(count).sqrt()  # [B, 1, K]
    collapsed = std <= COLLAPSE_RTOL * (1.0 + mean.abs())  # [B, 1, K]
    normalised = ((values - mean) / (std + eps)).masked_fill(collapsed | ~applies, 0.0)  # [B, G, K]
    total = (normalised * weights.to(torch.float64)).sum(-1)  # [B, G]
    every_collapsed = collapsed.all(-1)  # [B, 1]
    advantages = (total / (total.std(correction=0) + eps)).masked_fill(every_collapsed, 0.0)  # [B, G]
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return Advantages(advantages.reshape(-1).to(out_dtype), every_collapsed.expand_as(total).reshape(-1))
