"""A callback for tests/test_cli_multiprocess.py: every rank saves its trainable
weights, whole (FSDP2 shards gathered), when fit starts and when it ends, so a
test can compare ranks with each other and a resumed run with the run it
resumed."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lit_grpo.training.distributed import full_tensors


class SaveRankState(L.Callback):
    """Writes ``FOLDER/{start,end}-rank<r>.pt``: each rank's trainable weights, by name.

    Args:
        folder: Where the files go.
    """

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def _save(self, trainer: L.Trainer, module: L.LightningModule, when: str) -> None:
        state = full_tensors((n, p) for n, p in module.named_parameters() if p.requires_grad)  # a collective
        torch.save(state, self.folder / f"{when}-rank{trainer.global_rank}.pt")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module, "start")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module, "end")
