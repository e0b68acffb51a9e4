"""Rewards: the protocol, the combiner, the verifiable built-ins, the sandbox, and a trained reward model.

A reward function is any ``f(prompts, completions, **columns) -> list[float | None]``
that may also name TRL's ``completion_ids``, ``environments``, ``trainer_state``
and ``log_metric`` (see :mod:`lit_grpo.rewards.base`). The built-ins are plain functions of that
shape, each with a YAML-configurable class form that carries its weight and
parameters.
"""

from lit_grpo.rewards.base import (
    SUPPLIED,
    FromCallable,
    Reward,
    RewardCombiner,
    RewardFunctionError,
    RewardScores,
    TrainerState,
    import_reward,
)
from lit_grpo.rewards.code import CodeUnitTests, code_unit_tests
from lit_grpo.rewards.countdown import Countdown, countdown
from lit_grpo.rewards.math import (
    Accuracy,
    Format,
    LanguageConsistency,
    OverlongPenalty,
    accuracy,
    format,
    language_consistency,
    overlong_penalty,
)
from lit_grpo.rewards.reasoning_gym import ReasoningGym, reasoning_gym_score
from lit_grpo.rewards.reward_model import RewardModel
from lit_grpo.rewards.sandbox import Program, Sandbox, SandboxResult

# Reward functions reachable by bare name (e.g. ``FromCallable(function="accuracy")``).
BUILTINS = {
    fn.__name__: fn
    for fn in (
        accuracy,
        format,
        language_consistency,
        overlong_penalty,
        code_unit_tests,
        countdown,
        reasoning_gym_score,
    )
}

__all__ = [
    "BUILTINS",
    "Accuracy",
    "CodeUnitTests",
    "Countdown",
    "Format",
    "FromCallable",
    "LanguageConsistency",
    "OverlongPenalty",
    "Program",
    "ReasoningGym",
    "Reward",
    "RewardCombiner",
    "RewardFunctionError",
    "RewardModel",
    "RewardScores",
    "Sandbox",
    "SandboxResult",
    "SUPPLIED",
    "TrainerState",
    "accuracy",
    "code_unit_tests",
    "countdown",
    "format",
    "import_reward",
    "language_consistency",
    "overlong_penalty",
    "reasoning_gym_score",
]
