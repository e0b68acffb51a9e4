"""What the rollout producer needs from the policy it samples: :class:`RolloutPolicy`.

The LightningModules implement it (:class:`~lit_grpo.algorithms.grpo.GRPOModule`,
:class:`~lit_grpo.algorithms.ppo.PPOModule`); the producer reads nothing
else of them, and they read nothing of the producer but the batches it makes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from torch import Tensor


class RolloutPolicy(Protocol):
    """The policy side of a rollout.

    Attributes:
        tokenizer: The policy's tokenizer (pad id for the rows).
        engine: What samples completions (:class:`~lit_grpo.generation.Engine`).
        policy_version: Optimizer steps taken so far: the version of the
            weights a rollout sampled now comes from.
        needs_reference: Whether the objective reads the reference policy's
            log-probs (a rollout then stores them).
    """

    tokenizer: object
    engine: object
    policy_version: int
    needs_reference: bool

    def estimator_options(self) -> Mapping[str, float]:
        """The objective's numbers the advantage estimators read (``beta``; PPO's ``kl_coef``, ``gamma``,
        ``lam``, ``whiten_advantages``)."""

    def rollout_logprobs(
        self, rows: dict, temperature: float, reference: bool, batch_size: int | None = None
    ) -> Tensor:
        """Log-probs of the rows' completions without grad, ``[N, C]``, ``batch_size`` rows per pass."""

    def rollout_values(self, rows: dict, batch_size: int | None = None) -> Tensor:
        """The critic's values of the rows' completion tokens, ``[N, C]`` (objectives with a critic)."""

    def show_progress(self, description: str, total: int | None = None, unit: str = "step"):
        """A progress bar for a rollout phase (or its line at the end), or ``None``."""
