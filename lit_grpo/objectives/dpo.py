"""The DPO loss on summed completion log-probs (Rafailov et al., 2023).

For a prompt x with a preferred completion y_w and a dispreferred y_l, the
implicit reward of a completion is ``r(y) = beta * (log pi(y|x) - log ref(y|x))``
and the loss is ``-log sigmoid(r(y_w) - r(y_l))``: the KL-regularised RLHF
objective solved in closed form, with no sampling and no reward model.

``label_smoothing = eps`` is conservative DPO (cDPO): each label is assumed
flipped with probability ``eps``, so the loss becomes
``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)`` and stops pushing the
margin once ``sigmoid(z) = 1 - eps`` instead of driving it to infinity.

Log-probs are sums over each completion's tokens (not means), as in the paper;
a longer completion therefore carries a larger log-ratio.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_grpo.objectives.grpo import LossOutput, at_least_fp32


def _check_inputs(beta: float, label_smoothing: float, **logps: Tensor) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        # At 0.5 both labels weigh the same and the loss has no preferred direction.
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    shapes = {name: tuple(t.shape) for name, t in logps.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"all log-prob inputs must be the same [B] shape, got {shapes}")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """Sigmoid DPO loss, averaged over the B preference pairs.

    Args:
        policy_chosen_logps: ``[B]`` summed log-probs of the chosen completions
            under the policy (with grad).
        policy_rejected_logps: ``[B]`` the same for the rejected completions.
        ref_chosen_logps: ``[B]`` summed log-probs of the chosen completions
            under the reference policy (no grad needed).
        ref_rejected_logps: ``[B]`` the same for the rejected completions.
        beta: Inverse temperature of the implicit reward; larger keeps the
            policy closer to the reference.
        label_smoothing: Assumed probability that a pair's labels are flipped
            (conservative DPO); 0 is plain DPO.

    Returns:
        :class:`LossOutput`: scalar ``loss``; ``metrics`` (means over pairs)
        ``rewards/chosen`` and ``rewards/rejected`` (implicit rewards),
        ``rewards/margin`` (their difference), ``rewards/accuracy`` (fraction
        of pairs whose chosen reward is strictly higher: 0 while the policy
        equals the reference), ``logps/chosen``, ``logps/rejected`` and
        ``logps/accuracy`` (fraction where the policy itself gives the chosen
        completion the higher log-prob, whatever the reference says).

    Raises:
        ValueError: ``beta <= 0``, ``label_smoothing`` outside ``[0, 0.5)``, or
            inputs that are not all the same ``[B]`` shape.
    """
    _check_inputs(
        beta,
        label_smoothing,
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps = at_least_fp32(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)  # [B]
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)  # [B]
    margin = chosen_rewards - rejected_rewards  # [B]
    # logsigmoid, not log(sigmoid()): exact and finite for large |margin|.
    losses = -(1.0 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)  # [B]
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margin": margin.mean(),
        "rewards/accuracy": (margin > 0).to(margin.dtype).mean(),
        "logps/chosen": policy_chosen_logps.mean(),
        "logps/rejected": policy_rejected_logps.mean(),
        "logps/accuracy": (policy_chosen_logps > policy_rejected_logps).to(margin.dtype).mean(),
    }
    return LossOutput(loss=losses.mean(), metrics={k: v.detach() for k, v in metrics.items()})


def sequence_logps(logprobs: Tensor, completion_mask: Tensor) -> Tensor:
    """Sum each row's token log-probs over its real completion tokens.

    Args:
        logprobs: ``[N, T]`` per-token log-probs (padding may hold anything finite).
        completion_mask: ``[N, T]`` 1 for real tokens, 0 for padding.

    Returns:
        ``[N]`` summed log-probs.
    """
    (logprobs,) = at_least_fp32(logprobs)
    return torch.where(completion_mask.bool(), logprobs, 0.0).sum(-1)  # [N]
