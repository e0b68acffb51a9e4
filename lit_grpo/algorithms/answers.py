"""Prompts answered greedily and scored: what every held-out figure of an on-policy run is made of.

:func:`answer_batch` is the one loop body: greedy answers (episodes too) to a
collated validation batch, scored by the DataModule's validation reward. The
validation step, :func:`greedy_accuracy` (a whole held-out set with every rank
sharing the work: the figures before and after training), ``lit-grpo eval``
and :func:`answer_rows` all call it. :class:`BeforeAfterAnswers` calls
:func:`answer_rows` at the start and the end of fit, when the Trainer has
loaded the policy and the prompts, to show the same prompts answered before
and after training side by side.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from lit_grpo.generation.rollout import Rollout


def answer_batch(module: L.LightningModule, datamodule: L.LightningDataModule, batch: dict) -> tuple[Rollout, Tensor]:
    """Greedy answers to a batch of ``datamodule.collate_val`` (greedy episodes where it has them) and
    their validation scores ``[B]``."""
    answers = module.engine.generate(
        batch["prompt_ids"], batch["prompt_mask"], datamodule.sampling, greedy=True, episodes=batch.get("episodes")
    )
    return answers, datamodule.score_validation(batch["rows"], answers.texts, batch.get("environments"))


def answer_rows(
    module: L.LightningModule, datamodule: L.LightningDataModule, rows: list[dict]
) -> tuple[list[str], list[float]]:
    """Greedy answers to ``rows`` (the completion prefix in front) and their validation scores,
    the policy in eval mode.

    The module must be attached to a Trainer (inside or after ``fit``/``validate``).
    """
    was_training = module.training
    module.eval()
    try:
        answers, scores = answer_batch(module, datamodule, datamodule.collate_val(rows))
    finally:
        module.train(was_training)
    return datamodule.full_completions(answers.texts), scores.tolist()


def greedy_accuracy(
    module: L.LightningModule, datamodule: L.LightningDataModule, rows: list[dict], progress=None
) -> float:
    """Mean validation score of greedy answers to ``rows``, all ranks sharing the work (``progress``: a
    tqdm bar advanced by the prompts answered on this rank, times the number of ranks).

    Every rank answers the same number of batches (the last ranks' shares are
    topped up with rows that weigh 0): under FSDP2 each batch gathers the
    shards, a collective.
    """
    rank, world = module.global_rank, module.trainer.world_size
    share = -(-len(rows) // world)
    mine = rows[rank::world]
    weights = [1.0] * len(mine) + [0.0] * (share - len(mine))
    mine += rows[: share - len(mine)]
    metric = MeanMetric().to(module.device)
    size = datamodule.held_out.batch_size
    for start in range(0, share, size):
        batch = datamodule.collate_val(mine[start : start + size])
        _, scores = answer_batch(module, datamodule, batch)
        metric.update(scores.to(module.device), torch.tensor(weights[start : start + size], device=module.device))
        if progress is not None:
            progress.update(len(batch["rows"]) * world)  # every rank answers as many (padding included)
    return float(metric.compute())


class BeforeAfterAnswers(L.Callback):
    """Answer the first validation prompts when fit starts and when it ends.

    On every rank (generation may need all ranks under FSDP); each rank keeps
    its own copy. "Before" is the start of this fit: a resumed run's is the
    checkpoint's policy.

    Args:
        count: How many validation prompts (the first ones) to answer.
    """

    def __init__(self, count: int = 4) -> None:
        if count < 1:
            raise ValueError(f"BeforeAfterAnswers count={count}; expected >= 1.")
        self.count = count
        self.rows: list[dict] = []
        self.before: tuple[list[str], list[float]] = ([], [])
        self.after: tuple[list[str], list[float]] = ([], [])

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(trainer.datamodule, "collate_val") or not hasattr(pl_module, "engine"):
            raise ValueError(
                f"BeforeAfterAnswers answers the held-out prompts of an on-policy run (GRPOModule or PPOModule "
                f"with OnPolicyDataModule), not {type(pl_module).__name__} with "
                f"{type(trainer.datamodule).__name__}; leave the callback out of this run."
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.rows = trainer.datamodule.val_rows[: self.count]
        self.before = answer_rows(pl_module, trainer.datamodule, self.rows)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after = answer_rows(pl_module, trainer.datamodule, self.rows)

    def table(self) -> list[dict]:
        """One dict per prompt: ``prompt``, ``before``, ``before_score``, ``after``, ``after_score``."""
        return [
            {
                "prompt": row["prompt"],
                "before": before,
                "before_score": before_score,
                "after": after,
                "after_score": after_score,
            }
            for row, before, before_score, after, after_score in zip(self.rows, *self.before, *self.after)
        ]

    def to_markdown(self) -> str:
        """The table as Markdown, with mean scores in the header."""
        table = self.table()
        if not table:
            return "*no answers recorded: fit has not run to its end*"
        mean = {key: sum(r[key] for r in table) / len(table) for key in ("before_score", "after_score")}
        lines = [
            f"| prompt | before (score {mean['before_score']:.2f}) | after (score {mean['after_score']:.2f}) |",
            "|---|---|---|",
        ]
        for r in table:
            lines.append(
                f"| {_cell(r['prompt'])} | {_cell(r['before'])} ({r['before_score']:g}) "
                f"| {_cell(r['after'])} ({r['after_score']:g}) |"
            )
        return "\n".join(lines)


def _cell(text: str) -> str:
    return text.strip().replace("|", "\\|").replace("\n", "<br>") or "(empty)"
