"""What a ``lit-grpo ... fit`` shows: its progress bar, and what it prints last (the held-out figures
before and after, the minutes, and where the run's metrics, curves, adapter and checkpoints are)."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar

from lit_grpo.training.history import csv_logger


class RunProgressBar(RichProgressBar):
    """Lightning's rich progress bar without ``v_num``, which it prints as a float (``v_num: 0.000``);
    the run's folder is in the summary at the end."""

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


class PhaseLine:
    """A phase's one line where no progress bar is shown (``trainer.enable_progress_bar: false``,
    e.g. a batch job's log): what ran, how much of it and its seconds, printed when the phase ends.
    Takes the calls a tqdm bar takes (``update``, ``close``).

    Args:
        description: What the phase is (``rollout``, ``held-out prompts (greedy)``).
        unit: What ``update`` counts (decoding ``step``, ``prompt``).
    """

    def __init__(self, description: str, unit: str) -> None:
        self.description, self.unit, self.count = description, unit, 0
        self.started: float | None = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.count += n

    def close(self) -> None:
        if self.started is not None:  # closed once, where a bar may be closed twice
            seconds, self.started = time.perf_counter() - self.started, None
            print(f"{self.description}: {_count(self.count, self.unit)} in {seconds:.1f} s", flush=True)


def run_summary(trainer: L.Trainer, module, seconds: float, adapter: str | None) -> str:
    """The summary of a finished fit of ``module`` (a :class:`~lit_grpo.algorithms.base.PolicyModule`).

    Args:
        trainer: The trainer that ran the fit.
        module: The trained module; its ``initial_metrics`` and ``final_metrics`` are the held-out
            figures before the first step (a resumed run's come from its checkpoint) and after the last.
        seconds: This command's wall-clock time (a resumed run's epochs and steps count from the start).
        adapter: Where the adapter was exported, if it was.
    """
    epochs = trainer.fit_loop.epoch_progress.current.completed
    steps = trainer.global_step
    lines = [
        f"finished: {_count(epochs, 'epoch')}, {_count(steps, 'optimizer step')} (this command: {seconds / 60:.1f} min)"
    ]
    before, after = module.printed(module.initial_metrics), module.printed(module.final_metrics)
    for name in dict.fromkeys([*before, *after]):
        lines.append(f"  {name}: {_figure(before.get(name))} before -> {_figure(after.get(name))} after")
    logger = csv_logger(trainer)
    if logger is not None:
        folder = Path(logger.log_dir)
        lines.append(f"  metrics: {_here(folder / 'metrics.csv')} (curves: lit-grpo plot {_here(folder)})")
    else:  # not trainer.log_dir: a broadcast, and this runs on rank 0 alone
        folder = getattr(trainer.logger, "log_dir", None) or getattr(trainer.logger, "save_dir", None)
        if folder:
            lines.append(f"  logs: {_here(folder)}")
    if adapter:
        lines.append(f"  adapter: {_here(adapter)}")
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            if callback.best_model_path and callback.monitor:
                lines.append(f"  best checkpoint ({callback.monitor}): {_here(callback.best_model_path)}")
            # without a monitor the one kept is the newest (the command's default: last.ckpt)
            last = callback.last_model_path or (callback.best_model_path if not callback.monitor else "")
            if last:
                lines.append(f"  last checkpoint: {_here(last)}")
    return "\n".join(lines)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _here(path) -> str:
    """``path`` relative to the working directory where it lies below it (as the user typed it), else whole."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
