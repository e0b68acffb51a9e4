"""An exported reward model's pairwise accuracy on a config's held-out pairs, by kind of slip.

    python benchmarks/rm_by_slip.py --rm runs/rm_quickstart/rm [--config configs/rm_quickstart.yaml]
    python benchmarks/rm_by_slip.py --rm runs/rm1/rm runs/rm10/rm [--weights 1 1]   # and their weighted sum

Loads each ``--rm`` as transformers loads it (``AutoModelForSequenceClassification``, one full
pass per conversation, rendered through its own chat template as training rendered it:
``RewardDataModule.encode_pairs``), builds the config's ``data`` section as the command
does, and scores the held-out pairs: how often the chosen reply scores higher, over all and by the kind
of slip of the rejected reply (:func:`lit_grpo.data.tasks.slip_kind`: +-1, +-10, the last two
digits swapped), with the mean margin. Given several reward models, it prints each one's table and
then the table of their weighted sum of scores (the total a GRPO run forms from several
``RewardModel`` rewards with those weights, per-batch normalisation off).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import yaml
from rm_learning_curve import slip
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from lit_grpo.data.reward_pairs import RewardDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rm", nargs="+", default=["runs/rm_quickstart/rm"], help="exported sequence-classification folders"
    )
    parser.add_argument("--weights", nargs="+", type=float, help="one per --rm (default: 1 each)")
    parser.add_argument("--config", default="configs/rm_quickstart.yaml", help="whose data section to hold out")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    with open(args.config) as f:
        data = RewardDataModule(**yaml.safe_load(f)["data"])
    data.setup("fit")
    rows = data.val_rows
    weights = args.weights or [1.0] * len(args.rm)
    if len(weights) != len(args.rm):
        parser.error(f"--weights has {len(weights)} values for {len(args.rm)} --rm folders; give one per folder")
    total = [0.0] * len(rows)
    for folder, weight in zip(args.rm, weights):
        margins = held_out_margins(folder, data, rows, args.batch)
        report(f"{folder} on the {len(rows)} held-out pairs of {args.config}", rows, margins)
        total = [t + weight * m for t, m in zip(total, margins)]
    if len(args.rm) > 1:
        report(f"their sum with weights {weights}", rows, total)


def held_out_margins(folder: str, data: RewardDataModule, rows: list, batch: int) -> list[float]:
    """Chosen minus rejected score of each held-out pair, one full pass per conversation."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    margins = []
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            chosen, rejected = (
                model(**data.encode_pairs(tokenizer, rows[start : start + batch])).logits[:, 0].float().chunk(2)
            )
            margins += (chosen - rejected).tolist()
    return margins


def report(title: str, rows: list, margins: list[float]) -> None:
    """Print the accuracy and mean margin by kind of slip, then over all pairs."""
    by_kind = defaultdict(list)
    for row, margin in zip(rows, margins):
        by_kind[slip(row)].append(margin)
    print(title)
    print("| slip | pairs | pairwise accuracy | mean margin |\n|---|---|---|---|")
    for kind, values in [*sorted(by_kind.items()), ("all", margins)]:
        print(
            f"| {kind} | {len(values)} | {sum(m > 0 for m in values) / len(values):.3f} "
            f"| {sum(values) / len(values):.2f} |"
        )


if __name__ == "__main__":
    main()
