"""One run, one metrics history: a run resumed from a checkpoint carries on the ``metrics.csv`` it resumes.

Lightning gives a resumed run a new logger version folder (``version_N+1``)
holding only what it logs itself, so its curves would start at the resumed
epoch. :class:`~lit_grpo.algorithms.base.PolicyModule` records the
CSVLogger's ``metrics.csv`` in every checkpoint; the resumed run first logs
that file's rows from before the resumed point into its own logger
(:func:`carry_over`), so its ``metrics.csv``, and ``lit-grpo plot`` on it,
hold the whole run. The CSV logger is flushed at the start of every epoch
(:func:`flush`), so a killed run's file holds every finished epoch.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger


def csv_logger(trainer: L.Trainer) -> CSVLogger | None:
    """The trainer's first CSVLogger, or ``None``."""
    return next((logger for logger in trainer.loggers if isinstance(logger, CSVLogger)), None)


def metrics_file(trainer: L.Trainer) -> str | None:
    """The ``metrics.csv`` the trainer's CSVLogger writes (on rank 0; ``None`` elsewhere or without one)."""
    logger = csv_logger(trainer)
    if logger is None or not trainer.is_global_zero:
        return None
    return str((Path(logger.log_dir) / "metrics.csv").resolve())  # found again from another working directory


def flush(trainer: L.Trainer) -> None:
    """Write what the CSVLogger holds to its ``metrics.csv`` now (rank 0)."""
    logger = csv_logger(trainer)
    if logger is not None and trainer.is_global_zero:
        logger.save()


def carry_over(previous: str | Path, trainer: L.Trainer) -> int:
    """Log the rows of ``previous`` (an earlier run's ``metrics.csv``) from before the point ``trainer``
    resumes at into the trainer's CSVLogger; return how many.

    Kept: rows of earlier epochs, rows of the resumed epoch logged before its
    global step (a checkpoint saved inside an epoch), and rows without an epoch
    logged at step 0 (the held-out figures before training) or before the
    resumed step (what callbacks log directly). Cells that are not numbers are left out.
    """
    logger, path = csv_logger(trainer), Path(previous)
    if logger is None or not trainer.is_global_zero or not path.is_file():
        return 0
    if path.resolve() == (Path(logger.log_dir) / "metrics.csv").resolve():
        return 0  # a logger with a fixed version: Lightning's CSV writer emptied this file as the run started
    epoch, step = trainer.current_epoch, trainer.global_step
    carried = 0
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            values = {k: _number(v) for k, v in row.items() if k != "step"}
            values = {k: v for k, v in values.items() if v is not None}
            row_step = int(_number(row.get("step")) or 0)
            row_epoch = values.get("epoch")
            if row_epoch is None:  # the figures before training, and what callbacks log without an epoch
                before = row_step == 0 or row_step < step
            else:
                before = row_epoch < epoch or (row_epoch == epoch and row_step < step)
            if before and values:
                logger.log_metrics(values, step=row_step)
                carried += 1
    return carried


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
