"""PolicyModule: what every objective's LightningModule shares about the policy.

GRPO and DPO train the same thing, a causal LM through a (Q)LoRA adapter whose
frozen base weights are the reference policy, and differ only in the loss.
This base class owns that shared part: loading the policy once in
``configure_model``, the reference model, the optimizer over the trainable
weights with the non-finite-gradient guard, checkpoints that hold only the
trainable weights, and exporting the adapter. Subclasses add the objective.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from tqdm.auto import tqdm

from lit_grpo.model.policy import PolicySpec, build_policy, load_tokenizer
from lit_grpo.model.refusals import constructed
from lit_grpo.training import history
from lit_grpo.training.checkpointing import atomic_folder, atomic_sharded_saves, check_checkpoint
from lit_grpo.training.distributed import full_tensors, reduce_across_ranks, shard
from lit_grpo.training.guard import NonFiniteGuard
from lit_grpo.training.strategies import check_strategy

if TYPE_CHECKING:
    from lit_grpo.generation import Engine
from lit_grpo.training.preemption import PreemptionCheckpoint, stop_requested

# Lightning 2.6 on torch >= 2.10 warns from its own pytree helper (``isinstance(treespec, LeafSpec)`` is
# deprecated) at every epoch: its code, not a run's, so the message is dropped where it comes from.
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module="lightning.pytorch.utilities._pytree"
)


class PolicyModule(L.LightningModule):
    """Base class: a policy with its reference, optimizer and checkpoints.

    Subclasses call ``super().__init__(...)`` first, then
    ``self.save_hyperparameters(...)`` with their own arguments.

    Args:
        policy: Which model to train, its adapter, quantization and dtype.
        optimizer: Optimizer factory over the trainable parameters; ``None``
            gives AdamW with lr 1e-4 and no weight decay.
        scheduler: Optional learning-rate scheduler factory (stepped per
            optimizer step).
        max_nonfinite_steps: Consecutive optimizer steps with a NaN/inf
            gradient that are skipped before training stops with an error.
    """

    def __init__(
        self,
        policy: PolicySpec | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        max_nonfinite_steps: int = 3,
    ) -> None:
        super().__init__()
        self.spec = policy or PolicySpec()
        self.tokenizer = load_tokenizer(self.spec)
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.guard = NonFiniteGuard(max_nonfinite_steps)
        # Checkpoints hold only the trainable weights: the frozen base is reloaded
        # from its source. Filtering state_dict() itself, not just the saved dict,
        # keeps sharded (DCP) resume under ModelParallelStrategy working too: it
        # loads exactly the keys this module's state_dict() lists.
        self.register_state_dict_post_hook(_keep_trainable)
        self.strict_loading = False
        self.phase_seconds: dict[str, float] = {}
        self._engine: Engine | None = None  # what samples (objectives that generate), built on first use
        self.initial_metrics: dict[str, float] = {}  # held-out metrics before the first step
        self.final_metrics: dict[str, float] = {}  # and after the last (see on_train_end)
        self.resumed_metrics: str | None = None  # the metrics.csv of the run a checkpoint resumes

    # ------------------------------------------------------------------ model
    def setup(self, stage: str) -> None:
        check_strategy(self.trainer)  # before configure_model loads any weights
        atomic_sharded_saves(self.trainer.strategy)

    def configure_model(self) -> None:
        """Load the policy once (Lightning may call this more than once); shard it under FSDP2."""
        if self.policy is None:
            self.policy, self.reference = build_policy(self.spec, need_reference=self.needs_reference)
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        bind = getattr(getattr(datamodule, "rewards", None), "bind", None)
        if bind is not None:  # a reward model on the policy's base adds its adapter before FSDP2 wraps the layers
            bind(self)
        if self.device_mesh is not None:  # ModelParallelStrategy
            for model in (self.policy, self.reference):
                if model is not None:
                    shard(model, self.device_mesh)

    @property
    def needs_reference(self) -> bool:
        """Whether the objective reads the reference policy (full fine-tuning then keeps a copy)."""
        return True

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module]:
        """Yield the reference policy in eval mode: the policy with its adapter
        disabled, or the frozen copy under full fine-tuning."""
        if self.reference is not None:
            yield self.reference
            return
        was_training = self.policy.training
        self.policy.eval()  # the reference is a fixed function: no adapter dropout
        try:
            with self.policy.disable_adapter():
                yield self.policy
        finally:
            self.policy.train(was_training)

    def configure_callbacks(self) -> list:
        """A :class:`~lit_grpo.training.preemption.PreemptionCheckpoint` where the Trainer has none:
        SIGTERM/SIGINT save a checkpoint that resumes exactly, also under a plain ``Trainer``."""
        present = self._trainer is not None and any(isinstance(c, PreemptionCheckpoint) for c in self.trainer.callbacks)
        return [] if present else [PreemptionCheckpoint()]

    # -------------------------------------------------------------- optimizer
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def optimizer_groups(self) -> list:
        """What the optimizer trains: the trainable parameters, or parameter groups of them."""
        return self.trainable_parameters()

    def configure_optimizers(self):
        params = self.optimizer_groups()
        optimizer = (
            constructed("model.optimizer.init_args", self.optimizer_factory, params)
            if self.optimizer_factory
            else torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        )
        if self.scheduler_factory is None:
            return optimizer
        scheduler = constructed("model.scheduler.init_args", self.scheduler_factory, optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Step only when the gradient is finite (see :class:`NonFiniteGuard`); then tell the sampling
        engine, if one was built, that the weights may have moved."""
        optimizer_closure()
        if self.guard.check(self.trainable_parameters()):
            start = time.perf_counter()
            optimizer.step()
            self._add_time("optimizer", time.perf_counter() - start)
        else:
            optimizer.zero_grad(set_to_none=True)
        if self._engine is not None:
            self._engine.weights_changed()

    def teardown(self, stage: str) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # ---------------------------------------------------------------- logging
    def log_reduced(
        self,
        values: Mapping[str, float | torch.Tensor],
        weight: float = 1.0,
        op: str = "mean",
        prog_bar: bool = False,
        on_step: bool = False,
    ) -> tuple[dict[str, float], float]:
        """Log epoch metrics reduced over all ranks here and now (see :func:`reduce_across_ranks`).

        A collective: every rank calls it at the same point with the same keys;
        a rank with nothing to report passes ``weight=0``. The logged values
        are the same on every rank, so they are logged without
        ``sync_dist``, whose lazy epoch-end reduction runs only where a value
        is read first (rank 0's progress bar) and deadlocks multi-process runs.
        The epoch value is the mean over the epoch's calls weighted by the
        total weight of each (``op="max"`` values are meant to be logged once
        per epoch). Returns the reduced values and the total weight.
        """
        reduced, total = reduce_across_ranks(self.trainer.strategy, values, weight, op)
        if total <= 0:  # nothing to report on any rank (the same decision everywhere)
            return reduced, total
        for name in reduced:
            _silence_sync_advice(name)
        self.log_dict(
            reduced,
            on_step=on_step,
            on_epoch=True,
            prog_bar=prog_bar,
            sync_dist=False,
            batch_size=max(int(round(total)), 1),
        )
        return reduced, total

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """Step the LR schedule only after an optimizer step that was taken.

        Lightning steps a per-step scheduler after every optimizer step it
        called; one the non-finite guard skipped must not move the schedule.
        """
        per_step = any(c.scheduler is scheduler and c.interval == "step" for c in self.trainer.lr_scheduler_configs)
        if per_step and self.guard.consecutive:  # the optimizer step just before was skipped
            return
        super().lr_scheduler_step(scheduler, metric)

    def _add_time(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    def on_fit_start(self) -> None:
        if self.global_rank == 0 and self.hparams.get("progress", True):
            total = sum(p.numel() for p in self.policy.parameters())
            trainable = sum(p.numel() for p in self.trainable_parameters())
            tqdm.write(
                f"policy {self.spec.name_or_path}: {trainable / 1e6:.1f} M trainable of {total / 1e6:.0f} M parameters"
            )

    # ------------------------------------------------------------- held out
    def held_out_metrics(self) -> dict[str, float]:
        """The current policy's metrics on the held-out data, named as validation logs them
        (every rank takes part); ``{}`` where there is no held-out data."""
        return {}

    @property
    def validates_before_training(self) -> bool:
        """Whether a run from step 0 scores the held-out data before its first step."""
        return True

    def on_train_start(self) -> None:
        self.validated_step: int | None = None  # the global step of this fit's latest validation
        resumed = self.trainer.ckpt_path is not None
        if resumed and self.resumed_metrics:  # this run's metrics.csv starts with the resumed run's
            history.carry_over(self.resumed_metrics, self.trainer)
        self.resumed_metrics = None
        if self.global_step == 0 and self.validates_before_training and not (resumed and self.initial_metrics):
            self.initial_metrics = self.held_out_metrics()
            self._report("before training", self.initial_metrics, step=0)

    def on_train_epoch_start(self) -> None:
        history.flush(self.trainer)  # a run killed in this epoch leaves the finished ones on disk

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_step = self.global_step

    def on_train_end(self) -> None:
        """The held-out metrics after training (:attr:`final_metrics`): the last validation's, or a final
        validation when the last step had none (and validation is not switched off)."""
        trainer = self.trainer
        if self.validated_step == self.global_step:
            self.final_metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        elif trainer.limit_val_batches != 0 and stop_requested() is None:  # not while a SIGTERM waits
            self.final_metrics = self.held_out_metrics()
            epoch = trainer.fit_loop.epoch_progress.current.started - 1  # the last epoch that ran
            self._report("after training", self.final_metrics, step=self.global_step, epoch=epoch)

    def _report(self, when: str, metrics: dict[str, float], step: int, epoch: int | None = None) -> None:
        """Log held-out ``metrics`` to every logger and print them on rank 0 as ``<when>: name value | ...``."""
        if not metrics:
            return
        for logger in self.loggers:
            logger.log_metrics(metrics if epoch is None else {**metrics, "epoch": epoch}, step=step)
        if self.global_rank == 0 and self.hparams.get("progress", True):
            shown = self.printed(metrics)
            tqdm.write(f"{when}: " + " | ".join(f"{name} {value:.3f}" for name, value in shown.items()))

    def printed(self, metrics: dict[str, float]) -> dict[str, float]:
        """Which of ``metrics`` the printed lines show (all of them here)."""
        return metrics

    # ------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["nonfinite_guard"] = self.guard.state_dict()
        checkpoint["held_out_before"] = self.initial_metrics  # a resumed run's "before"
        history.flush(self.trainer)
        checkpoint["metrics_file"] = history.metrics_file(self.trainer)  # where a resumed run's history starts

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.configure_model()
        check_checkpoint(checkpoint, self)  # refuse weights saved for another base model, LoRA rank or targets
        self.guard.load_state_dict(checkpoint.get("nonfinite_guard", {}))
        self.initial_metrics = checkpoint.get("held_out_before", {})
        self.resumed_metrics = checkpoint.get("metrics_file")

    def export_adapter(self, path: str | Path) -> Path:
        """Write the trained policy as a standard PEFT adapter folder (+ tokenizer).

        ``PeftModel.from_pretrained(base_model, path)`` reloads it. Under full
        fine-tuning the whole model is written instead. Call it on every rank:
        FSDP2-sharded trainable weights are gathered first (a collective);
        rank 0 writes, into a temporary folder that then replaces ``path``
        (:func:`~lit_grpo.training.checkpointing.atomic_folder`): a run killed while
        exporting leaves the previous export or none, never a part of one.
        """
        path = Path(path)
        write = self.export_writer()
        if self.global_rank == 0:
            with atomic_folder(path) as folder:
                write(folder)
        return path

    def export_writer(self) -> Callable[[Path], None]:
        """Gather what :meth:`export_adapter` writes (on every rank) and return what writes it into a folder."""
        state = None
        if self.device_mesh is not None:
            state = full_tensors((name, p) for name, p in self.policy.named_parameters() if p.requires_grad)

        def write(folder: Path) -> None:
            self.policy.save_pretrained(folder, state_dict=state)
            self.tokenizer.save_pretrained(folder)

        return write


@functools.cache
def _silence_sync_advice(name: str) -> None:
    # Lightning advises sync_dist=True for every unsynced epoch metric under DDP;
    # values logged through log_reduced are reduced already (syncing them again
    # at read time is what deadlocks), so the advice is silenced for their names only.
    warnings.filterwarnings("ignore", message=re.escape(f"It is recommended to use `self.log({name!r}"))


def _keep_trainable(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict`` post-hook: drop everything but trainable parameters."""
    trainable = {prefix + name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    for key in [k for k in state_dict if k.startswith(prefix) and k not in trainable]:
        del state_dict[key]
