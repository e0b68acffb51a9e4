"""lit_grpo: GRPO for PyTorch Lightning.

``from lit_grpo import GRPOModule, OnPolicyDataModule, PolicySpec, LoraSpec, SamplingSpec``
(and ``PPOModule``, ``DPOModule``, ``PreferenceDataModule``, ``SFTModule``,
``RewardModelModule``, ...) is the way in. These names
are imported on first use, so that ``import lit_grpo.objectives`` (the pure
torch math) and ``import lit_grpo.rewards`` never pull Lightning or
transformers.

The folders are the architecture; arrows point down only: ``cli`` (the command)
-> ``evaluation`` (the eval command, plots) -> ``algorithms`` (the
LightningModules) -> ``data`` (the DataModules, rollout rounds, sources) ->
``generation`` (sampling engines) -> ``environments`` (tools and multi-turn
environments) -> ``rewards`` (rewards and the sandbox) -> ``training``
(checkpoints, multi-process runs, strategies, guards) -> ``model`` (loading the
policy, log-prob passes) -> ``objectives`` (pure math).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

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
    "GenerationSpec": "lit_grpo.generation",
    "AtomicCheckpointIO": "lit_grpo.training.checkpointing",
    "PlotCallback": "lit_grpo.evaluation.plots",
    "BeforeAfterAnswers": "lit_grpo.algorithms.answers",
}
__all__ = sorted(_EXPORTS)

# Modules of the flat layout -> where they live now, so that YAML ``class_path``s,
# imports and pickled checkpoints naming the old paths keep working.
# ``lit_grpo.data`` was the on-policy DataModule's module and is now the
# ``data`` package, which exports what it did (``lit_grpo.data.OnPolicyDataModule``).
_MOVED = {
    "lit_grpo.module": "lit_grpo.algorithms.grpo",
    "lit_grpo.policy_module": "lit_grpo.algorithms.base",
    "lit_grpo.dpo": "lit_grpo.algorithms.dpo",
    "lit_grpo.ppo": "lit_grpo.algorithms.ppo",
    "lit_grpo.dpo_data": "lit_grpo.data.preferences",
    "lit_grpo.rollout_round": "lit_grpo.data.rollout_round",
    "lit_grpo.buffer": "lit_grpo.data.buffer",
    "lit_grpo.sources": "lit_grpo.data.sources",
    "lit_grpo.tasks": "lit_grpo.data.tasks",
    "lit_grpo.word_problems": "lit_grpo.data.word_problems",
    "lit_grpo.rollout": "lit_grpo.generation.rollout",
    "lit_grpo.decode_step": "lit_grpo.generation.decode_step",
    "lit_grpo.merged": "lit_grpo.generation.merged",
    "lit_grpo.kv_cache": "lit_grpo.model.kv_cache",
    # The modules that moved into model/, training/, evaluation/ and algorithms/ (issue 30).
    "lit_grpo.policy": "lit_grpo.model.policy",
    "lit_grpo.attention": "lit_grpo.model.attention",
    "lit_grpo.logprob_passes": "lit_grpo.model.logprob_passes",
    "lit_grpo.random_models": "lit_grpo.model.random_models",
    "lit_grpo.adapters": "lit_grpo.model.adapters",
    "lit_grpo.refusals": "lit_grpo.model.refusals",
    "lit_grpo.generation.kv_cache": "lit_grpo.model.kv_cache",
    "lit_grpo.checkpointing": "lit_grpo.training.checkpointing",
    "lit_grpo.distributed": "lit_grpo.training.distributed",
    "lit_grpo.multiprocess": "lit_grpo.training.multiprocess",
    "lit_grpo.strategies": "lit_grpo.training.strategies",
    "lit_grpo.training_guard": "lit_grpo.training.guard",
    "lit_grpo.host_memory": "lit_grpo.training.host_memory",
    "lit_grpo.evaluate": "lit_grpo.evaluation.evaluate",
    "lit_grpo.plots": "lit_grpo.evaluation.plots",
    "lit_grpo.answers": "lit_grpo.algorithms.answers",
}


class _MovedModules:
    """Import finder and loader that serve an old module name (a key of :data:`_MOVED`)
    as the module it moved to: the very same module object, not a copy."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system is about to overwrite it with ``spec``
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state  # it ran under its own name already; give back its spec


# First in line, so that an old name never finds a stale copy of its module (an older install's file).
sys.meta_path.insert(0, _MovedModules())


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
