"""Tables of GRPO runs scored by a reward model vs by the verifier, from their metrics.csv.

    python benchmarks/reward_hacking_gap.py rm=runs/grpo_rm_s0 verifier=runs/grpo_verifier_s0 [...]

Each ``label=run_dir`` is a finished ``lit-grpo fit`` run with a CSV logger
(the commands are in docs/pipeline.md); a label given several times (one
run per seed) is averaged, with the standard deviation over seeds beside it.
Two tables: held-out greedy accuracy before and after training
(``val/accuracy`` and each ``val/<slice>/accuracy``), and, per epoch of
training, the reward model's mean score of the rollouts
(``reward/reward_model``) beside their verified accuracy (``reward/accuracy``):
the gap between what the policy is optimised for and what is true.
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def read(run: Path) -> list[dict[str, str]]:
    """The rows of the newest metrics.csv under ``run``."""
    files = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"{run}: no metrics.csv (was the run logged with a CSVLogger?)")
    with files[-1].open() as f:
        return list(csv.DictReader(f))


def held_out(rows: list[dict[str, str]]) -> dict[str, tuple[float | None, float]]:
    """``metric -> (first value, last value)`` of every held-out accuracy; the first is ``None``
    when the run validated once (``--model.validate_before_training=false``: no "before")."""
    names = [k for k in rows[0] if k.startswith("val/") and k.endswith("accuracy")]
    out = {}
    for name in names:
        values = [float(r[name]) for r in rows if r.get(name)]
        if values:
            out[name] = (values[0] if len(values) > 1 else None, values[-1])
    return out


def per_epoch(rows: list[dict[str, str]], name: str) -> dict[int, float]:
    return {int(r["epoch"]): float(r[name]) for r in rows if r.get(name) and r.get("epoch")}


def _cell(values: list[float | None]) -> str:
    """One value, or the mean ± sample std over seeds followed by each seed's value; "—" if none."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    each = ", ".join(f"{v:.3f}" for v in values)
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({each})"


def main(argv: list[str]) -> None:
    runs: dict[str, list[list[dict[str, str]]]] = defaultdict(list)
    for item in argv:
        label, _, path = item.partition("=")
        runs[label].append(read(Path(path)))
    print("| run | seeds | held-out set | before | after |\n|---|---|---|---|---|")
    for label, seeds in runs.items():
        tables = [held_out(rows) for rows in seeds]
        for name in tables[0]:
            before = [t[name][0] for t in tables if name in t]
            after = [t[name][1] for t in tables if name in t]
            print(f"| {label} | {len(seeds)} | {name} | {_cell(before)} | {_cell(after)} |")
    print("\n| run | epoch | reward model score (rollouts) | verified accuracy (rollouts) |\n|---|---|---|---|")
    for label, seeds in runs.items():
        scores = [per_epoch(rows, "reward/reward_model") for rows in seeds]
        verified = [per_epoch(rows, "reward/accuracy") for rows in seeds]
        epochs = sorted(set.intersection(*(set(s) for s in scores)))
        for epoch in sorted(set(epochs[::4]) | set(epochs[-1:])):  # every 4th epoch and the last
            print(
                f"| {label} | {epoch} | {_cell([s[epoch] for s in scores])} | "
                f"{_cell([v[epoch] for v in verified if epoch in v])} |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
