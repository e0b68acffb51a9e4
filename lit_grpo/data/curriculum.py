"""A curriculum: a DataModule's training rows as consecutive stages, trained in order.

Each :class:`Stage` is a block of the rows with a budget (the rows it trains
in an epoch). An epoch goes through the stages in order, each shuffled, and
the ranks share every stage. A stage with ``until`` ends early once its last
``until.pairs`` training pairs score at least ``until.accuracy``; the next
stage trains the rest of its budget. Where stages ended is part of the
DataModule's state, so a run resumed inside an epoch ends them where the
killed one did. The order within an epoch is drawn by the resumable sampler
(:class:`~lit_grpo.data.batches.EpochSampler`); this module only decides which
stage each batch's rows come from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_info


@dataclass(frozen=True)
class Stage:
    """One stage of a curriculum: a consecutive block of a DataModule's training rows.

    Args:
        rows: Rows of the block (its share, and a reserve where an earlier stage may end early).
        budget: Rows it trains when no stage ends early.
        until: ``{accuracy, pairs}``: end the stage once its last ``pairs`` training pairs score
            at least ``accuracy`` (:meth:`Curriculum.score`); the next stage trains the rest
            of its budget.
    """

    rows: int
    budget: int
    until: dict | None = None


class Curriculum:
    """Which stage each batch of an epoch takes its rows from, and where stages ended.

    Args:
        stages: The :class:`Stage` blocks, in the order of the rows.
    """

    def __init__(self, stages: list[Stage]) -> None:
        self.stages = stages
        self.ends: dict[int, int] = {}  # stage -> the batch of this epoch the next stage took over at
        self.window: list[tuple[float, float]] = []  # (accuracy, pairs) of the current stage's last batches
        self.built = 0  # batches of this epoch built so far
        self.batch_stages: list[int] = []  # the stage of each batch built (that of its last row)

    @property
    def budget(self) -> int:
        """Rows an epoch trains (the reserves are not an epoch's)."""
        return sum(stage.budget for stage in self.stages)

    def restart(self, saved: dict | None = None) -> None:
        """A new epoch starts; ``saved``: where a checkpoint saved inside this epoch had ended stages."""
        saved = saved or {}
        self.ends.clear()
        self.ends.update({int(k): v for k, v in saved.get("stage_ends", {}).items()})
        self.window[:] = [tuple(w) for w in saved.get("stage_window", [])]

    def batches(self, generator: torch.Generator, per_batch: int, total: int) -> Iterator[list[int]]:
        """Row indices of each batch of the epoch (all ranks' rows), ``total`` rows in all.

        Batches are built when asked for, so a stage's end takes effect from the next batch built.
        """
        blocks, first = [], 0
        for stage in self.stages:
            blocks.append((first + torch.randperm(stage.rows, generator=generator)).tolist())
            first += stage.rows
        budgets = [stage.budget for stage in self.stages]
        stage = used = 0
        self.built, self.batch_stages = 0, []
        for batch in range(math.ceil(total / per_batch)):
            self.built = batch + 1
            if self.ends.get(stage, batch + 1) <= batch:  # ended: the next stage trains the rest
                budgets[stage + 1] += budgets[stage] - used
                stage, used = stage + 1, 0
            rows = []
            while len(rows) < min(per_batch, total - batch * per_batch):
                if used == budgets[stage] and stage + 1 < len(budgets):
                    stage, used = stage + 1, 0
                    continue
                block = blocks[stage] if used < len(blocks[stage]) else blocks[0]  # past the end: padding
                rows.append(block[used % len(block)])
                used += 1
            self.batch_stages.append(stage)
            yield rows

    def score(self, batch: int, accuracy: float, pairs: float, epoch: int) -> None:
        """Batch ``batch`` (0-based) of ``epoch`` scored ``accuracy`` on ``pairs`` (over all ranks, before
        its step): end its stage if that has ``until`` and its last ``until.pairs`` pairs reached
        ``until.accuracy`` (the same decision on every rank)."""
        index = self.batch_stages[batch]
        until = self.stages[index].until
        if until is None or index in self.ends:
            self.window.clear()
            return
        self.window.append((accuracy, pairs))
        while sum(n for _, n in self.window[1:]) >= until["pairs"]:
            self.window.pop(0)  # the last `pairs` pairs (or just more)
        total = sum(n for _, n in self.window)
        if total >= until["pairs"] and sum(a * n for a, n in self.window) / total >= until["accuracy"]:
            self.ends[index] = self.built
            self.window.clear()
            rank_zero_info(
                f"data.curriculum[{index}] ends after {batch + 1} batches of epoch {epoch}: its last "
                f"{int(total)} pairs scored {until['accuracy']:g} or more; the next stage from batch "
                f"{self.built + 1}."
            )

    def state_dict(self) -> dict:
        return {"stage_ends": dict(self.ends), "stage_window": list(self.window)}
