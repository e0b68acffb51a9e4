"""A callback for tests/test_cli_multiprocess.py: rank 0 waits in a collective
that the other ranks never join (they sleep in the same hook instead), the
shape of every rank-conditional-collective hang."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class StallingRank(L.Callback):
    """At the end of a training epoch rank 0 enters a barrier; the others sleep.

    Args:
        seconds: How long the other ranks sleep (longer than the test waits).
        marker: A file rank 0 creates just before it enters the barrier.
    """

    def __init__(self, seconds: float = 600.0, marker: str | None = None) -> None:
        self.seconds, self.marker = seconds, marker

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            if self.marker:
                Path(self.marker).touch()
            trainer.strategy.barrier("stalling_rank")
        else:
            time.sleep(self.seconds)
