"""Skip optimizer steps whose gradient is not finite, and stop if it persists.

A NaN/inf gradient applied once poisons the weights for good (Adam's moments
carry it forward), so such a step is skipped and counted. A few in a row
mean something is structurally wrong (a learning rate far too high, broken
data), and training stops with an error; checkpoints already written stay as
they were, since nothing was saved from the poisoned state.
"""

from __future__ import annotations

import torch


class NonFiniteStepsError(RuntimeError):
    """Raised after too many consecutive non-finite gradients."""


class NonFiniteGuard:
    """Counts skipped steps; raises after ``limit`` consecutive ones.

    Args:
        limit: Consecutive non-finite steps tolerated before raising.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"model.max_nonfinite_steps={limit}; expected >= 1.")
        self.limit = limit
        self.skipped = 0  # total over the run
        self.consecutive = 0

    def check(self, parameters: list[torch.nn.Parameter]) -> bool:
        """Return whether the gradients are finite; count and maybe raise if not."""
        grads = [p.grad for p in parameters if p.grad is not None]
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        if finite:
            self.consecutive = 0
            return True
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.limit:
            raise NonFiniteStepsError(
                f"{self.consecutive} consecutive optimizer steps had a NaN/inf gradient "
                f"(model.max_nonfinite_steps={self.limit}); training stopped. The last checkpoint "
                "is intact; lower the learning rate or check the rewards and data before resuming."
            )
        return False

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = state.get("skipped", 0)
        self.consecutive = state.get("consecutive", 0)
