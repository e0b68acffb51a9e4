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
    """A phase's progress as lines, where a tqdm bar cannot show: without a progress bar
    (``trainer.enable_progress_bar: false``, e.g. a batch job's log), and under Lightning's rich bar,
    whose live display holds a tqdm bar's output back until a newline the bar never writes. A line
    every ``every`` seconds while the phase runs (``rollout: 120/480 steps, 10 s``) and one when it
    ends (``rollout: 480 steps in 41.2 s``). Takes the calls a tqdm bar takes (``update``, ``close``).

    Args:
        description: What the phase is (``rollout``, ``held-out prompts (greedy)``).
        unit: What ``update`` counts (decoding ``step``, ``prompt``).
        total: How many ``update`` will count, if known.
        every: Seconds between the lines while it runs.
    """

    def __init__(self, description: str, unit: str, total: int | None = None, every: float = 10.0) -> None:
        self.description, self.unit, self.total, self.every, self.count = description, unit, total, every, 0
        self.started: float | None = time.perf_counter()
        self.shown = self.started

    def update(self, n: int = 1) -> None:
        self.count += n
        now = time.perf_counter()
        if self.started is not None and now - self.shown >= self.every:
            self.shown = now
            done = f"{self.count}/{self.total} {self.unit}s" if self.total else _count(self.count, self.unit)
            print(f"{self.description}: {done}, {now - self.started:.0f} s", flush=True)

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
