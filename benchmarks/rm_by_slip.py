"""An exported reward model's pairwise accuracy on a config's held-out pairs, by kind of slip.

    python benchmarks/rm_by_slip.py --rm runs/rm_quickstart/rm [--config configs/rm_quickstart.yaml]

Loads ``--rm`` as transformers loads it (``AutoModelForSequenceClassification``, one full
pass per conversation, rendered through its own chat template as training rendered it:
``RewardDataModule.encode_pairs``), builds the config's ``data`` section as the command
does, and scores the held-out pairs: how often the chosen reply scores higher, over all and by the kind
of slip of the rejected reply (:func:`lit_grpo.data.tasks.slip_kind`: +-1, +-10, the last two
digits swapped), with the mean margin.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import yaml
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from lit_grpo.data.reward_pairs import RewardDataModule
from rm_learning_curve import slip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rm", default="runs/rm_quickstart/rm", help="an exported sequence-classification folder")
    parser.add_argument("--config", default="configs/rm_quickstart.yaml", help="whose data section to hold out")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    with open(args.config) as f:
        data = RewardDataModule(**yaml.safe_load(f)["data"])
    data.setup("fit")
    rows = data.val_rows
    tokenizer = AutoTokenizer.from_pretrained(args.rm)
    model = AutoModelForSequenceClassification.from_pretrained(args.rm).eval()
    margins = []
    with torch.no_grad():
        for start in range(0, len(rows), args.batch):
            chosen, rejected = model(**data.encode_pairs(tokenizer, rows[start:start + args.batch])
                                     ).logits[:, 0].float().chunk(2)
            margins += (chosen - rejected).tolist()
    by_kind = defaultdict(list)
    for row, margin in zip(rows, margins):
        by_kind[slip(row)].append(margin)
    print(f"{args.rm} on the {len(rows)} held-out pairs of {args.config}")
    print("| slip | pairs | pairwise accuracy | mean margin |\n|---|---|---|---|")
    for kind, values in [*sorted(by_kind.items()), ("all", margins)]:
        print(f"| {kind} | {len(values)} | {sum(m > 0 for m in values) / len(values):.3f} "
              f"| {sum(values) / len(values):.2f} |")


if __name__ == "__main__":
    main()
