"""lit_grpo: GRPO for PyTorch Lightning.

``from lit_grpo import GRPOModule, OnPolicyDataModule, PolicySpec, LoraSpec, SamplingSpec``
(and ``PPOModule``, ``DPOModule``, ``PreferenceDataModule``, ...) is the way in. These names
are imported on first use, so that ``import lit_grpo.objectives`` (the pure
torch math) and ``import lit_grpo.rewards`` never pull Lightning or
transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "GRPOModule": "lit_grpo.module",
    "OnPolicyDataModule": "lit_grpo.data",
    "DPOModule": "lit_grpo.dpo",
    "PPOModule": "lit_grpo.ppo",
    "PreferenceDataModule": "lit_grpo.dpo_data",
    "PolicyModule": "lit_grpo.policy_module",
    "PolicySpec": "lit_grpo.policy",
    "LoraSpec": "lit_grpo.policy",
    "SamplingSpec": "lit_grpo.rollout",
    "GenerationSpec": "lit_grpo.generation",
    "AtomicCheckpointIO": "lit_grpo.checkpointing",
    "PlotCallback": "lit_grpo.plots",
    "BeforeAfterAnswers": "lit_grpo.answers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
