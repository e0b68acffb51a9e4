"""Per-epoch curves of a run, drawn from its CSVLogger ``metrics.csv``.

``lit-grpo plot RUN_DIR`` and :class:`PlotCallback` (end of fit) both call
:func:`plot_run`. Rows of ``metrics.csv`` are sparse: each metric is read as
``(epoch, value)`` points, the last value of an epoch winning; ``*_step``
columns are skipped. A value logged without an epoch (the validation
accuracy scored before training) is drawn at epoch -1.

Figures are built on matplotlib's Agg canvas directly, not through pyplot, so
plotting never switches the backend of a notebook or GUI session.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
from dataclasses import dataclass
from pathlib import Path

import lightning as L
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lit_grpo.cli_checks import check_writable, usage_error
from lit_grpo.training.history import csv_logger

BEFORE_TRAINING = -1  # the epoch at which values logged before the first epoch are drawn

Series = dict[str, list[tuple[int, float]]]  # metric -> [(epoch, value)], epochs ascending


@dataclass(frozen=True)
class Panel:
    """One subplot: the metrics (names or ``fnmatch`` patterns) drawn together."""

    title: str
    metrics: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    smooth: int = 0  # > 1: draw the raw values faintly under their trailing mean over this many epochs

    def select(self, names) -> list[str]:
        """The metrics among ``names`` this panel draws, sorted (``*/total`` first)."""
        chosen = [
            n
            for n in names
            if any(fnmatch.fnmatchcase(n, p) for p in self.metrics)
            and not any(fnmatch.fnmatchcase(n, p) for p in self.exclude)
        ]
        return sorted(chosen, key=lambda n: (not n.endswith("/total"), n))


PANELS: dict[str, Panel] = {
    "reward": Panel("reward (total and per function)", ("reward/*",), exclude=("reward/std",), smooth=5),
    "val/accuracy": Panel("validation accuracy (greedy)", ("val/accuracy", "val/*/accuracy")),
    "train/kl": Panel("KL to the reference", ("train/kl",)),
    "train/entropy": Panel("entropy (nats/token)", ("train/entropy",)),
    "completion/length": Panel("completion length (tokens)", ("completion/length_mean",)),
    "rollout/truncated_fraction": Panel("completions cut at max_new_tokens", ("rollout/truncated_fraction",)),
    "rollout/collapsed_fraction": Panel("groups with equal rewards", ("rollout/collapsed_fraction",)),
    "episode/tool_calls": Panel(
        "tool use per episode (calls, errors, timeouts, turns)",
        ("episode/tool_calls", "episode/tool_errors", "episode/tool_timeouts", "episode/turns_mean"),
    ),
    "train/loss": Panel("loss", ("train/loss_epoch",)),
    "train/value_loss": Panel("critic's value loss (PPO)", ("train/value_loss",)),
    "time": Panel("seconds per epoch", ("time/*",)),
    "perf/mfu": Panel("model FLOPs utilisation (training passes, rollout)", ("perf/mfu", "perf/rollout_mfu")),
}


def find_metrics(run_dir: str | Path) -> Path:
    """The newest ``metrics.csv`` under ``run_dir`` (or ``run_dir`` itself if it is the file).

    Raises:
        FileNotFoundError: No ``metrics.csv`` exists there.
    """
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return run_dir
    found = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"no metrics.csv under {run_dir}; plots need a run logged with a CSVLogger "
            "(trainer.logger: class_path lightning.pytorch.loggers.CSVLogger)."
        )
    return found[-1]


def read_metrics(path: str | Path) -> Series:
    """Per-epoch series of every epoch-level metric in a CSVLogger ``metrics.csv``."""
    points: dict[str, dict[int, float]] = {}
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            epoch = int(float(row["epoch"])) if row.get("epoch") else BEFORE_TRAINING
            for name, value in row.items():
                if name in ("epoch", "step") or name.endswith("_step") or value in ("", None):
                    continue
                points.setdefault(name, {})[epoch] = float(value)
    return {name: sorted(values.items()) for name, values in sorted(points.items())}


def plot_panels(series: Series, panels: list[Panel], columns: int = 3) -> Figure:
    """A grid of panels, one line per metric; panels without data are left out.

    Raises:
        ValueError: None of the panels has data in ``series``.
    """
    filled = [(panel, panel.select(series)) for panel in panels]
    filled = [(panel, names) for panel, names in filled if names]
    if not filled:
        wanted = sorted({p for panel in panels for p in panel.metrics})
        raise ValueError(f"none of the metrics {wanted} were logged; the run has {sorted(series)}.")
    columns = min(columns, len(filled))
    rows = -(-len(filled) // columns)
    figure = Figure(figsize=(4.2 * columns, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, (panel, names) in zip(axes, filled):
        for name in names:
            epochs, values = zip(*series[name])
            if panel.smooth > 1 and len(values) > 1:
                # The sampled reward of one epoch is noisy (a few prompts); the trend is the mean.
                raw = ax.plot(epochs, values, marker="o", markersize=2, alpha=0.3, linewidth=0.8)[0]
                ax.plot(
                    epochs,
                    moving_average(values, panel.smooth),
                    color=raw.get_color(),
                    linewidth=2,
                    label=f"{name} ({panel.smooth}-epoch mean)",
                )
            else:
                ax.plot(epochs, values, marker="o", markersize=3, label=name)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("epoch" + (" (-1: before training)" if _has_before(series, names) else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(names) > 1 or panel.smooth > 1:
            ax.legend(fontsize=7)
    for ax in axes[len(filled) :]:
        ax.set_visible(False)
    return figure


def moving_average(values: list[float] | tuple[float, ...], window: int) -> list[float]:
    """Trailing mean of each value and the ``window - 1`` before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def plot_run(
    run_dir: str | Path,
    out: str | Path | None = None,
    panels: list[str] | None = None,
    each: bool = False,
    filename: str = "curves.png",
    columns: int = 3,
) -> list[Path]:
    """Write a run's curves as PNG files and return their paths (the grid first).

    Args:
        run_dir: A run folder (searched for the newest ``metrics.csv``) or the file itself.
        out: Folder to write into; defaults to ``run_dir`` (its folder, if a file).
        panels: Keys of :data:`PANELS` to draw, in order; ``None`` draws all (or,
            for a run that logged none of them, one panel per logged metric).
        each: Also write one PNG per logged epoch-level metric into ``out/curves/``.
        filename: Name of the grid figure.
        columns: Panels per row of the grid.

    Raises:
        KeyError: A panel name is not in :data:`PANELS`.
    """
    source = find_metrics(run_dir)
    series = read_metrics(source)
    unknown = [name for name in panels or [] if name not in PANELS]
    if unknown:
        raise KeyError(f"unknown panel(s) {unknown}; expected some of {list(PANELS)}.")
    chosen = [PANELS[name] for name in panels] if panels else list(PANELS.values())
    if not panels and not any(panel.select(series) for panel in chosen):
        chosen = [Panel(name, (name,)) for name in series]  # not a GRPO run (e.g. DPO): every metric
    folder = Path(out) if out is not None else (Path(run_dir) if Path(run_dir).is_dir() else source.parent)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / filename]
    plot_panels(series, chosen, columns).savefig(written[0], dpi=110)
    if each:
        (folder / "curves").mkdir(exist_ok=True)
        for name in series:
            path = folder / "curves" / f"{name.replace('/', '_')}.png"
            plot_panels(series, [Panel(name, (name,))], columns=1).savefig(path, dpi=110)
            written.append(path)
    return written


def _has_before(series: Series, names: list[str]) -> bool:
    return any(series[name][0][0] == BEFORE_TRAINING for name in names)


class PlotCallback(L.Callback):
    """Write the run's curves into the CSVLogger's folder at the end of fit (rank 0).

    Args:
        panels: Keys of :data:`PANELS` to draw; ``None`` draws all.
        each: Also write one PNG per metric into ``<log_dir>/curves/``.
    """

    def __init__(self, panels: list[str] | None = None, each: bool = False) -> None:
        unknown = [name for name in panels or [] if name not in PANELS]
        if unknown:
            raise ValueError(f"PlotCallback panels={unknown} unknown; expected some of {list(PANELS)}.")
        self.panels, self.each = panels, each
        self.written: list[Path] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and csv_logger(trainer) is None:
            raise ValueError(
                "PlotCallback reads the CSVLogger's metrics.csv, but trainer.logger is "
                f"{trainer.logger!r}; set trainer.logger to lightning.pytorch.loggers.CSVLogger."
            )

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        logger = csv_logger(trainer)
        logger.save()
        path = Path(logger.log_dir) / "metrics.csv"
        if path.exists():
            self.written = plot_run(path, panels=self.panels, each=self.each)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        usage_error(self.prog, message)


def main(argv: list[str] | None = None) -> list[Path]:
    """``lit-grpo plot RUN_DIR [--out DIR] [--each] [--panels ...]``: print the PNGs written.

    Raises:
        NotADirectoryError: ``--out`` is a file (or under one).
        FileNotFoundError: No ``metrics.csv`` under ``RUN_DIR``.
        ValueError: None of the panels has data.
    """
    parser = _Parser(prog="lit-grpo plot", description="Draw a run's per-epoch curves as PNG files.")
    parser.add_argument("run_dir", help="run folder (the newest metrics.csv below it is read) or a metrics.csv")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR)")
    parser.add_argument("--each", action="store_true", help="also write one PNG per metric into OUT/curves/")
    parser.add_argument("--panels", nargs="+", choices=list(PANELS), default=None, help="panels to draw (default: all)")
    args = parser.parse_args(argv)  # a usage error exits here, in one line
    # Anything else raises: the lit-grpo command prints one "lit-grpo: <message>" line for it.
    if args.out is not None and Path(args.out).is_file():
        raise NotADirectoryError(
            f"--out={args.out!r} is a file; expected a folder to write the PNGs into (curves.png, and curves/ "
            f"with --each), e.g. --out {Path(args.out).parent}."
        )
    check_writable("--out", args.out)
    written = plot_run(args.run_dir, args.out, args.panels, args.each)
    for path in written:
        print(path)
    return written
