"""lit_grpo: GRPO for PyTorch Lightning.

``from lit_grpo import GRPOModule, OnPolicyDataModule, PolicySpec, LoraSpec, SamplingSpec``
(and ``PPOModule``, ``DPOModule``, ``PreferenceDataModule``, ``SFTModule``,
``RewardModelModule``, ...) is the way in. These names
are imported on first use, so that ``import lit_grpo.objectives`` (the pure
torch math) and ``import lit_grpo.rewards`` never pull Lightning or
transformers.

The folders are the architecture; arrows point down only: ``cli`` (the command)
-> ``evaluation`` (the eval command, plots) -> ``algorithms`` (the
LightningModules) -> ``data`` (the DataModules, sources) -> ``rollout`` (the
rollout producer: sampling, scoring, advantages) -> ``generation`` (sampling
engines) -> ``environments`` (tools and multi-turn environments) ->
``rewards`` (rewards and the sandbox) -> ``training``
(checkpoints, multi-process runs, strategies, guards) -> ``model`` (loading the
policy, log-prob passes) -> ``objectives`` (pure math).
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# On Intel CPUs MKL's sgemm splits a long inner dimension across threads, so a matmul's sums (and
# from there a whole run) differ between 1 and 2 threads; strict conditional bitwise reproducibility
# makes them independent of the thread count at no measured cost (docs/determinism.md). MKL reads
# it at its first call, so it has to be set before any matmul; a user's own MKL_CBWR is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

# Public name -> the module that defines it.
_EXPORTS = {
    "GRPOModule": "lit_grpo.algorithms.grpo",
    "OnPolicyDataModule": "lit_grpo.data.grpo",
    "DPOModule": "lit_grpo.algorithms.dpo",
    "PPOModule": "lit_grpo.algorithms.ppo",
    "PreferenceDataModule": "lit_grpo.data.preferences",
    "SFTModule": "lit_grpo.algorithms.sft",
    "SFTDataModule": "lit_grpo.data.sft",
    "RewardModelModule": "lit_grpo.algorithms.reward_model",
    "RewardDataModule": "lit_grpo.data.reward_pairs",
    "PolicyModule": "lit_grpo.algorithms.base",
    "PolicySpec": "lit_grpo.model.policy",
    "LoraSpec": "lit_grpo.model.policy",
    "SamplingSpec": "lit_grpo.generation.rollout",
    "EpisodesSpec": "lit_grpo.data.episodes",
    "SourceSpec": "lit_grpo.data.specs",
    "HeldOutSpec": "lit_grpo.data.specs",
    "PromptSpec": "lit_grpo.data.specs",
    "AdvantageSpec": "lit_grpo.data.specs",
    "GenerationSpec": "lit_grpo.generation",
    "AtomicCheckpointIO": "lit_grpo.training.checkpointing",
    "PlotCallback": "lit_grpo.evaluation.plots",
    "BeforeAfterAnswers": "lit_grpo.algorithms.answers",
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
