"""Which quickstart recipe generalises: greedy accuracy against wall-clock minutes, 3 seeds per candidate.

Each candidate is ``lit-grpo fit --config configs/quickstart.yaml`` plus a few
overrides, run as the user runs it (the real command, in a fresh process,
progress bar and CSV logger on), with one seed per run (``seed_everything`` and
``data.seed``: prompt order, the task's rows, sampling). Two held-out sets are
scored greedily before training and at every validation:

* ``val/2+2/accuracy``: 64 two-digit sums the run never trains on;
* ``val/3+2/accuracy``: 64 three-digit + two-digit sums, a form the training
  distribution does not cover (``mix33`` trains on 2+2 and 3+3 sums, ``mix3``
  on 2+2, 2+3 and 3+3: 3+2 is the one combination left out).

Both are ``data.val_slices``, generated apart from the training rows.

A callback (:class:`Clock`, added with ``--trainer.callbacks+=``) stamps each
validation with the wall clock, so the curves' x axis is minutes since the
command started: model load, rollouts, steps and the evaluations themselves.
The table gives, per candidate, the whole command's wall time and each set's
accuracy before and after training and its gain, as mean ± sample std over the
seeds with the range; ``OUT/curves.png`` draws each candidate's mean ± std per
set. Finished runs are cached in ``OUT/runs/<candidate>-<seed>.json`` and
reused unless ``--fresh``.

Run alone on the machine (the candidates are compared by wall-clock minutes)::

    python benchmarks/quickstart_recipes.py --seeds 0 1 2 --out runs/recipes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
from report import write_report

ROOT = Path(__file__).resolve().parent.parent
# Both sets are held-out slices, so a candidate that mixes other questions into training (and so
# into val/accuracy, held out from the same rows) is scored on the same questions as the rest.
SLICES = {"2+2": {"digits": 2}, "3+2": {"digits": [3, 2]}}
SETS = {"val/2+2/accuracy": "2-digit + 2-digit", "val/3+2/accuracy": "3-digit + 2-digit"}
# name -> overrides of configs/quickstart.yaml. Each names every setting the candidates vary (task
# mix, dynamic sampling, epochs, lr and its schedule), so it means the same recipe whatever the
# shipped config holds (today: "mix3-ds-cos-4x8-lr2e-4-40ep").
TWO_DIGIT = '--data.task_args={"digits": 2, "ops": "+"}'
MIX33 = '--data.task_args=[{"digits": 2, "ops": "+"}, {"digits": [3, 3], "ops": "+"}]'
MIX3 = '--data.task_args=[{"digits": 2, "ops": "+"}, {"digits": [2, 3], "ops": "+"}, {"digits": [3, 3], "ops": "+"}]'
PLAIN, DYNAMIC = "--data.dynamic_sampling=false", "--data.dynamic_sampling=true"
CONSTANT_LR = "--model.scheduler=null"
COSINE = ["--model.scheduler=torch.optim.lr_scheduler.CosineAnnealingLR", "--model.scheduler.T_max=40"]
CANDIDATES: dict[str, list[str]] = {
    "2digit-4x8-lr1e-4-30ep": [
        TWO_DIGIT,
        PLAIN,
        CONSTANT_LR,
        "--trainer.max_epochs=30",
        "--model.optimizer.init_args.lr=1e-4",
    ],
    "2digit-4x8-lr2e-4-40ep": [
        TWO_DIGIT,
        PLAIN,
        CONSTANT_LR,
        "--trainer.max_epochs=40",
        "--model.optimizer.init_args.lr=2e-4",
    ],
    "mix33-4x8-lr2e-4-40ep": [
        MIX33,
        PLAIN,
        CONSTANT_LR,
        "--trainer.max_epochs=40",
        "--model.optimizer.init_args.lr=2e-4",
    ],
    "mix3-4x8-lr2e-4-40ep": [
        MIX3,
        PLAIN,
        CONSTANT_LR,
        "--trainer.max_epochs=40",
        "--model.optimizer.init_args.lr=2e-4",
    ],
    "mix3-ds-4x8-lr2e-4-40ep": [
        MIX3,
        DYNAMIC,
        CONSTANT_LR,
        "--trainer.max_epochs=40",
        "--model.optimizer.init_args.lr=2e-4",
    ],
    "mix3-ds-cos-4x8-lr2e-4-40ep": [
        MIX3,
        DYNAMIC,
        *COSINE,
        "--trainer.max_epochs=40",
        "--model.optimizer.init_args.lr=2e-4",
    ],
    # the default recipe with bf16 base weights and matmuls (docs/speed.md)
    "mix3-ds-cos-4x8-lr2e-4-40ep-bf16": [
        MIX3,
        DYNAMIC,
        *COSINE,
        "--trainer.max_epochs=40",
        "--model.optimizer.init_args.lr=2e-4",
        "--model.policy.dtype=bfloat16",
    ],
    # fp32 weights and residual stream, bf16 matmuls under autocast, rollouts from a bf16 copy
    "mix3-ds-cos-4x8-lr2e-4-40ep-bf16-mixed": [
        MIX3,
        DYNAMIC,
        *COSINE,
        "--trainer.max_epochs=40",
        "--model.optimizer.init_args.lr=2e-4",
        "--trainer.precision=bf16-mixed",
        "--model.generation.dtype=bfloat16",
    ],
}


class Clock(L.Callback):
    """Appends ``{"time": unix seconds, "epoch": e, metric: value, ...}`` to ``LOG_DIR/clock.jsonl``
    at each evaluation, the scores taken before training (in ``on_train_start``) included."""

    def on_train_epoch_start(self, trainer, module) -> None:
        initial = getattr(module, "initial_val_accuracy", None)
        if trainer.global_step == 0 and initial:
            self._write(trainer, {"epoch": -1, **initial})

    def on_validation_end(self, trainer, module) -> None:
        metrics = trainer.callback_metrics
        self._write(
            trainer,
            {"epoch": trainer.current_epoch, **{name: float(metrics[name]) for name in SETS if name in metrics}},
        )

    @staticmethod
    def _write(trainer, values: dict) -> None:
        if trainer.global_rank == 0 and trainer.log_dir:
            with open(Path(trainer.log_dir) / "clock.jsonl", "a") as f:
                f.write(json.dumps({"time": time.time(), **values}) + "\n")


def run(candidate: str, seed: int, args: argparse.Namespace) -> dict | None:
    """One ``lit-grpo fit`` of a candidate and seed, timed; its curve read back from ``clock.jsonl``."""
    cache = Path(args.out) / "runs" / f"{candidate}-{seed}.json"
    if cache.exists() and not args.fresh:
        return json.loads(cache.read_text())
    log_dir = (Path(args.out) / "logs" / f"{candidate}-{seed}").resolve()
    command = [
        "lit-grpo",
        "fit",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        *CANDIDATES[candidate],
        "--seed_everything",
        str(seed),
        "--data.seed",
        str(seed),
        f"--data.val_slices={json.dumps(SLICES)}",
        f"--trainer.check_val_every_n_epoch={args.eval_every}",
        f"--trainer.default_root_dir={log_dir}",
        f"--trainer.logger.init_args.save_dir={log_dir}",
        "--trainer.callbacks+=quickstart_recipes.Clock",
        f"--export_adapter={log_dir / 'adapter'}",
        *args.extra,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")])),
    }
    start = time.time()
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.time() - start
    clocks = sorted(log_dir.rglob("clock.jsonl"), key=lambda p: p.stat().st_mtime)
    if out.returncode != 0 or not clocks:
        print(f"{candidate} seed {seed} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    points = [json.loads(line) for line in clocks[-1].read_text().splitlines()]
    result = {
        "candidate": candidate,
        "seed": seed,
        "seconds": seconds,
        "curves": {name: [((p["time"] - start) / 60, p[name]) for p in points if name in p] for name in SETS},
    }
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result))
    finals = ", ".join(f"{name} {curve[0][1]:.3f} -> {curve[-1][1]:.3f}" for name, curve in result["curves"].items())
    print(f"{candidate} seed {seed}: {finals}, {seconds / 60:.1f} min", file=sys.stderr)
    return result


def spread(values: list[float], digits: int = 3) -> str:
    """``mean ± sample std [min, max]`` (just the value for one)."""
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return (
        f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f} "
        f"[{min(values):.{digits}f}, {max(values):.{digits}f}]"
    )


def table(results: list[dict]) -> str:
    """One row per candidate: wall time, and per set accuracy before, after and the gain in points."""
    headers = ["candidate", "seeds", "minutes"]
    for label in SETS.values():
        headers += [f"{label} before", "after", "gain (points)"]
    lines = ["| " + " | ".join(headers) + " |", "|---" * len(headers) + "|"]
    for candidate in dict.fromkeys(r["candidate"] for r in results):
        runs = [r for r in results if r["candidate"] == candidate]
        cells = [candidate, str(len(runs)), spread([r["seconds"] / 60 for r in runs], 1)]
        for name in SETS:
            before = [r["curves"][name][0][1] for r in runs]
            after = [r["curves"][name][-1][1] for r in runs]
            cells += [spread(before), spread(after), spread([100 * (a - b) for a, b in zip(after, before)], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_at(curve: list[list[float]], minutes: float) -> float:
    """Accuracy at ``minutes``: the latest evaluation at or before it (the first one before any)."""
    earlier = [accuracy for at, accuracy in curve if at <= minutes]
    return earlier[-1] if earlier else curve[0][1]


def plot(results: list[dict], path: Path) -> Path:
    """Per set, each candidate's mean greedy accuracy against minutes, with a ± std band over seeds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(figure)
    for column, (name, label) in enumerate(SETS.items()):
        axes = figure.add_subplot(1, len(SETS), column + 1)
        for candidate in dict.fromkeys(r["candidate"] for r in results):
            curves = [r["curves"][name] for r in results if r["candidate"] == candidate]
            end = min(curve[-1][0] for curve in curves)
            grid = [end * i / 100 for i in range(101)]
            values = [[accuracy_at(curve, m) for curve in curves] for m in grid]
            mean = [statistics.fmean(v) for v in values]
            std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
            (line,) = axes.plot(grid, mean, label=f"{candidate} (n={len(curves)})", drawstyle="steps-post")
            axes.fill_between(
                grid,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=line.get_color(),
                alpha=0.15,
                step="post",
            )
        axes.set_title(label)
        axes.set_xlabel("minutes since the command started")
        axes.set_ylabel("greedy accuracy, mean ± std over seeds")
        axes.set_ylim(0, 1)
        axes.grid(alpha=0.3)
        axes.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval_every", type=int, default=5, help="epochs between greedy evaluations")
    parser.add_argument("--out", default="runs/recipes")
    parser.add_argument("--fresh", action="store_true", help="rerun runs cached in OUT/runs")
    parser.add_argument("--cached_only", action="store_true", help="report the cached runs, start none")
    parser.add_argument("extra", nargs="*", help="more lit-grpo fit arguments for every run (after --)")
    args = parser.parse_args()
    cached = Path(args.out) / "runs"
    pairs = [
        (c, seed)
        for c in args.candidates
        for seed in args.seeds
        if not args.cached_only or (cached / f"{c}-{seed}.json").exists()
    ]
    results = [r for candidate, seed in pairs if (r := run(candidate, seed, args))]
    if not results:
        sys.exit("no run finished")
    write_report(
        args.out,
        results,
        f"Quickstart recipes, seeds {args.seeds}: mean ± sample std [min, max] over seeds.",
        table(results),
    )
    print(f"plot: {plot(results, Path(args.out) / 'curves.png')}")


if __name__ == "__main__":
    main()
