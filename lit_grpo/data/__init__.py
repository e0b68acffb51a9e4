"""Where training batches come from: the DataModules and what feeds them.

:class:`OnPolicyDataModule` (:mod:`~lit_grpo.data.grpo`) runs one rollout
round per epoch (:class:`~lit_grpo.rollout.producer.RolloutProducer`) and serves it from a
buffer (:mod:`~lit_grpo.data.buffer`); :class:`PreferenceDataModule`
(:mod:`~lit_grpo.data.preferences`) serves fixed preference pairs for DPO.
Both read prompts from :mod:`~lit_grpo.data.sources`: a built-in task
(:mod:`~lit_grpo.data.tasks`, :mod:`~lit_grpo.data.word_problems`), a file or
a hub dataset, and wrap them in the chat template (:mod:`~lit_grpo.data.prompts`).
The DataModules are imported on first use, so that the tasks and sources
import without Lightning.
"""

from __future__ import annotations

import importlib

# Public name -> the module that defines it. ``lit_grpo.data`` was the on-policy
# DataModule's module before it became this package: its names stay here.
_EXPORTS = {
    "OnPolicyDataModule": "lit_grpo.data.grpo",
    "chat_prompts": "lit_grpo.data.prompts",
    "PreferenceDataModule": "lit_grpo.data.preferences",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_grpo.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
