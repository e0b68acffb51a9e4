"""Several LoRA adapters on one frozen base: switching which one runs.

The actor, PPO's critic and a reward model can each be an adapter on the same
peft model (one copy of the base weights for every role). peft's
``set_adapter`` also flips ``requires_grad`` (only the active adapter stays
trainable) and its ``disable_adapter`` re-enables the active one on exit;
:func:`active_adapter` and :func:`kept_requires_grad` undo those side effects,
so a role borrowed for one pass leaves the trainable weights as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def kept_requires_grad(model: nn.Module) -> Iterator[None]:
    """Restore every parameter's ``requires_grad`` on exit, whatever peft toggled inside."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def active_adapter(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """Yield the peft ``model`` with adapter ``name`` alone active; on exit the adapter that
    was active before runs again and ``requires_grad`` is as it was."""
    previous = model.active_adapter
    with kept_requires_grad(model):
        model.set_adapter(name)
        try:
            yield model
        finally:
            model.set_adapter(previous)
