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


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> Advantages:
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
        raise ValueError(
            f"group_size must be >= 2 (a group of one has no statistics), got {group_size}"
        )
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"got N={rewards.numel()} rewards, not a multiple of group_size={group_size}"
        )
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
