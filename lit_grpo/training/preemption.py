"""Preemption-safe runs: SIGTERM or SIGINT saves a checkpoint that resumes exactly, then exits non-zero.

Schedulers preempt with SIGTERM (SLURM, Kubernetes) and give the job a grace
period before SIGKILL; a person presses Ctrl-C. Lightning's own handling of
SIGTERM stops after the next micro-batch, which may be inside a gradient
accumulation window (whose gradients no checkpoint holds), saves nothing, and
exits 0, so a scheduler takes the run as finished.

:class:`PreemptionCheckpoint` instead stops at the next *safe point* and saves
``last.ckpt`` there:

* after an optimizer step (the state a step-interval checkpoint holds);
* at the end of a training epoch (the signal came during validation);
* inside a rollout on a single process: generation stops at the next decoding
  step, the prompts it took are given back, and the checkpoint is the state
  before the epoch's rollout. Under several processes a rollout runs to its
  end (the ranks could not agree on where to stop without meeting in a
  collective), and the stop comes after the first optimizer step on it.

Under several processes every rank learns of the signal (rank 0 passes it on
to the ranks it launched), the ranks agree at each optimizer step whether any
of them was signalled, and all stop at the same step: rank 0 writes the
checkpoint, every rank raises :class:`Preempted`. The process exits with
``128 + signal`` (143 for SIGTERM) after one line naming the checkpoint and
how to resume. A second Ctrl-C interrupts at once, as usual.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_requested: list[int] = []  # the signal asking this process to stop, once one came
_abortable = threading.local()  # whether the code running now may stop in the middle (a rollout)


class Preempted(SystemExit):
    """Training stopped on a signal; ``code`` is ``128 + signal``, the message says where it saved.

    A ``SystemExit``: the process ends with that code also where nothing catches it.
    """

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(128 + signum)
        self.signum, self.message = signum, message

    def __str__(self) -> str:
        return self.message


def stop_requested() -> int | None:
    """The signal that asked this process to stop (``SIGTERM``/``SIGINT``), or ``None``."""
    return _requested[0] if _requested else None


class Cancelled(Exception):
    """Work abandoned because its owner closed (see :func:`abortable`'s ``cancel``)."""


def check_abort() -> None:
    """Raise :class:`Preempted` when a stop was requested and the running code may stop here,
    :class:`Cancelled` when its ``cancel`` event is set.

    Called once per decoding step; only inside :func:`abortable` does it raise.
    """
    cancel = getattr(_abortable, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise Cancelled
    if _requested and getattr(_abortable, "on", False):
        raise Preempted(_requested[0])


@contextlib.contextmanager
def abortable(allowed: bool = True, cancel: threading.Event | None = None):
    """Mark the code inside as safe to abandon on a stop request (see :func:`check_abort`), and
    (``cancel``) as abandoned once that event is set."""
    previous = getattr(_abortable, "on", False), getattr(_abortable, "cancel", None)
    _abortable.on, _abortable.cancel = allowed, cancel
    try:
        yield
    finally:
        _abortable.on, _abortable.cancel = previous


class PreemptionCheckpoint(Callback):
    """Save ``last.ckpt`` at the next safe point after SIGTERM/SIGINT, then stop with :class:`Preempted`.

    ``lit-grpo`` adds it to every run; every :class:`~lit_grpo.algorithms.base.PolicyModule`
    adds it to a plain ``Trainer`` that has none.

    Args:
        dirpath: Folder of ``last.ckpt``; ``None``: the first ``ModelCheckpoint``'s
            folder, or ``<default_root_dir>/checkpoints``.
        announce: Print the closing line (``lit-grpo: ...``) on rank 0 to
            stderr; the ``lit-grpo`` command prints it itself.
        resume_hint: How to resume, for the closing line; ``None``: pass the
            checkpoint as ``ckpt_path`` to ``trainer.fit``.
    """

    def __init__(
        self, dirpath: str | Path | None = None, announce: bool = True, resume_hint: str | None = None
    ) -> None:
        self.dirpath, self.announce, self.resume_hint = dirpath, announce, resume_hint
        self._previous: dict[int, object] = {}
        self._steps = -1

    # ---------------------------------------------------------------- signals
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning registers its SIGTERM handler just before training; this one replaces it.
        _requested.clear()
        self._steps = trainer.global_step
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle(trainer))

    def _handle(self, trainer: L.Trainer):
        def handle(signum: int, frame) -> None:
            if _requested and signum == signal.SIGINT:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            if not _requested:
                _requested.append(signum)
                launcher = trainer.strategy.launcher
                if launcher is not None and hasattr(launcher, "procs"):  # the ranks rank 0 launched
                    launcher.kill(signum)

        return handle

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
        self._previous = {}

    # ------------------------------------------------------------ safe points
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if trainer.global_step == self._steps:  # inside an accumulation window (or a skipped step)
            return
        self._steps = trainer.global_step
        self._stop_if_requested(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_requested(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A rollout abandoned on one process (check_abort): its DataModule gave its prompts
        # back, so the state is the one before the epoch's rollout.
        if isinstance(exception, Preempted) and not exception.message:
            exception.message = self._save(trainer, exception.signum)

    def _stop_if_requested(self, trainer: L.Trainer) -> None:
        signum = stop_requested() or 0
        if trainer.world_size > 1:  # the same decision on every rank
            signum = int(
                trainer.strategy.reduce(torch.tensor(signum, device=trainer.strategy.root_device), reduce_op="max")
            )
        if signum:
            raise Preempted(signum, self._save(trainer, signum))

    def _save(self, trainer: L.Trainer, signum: int) -> str:
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)  # every rank: the DataModule gathers the ranks' rollouts
        resume = self.resume_hint or f"trainer.fit(..., ckpt_path={str(path)!r})"
        message = (
            f"stopped by {signal.Signals(signum).name} at step {trainer.global_step} (epoch "
            f"{trainer.current_epoch}); checkpoint saved to {path}. Resume with: {resume}"
        )
        if self.announce and trainer.is_global_zero:
            sys.stderr.write(f"lit-grpo: {message}\n")
        return message

    def checkpoint_path(self, trainer: L.Trainer) -> Path:
        """Where the checkpoint goes: ``last.ckpt`` in :attr:`dirpath` (see the class's arguments)."""
        folder = self.dirpath
        if folder is None:
            saving = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None)
            folder = saving.dirpath if saving is not None and saving.dirpath else None
        if folder is None:
            folder = Path(trainer.default_root_dir) / "checkpoints"
        return Path(folder) / "last.ckpt"
