"""Advantage estimators: a rollout's rewards (and its rows) -> the advantages its loss trains on.

Each is chosen by ``data.advantage.estimator``. The numbers an estimator
needs from the objective (``beta``, PPO's ``kl_coef``, ``gamma``, ``lam``,
``whiten_advantages``) arrive as the policy's
:meth:`~lit_grpo.rollout.policy.RolloutPolicy.estimator_options`; the
critic's values (GAE) as :meth:`~lit_grpo.rollout.policy.RolloutPolicy.rollout_values`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from lit_grpo.objectives import (
    decoupled_group_advantages,
    gae_advantages,
    group_advantages,
    ppo_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads besides the rewards and the rollout's rows.

    Attributes:
        group_size: Completions per prompt.
        scale: ``data.advantage.scale`` (``group``, ``batch`` or ``none``).
        options: The objective's numbers (see the module docstring).
        batch_size: Rows scored together by a pass of the policy (the critic's values).
        per_reward: ``[N, K]`` each reward's raw values (NaN where one does not apply), and
            ``weights`` ``[K]`` their weights: for ``normalize_then_sum``.
        aggregation: ``data.advantage.multi_objective_aggregation``: ``sum_then_normalize`` (the weighted
            total is normalised in its group) or ``normalize_then_sum`` (GDPO: each reward is).
    """

    group_size: int
    scale: str
    options: Mapping[str, float]
    batch_size: int
    per_reward: Tensor | None = None
    weights: Tensor | None = None
    aggregation: str = "sum_then_normalize"


def _group_relative(rewards: Tensor, rows: dict, inputs: AdvantageInputs, policy):
    if inputs.aggregation == "normalize_then_sum":
        result = decoupled_group_advantages(inputs.per_reward, inputs.weights, inputs.group_size)
    else:
        result = group_advantages(rewards, inputs.group_size, scale=inputs.scale)
    return {"advantages": result.advantages}, {"rollout/collapsed_fraction": result.collapsed.float().mean().item()}


def _leave_one_out(rewards: Tensor, rows: dict, inputs: AdvantageInputs, policy):
    result = rloo_advantages(rewards, inputs.group_size)
    return {"advantages": result.advantages}, {"rollout/collapsed_fraction": result.collapsed.float().mean().item()}


def _gae(rewards: Tensor, rows: dict, inputs: AdvantageInputs, policy):
    """Per-token GAE advantages (whitened over the rollout's real tokens) and returns.

    The values come from the policy's critic as it was at rollout time; the
    per-token rewards carry the sequence reward on the last token and, with
    ``kl_coef > 0``, minus ``kl_coef`` times the k1 KL to the reference.
    """
    mask = rows["completion_mask"]  # [N, C]
    values = policy.rollout_values(rows, inputs.batch_size)  # [N, C]
    options = inputs.options
    token_rewards = ppo_token_rewards(
        rewards, mask, rows.get("old_logprobs"), rows.get("ref_logprobs"), beta=options["kl_coef"]
    )  # [N, C]
    result = gae_advantages(token_rewards, values, mask, gamma=options["gamma"], lam=options["lam"])
    advantages = whiten(result.advantages, mask) if options["whiten_advantages"] else result.advantages  # [N, C]
    real = mask.bool()
    stats = {
        "rollout/value_mean": values[real].mean().item() if real.any() else 0.0,
        "rollout/return_mean": result.returns[real].mean().item() if real.any() else 0.0,
    }
    return {"advantages": advantages, "values": values, "returns": result.returns}, stats


def _reinforce_pp(rewards: Tensor, rows: dict, inputs: AdvantageInputs, policy):
    """REINFORCE++ per-token advantages: returns whitened over the rollout's real tokens.

    The per-token rewards carry the sequence reward on the last token and,
    with ``beta > 0``, minus ``beta`` times the k1 KL of the rollout policy to
    the reference; gamma is 1. The whitening statistics are this rank's (no
    cross-rank reduction), as for ``gae``.
    """
    mask = rows["completion_mask"]  # [N, C]
    beta = inputs.options["beta"]
    result = reinforce_pp_advantages(rewards, mask, rows.get("old_logprobs"), rows.get("ref_logprobs"), beta=beta)
    real = mask.bool()
    stats = {"rollout/return_mean": result.returns[real].mean().item() if real.any() else 0.0}
    if beta > 0:
        k1 = rows["old_logprobs"] - rows["ref_logprobs"]  # [N, C]
        stats["rollout/kl"] = k1[real].mean().item() if real.any() else 0.0
    return {"advantages": result.advantages}, stats


class Estimator(NamedTuple):
    """An advantage estimator the DataModule can be configured with.

    Attributes:
        compute: ``(rewards [N], rows, AdvantageInputs, policy) -> (rows to add, stats)``.
        needs_group: Baselines from the other completions of the prompt (G >= 2).
        kl_weight: The option that weighs the KL to the reference inside the
            per-token rewards (the loss then has no KL term), or ``None``.
    """

    compute: Callable
    needs_group: bool
    kl_weight: str | None = None

    def reads_old_logprobs(self, options: Mapping[str, float]) -> bool:
        """Whether the per-token rewards read the rollout policy's log-probs (a KL in the rewards)."""
        return self.kl_weight is not None and options.get(self.kl_weight, 0.0) > 0


# data.advantage.estimator -> how the rollout's advantages are computed.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_group_relative, needs_group=True),
    "rloo": Estimator(_leave_one_out, needs_group=True),
    "gae": Estimator(_gae, needs_group=False, kl_weight="kl_coef"),
    "reinforce_pp": Estimator(_reinforce_pp, needs_group=False, kl_weight="beta"),
}
