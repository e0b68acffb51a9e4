"""The GRPO loss family side by side on the quickstart: held-out accuracy and minutes over seeds.

Each run is the shipped ``configs/quickstart.yaml`` from the real CLI in a fresh
process, with one ``model.loss_type`` (GSPO is ``grpo`` with
``model.importance_level: sequence``) and two passes over every rollout
(``data.num_iterations: 2``): with one optimizer step per rollout every ratio
is 1, where grpo, gspo, cispo and sapo share one gradient; the second pass is
where their surrogates differ. The cosine schedule spans the run's steps.
Accuracy is greedy, on the config's held-out slices, after the last epoch;
minutes are the whole command, model load included.

    python benchmarks/losses.py --epochs 20 --seeds 0 1 2 --out runs/losses

Output: a markdown table (mean ± sample std over the seeds) on stdout and in
``OUT/table.md``; finished runs are kept in ``OUT/<loss>-<seed>.json`` and
reused.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import time
from pathlib import Path

from lit_grpo.model.hardware import cpu_name

LOSSES = {
    "grpo": [],
    "dr_grpo": ["--model.loss_type", "dr_grpo"],
    "dapo": ["--model.loss_type", "dapo"],
    "gspo": ["--model.importance_level", "sequence"],
    "cispo": ["--model.loss_type", "cispo"],
    "sapo": ["--model.loss_type", "sapo"],
}
SLICES = ("2+2", "3+2")


def run_one(loss: str, seed: int, args: argparse.Namespace) -> dict:
    """Train one loss at one seed through ``lit-grpo fit``; return its held-out accuracies and minutes."""
    cached = args.out / f"{loss}-{seed}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    logs = args.out / "logs" / f"{loss}-{seed}"
    command = [
        "lit-grpo", "fit", "--config", "configs/quickstart.yaml", "--seed_everything", str(seed),
        "--trainer.max_epochs", str(args.epochs), "--trainer.check_val_every_n_epoch", str(args.epochs),
        "--data.num_iterations", "2", "--model.scheduler.init_args.T_max", str(2 * args.epochs),
        "--model.validate_before_training", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]", "--export_adapter", "null",
        "--trainer.logger.init_args.save_dir", str(logs), *LOSSES[loss],
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    minutes = (time.perf_counter() - start) / 60
    rows = list(csv.DictReader(next(logs.rglob("metrics.csv")).open()))
    result = {"loss": loss, "seed": seed, "minutes": minutes}
    for name in SLICES:
        values = [float(row[f"val/{name}/accuracy"]) for row in rows if row.get(f"val/{name}/accuracy")]
        result[name] = values[-1]
    cached.write_text(json.dumps(result))
    return result


def _spread(values: list[float], digits: int) -> str:
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"


def table(results: list[dict]) -> str:
    """One markdown row per loss: mean ± sample std over its seeds."""
    lines = [
        "| loss | seeds | " + " | ".join(f"{name} accuracy" for name in SLICES) + " | minutes |",
        "|---" * (len(SLICES) + 3) + "|",
    ]
    for loss in LOSSES:
        runs = [r for r in results if r["loss"] == loss]
        if runs:
            cells = [_spread([r[name] for r in runs], 3) for name in SLICES]
            minutes = _spread([r["minutes"] for r in runs], 1)
            lines.append(f"| {loss} | {len(runs)} | " + " | ".join(cells) + f" | {minutes} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/losses"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_one(loss, seed, args) for seed in args.seeds for loss in args.losses]
    text = f"{table(results)}\n\nCPU: {cpu_name()}; {args.epochs} epochs, data.num_iterations 2\n"
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
