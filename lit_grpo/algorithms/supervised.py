"""SupervisedModule: what the modules that learn from a fixed dataset share (SFT, the reward model).

Unlike the RL modules there is no rollout: each batch comes from the
DataModule, the subclass's :meth:`~SupervisedModule.batch_loss` turns it into
a :class:`~lit_grpo.objectives.LossOutput`, and this class logs it, validates
on the held-out rows (also once before the first step, so the gain is
visible), prints the validation metrics after each epoch, and tells a
:class:`~lit_grpo.data.batches.ResumableBatches` DataModule which batch starts
(so a run resumed inside an epoch trains exactly what the killed one would
have). Loading, (Q)LoRA, the optimizer, checkpoints and exports come from
:class:`PolicyModule`.
"""

from __future__ import annotations

import abc

import torch
from torchmetrics import MeanMetric
from tqdm.auto import tqdm

from lit_grpo.algorithms.base import PolicyModule
from lit_grpo.objectives import LossOutput


class SupervisedModule(PolicyModule):
    """Base class: a loss on dataset batches, logged and validated.

    Subclasses implement :meth:`batch_loss` and may extend
    :meth:`validation_metrics`; their constructors take ``progress`` (print
    the validation metrics) and pass the rest to :class:`PolicyModule`.
    """

    shown_metrics: tuple[str, ...] = ("val/loss",)  # what the printed lines show
    pair_accuracy: str | None = None  # the metric of batch_loss that is preference pairs' accuracy, if any

    @abc.abstractmethod
    def batch_loss(self, batch: dict) -> LossOutput:
        """The loss and metrics of one batch."""

    @property
    def needs_reference(self) -> bool:
        return False

    def batch_rows(self, batch: dict) -> int:
        """How many examples ``batch`` holds (the weight of its metrics)."""
        return batch["completion_ids"].shape[0]

    # --------------------------------------------------------------- training
    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        begin = getattr(self.trainer.datamodule, "begin_batch", None)
        if begin is not None:
            begin()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        result = self.batch_loss(batch)
        rows = self.batch_rows(batch)
        metrics, pairs = self.log_reduced({f"train/{k}": v for k, v in result.metrics.items()}, weight=rows)
        self.log_reduced({"train/loss": result.loss.detach()}, weight=rows, prog_bar=True, on_step=True)
        end = getattr(self.trainer.datamodule, "end_batch", None)
        if end is not None and self.pair_accuracy is not None:  # the same on every rank: a stage may end
            end(metrics[f"train/{self.pair_accuracy}"], pairs)
        return result.loss

    # ------------------------------------------------------------- validation
    def validation_metrics(self, batch: dict) -> dict[str, torch.Tensor]:
        """Metrics of one validation batch, averaged over its examples (``loss`` and the loss's own)."""
        result = self.batch_loss(batch)
        return {"loss": result.loss, **result.metrics}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        metrics = {f"val/{k}": v for k, v in self.validation_metrics(batch).items()}
        self.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=True, batch_size=self.batch_rows(batch))

    @torch.no_grad()
    def held_out_metrics(self) -> dict[str, float]:
        """Validation metrics of the current policy over all held-out rows (this rank's share)."""
        datamodule = self.trainer.datamodule
        if not getattr(datamodule, "val_rows", None):
            return {}
        was_training = self.training
        self.eval()
        means: dict[str, MeanMetric] = {}
        try:
            for batch in datamodule.val_dataloader():
                batch = self.transfer_batch_to_device(batch, self.device, 0)
                for name, value in self.validation_metrics(batch).items():
                    means.setdefault(name, MeanMetric().to(self.device)).update(value, self.batch_rows(batch))
        finally:
            self.train(was_training)
        return {f"val/{k}": float(m.compute()) for k, m in means.items()}

    def printed(self, metrics: dict[str, float]) -> dict[str, float]:
        return {k: metrics[k] for k in self.shown_metrics if k in metrics}

    def on_train_epoch_end(self) -> None:
        # The epoch's validation has run by now, and its metrics are reduced.
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")}
        shown = self.printed(metrics)
        if shown and self.validated_step == self.global_step and self.global_rank == 0 and self.hparams.progress:
            tqdm.write(f"epoch {self.current_epoch}: " + " | ".join(f"{k} {v:.3f}" for k, v in shown.items()))
