"""A curriculum: a DataModule's training rows as consecutive stages, trained in order.

Each :class:`Stage` is a block of the rows with a budget (the rows it trains
in an epoch). An epoch goes through the stages in order, each shuffled, and
the ranks share every stage. A stage with ``until`` ends early once its last
``until.pairs`` training pairs score at least ``until.accuracy``; the next
stage trains the rest of its budget. Where stages ended is part of the
DataModule's state, so a run resumed inside an epoch ends them where the
killed one did. The order within an epoch is drawn by the resumable sampler
(:class:`~lit_grpo.data.batches.EpochSampler`); this module decides which
stage each batch's rows come from, and :func:`curriculum_rows` generates the
stages' rows from a built-in task.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_grpo.data.tasks import TASKS, TooFewQuestions


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


def curriculum_rows(
    source: str, stages: list[dict], task_args: dict | list[dict] | None, seed: int, train_size: int, taken: list[dict]
) -> tuple[list[list[dict]], list[int]]:
    """The training rows of ``data.curriculum``, stage by stage (raw rows, dataset column names).

    Stage ``i`` is ``{"share": fraction, "task_args": {...}, "until": {...}}``: ``share`` of
    ``train_size`` rows (rounded; the last stage has no ``share``: it takes the rest) of the
    built-in task generated with ``task_args`` updated by the stage's, with seed ``seed + 1 + i``.
    Shares, not row counts, so a config keeps its shape when ``train_size`` is changed. A stage's
    questions are new (none is ``taken``'s or an earlier stage's) while the task has new ones;
    past them it goes round again, every question but ``taken``'s, each lap with new draws (new
    near misses) from seed ``seed + 1 + i + 1000 * lap``. A stage with ``until`` (see
    :func:`check_until`) may end before its share; the stage after it then trains the rest, so
    it gets that many rows more, in reserve.

    Returns:
        ``(rows per stage, rows each stage trains when no stage ends early)``.

    Raises:
        ValueError: ``source`` is not a built-in task, ``task_args`` is a mix,
            a stage is malformed or gets no row, or the task has no question
            left to train; the message names ``data.curriculum[i]``.
    """
    if source not in TASKS:
        raise ValueError(
            f"data.curriculum needs a built-in task {sorted(TASKS)} as data.source, not {source!r}: "
            "its stages are generated with their own task options."
        )
    if isinstance(task_args, list):
        raise ValueError(
            "data.curriculum with data.task_args as a mix (a list) is not supported; give "
            "data.task_args one set of options and each stage its own."
        )
    sizes = []
    for i, stage in enumerate(stages):
        last = i == len(stages) - 1
        share = stage.get("share") if isinstance(stage, dict) else None
        if (
            not isinstance(stage, dict)
            or set(stage) - {"share", "task_args", "until"}
            or not isinstance(stage.get("task_args", {}), dict)
            or (share is None) != last
            or (share is not None and not (type(share) in (int, float) and 0 < share < 1))
        ):
            raise ValueError(
                f"data.curriculum[{i}]={stage!r}; expected {{share: fraction of data.train_size, "
                "task_args: {...}, until: {...}}} with 0 < share < 1, and no share on the last stage "
                "(it takes the rest)."
            )
        if "until" in stage:
            check_until(stage["until"], i, last)
        sizes.append(round(share * train_size) if share is not None else train_size - sum(sizes))
        if sizes[-1] < 1 or sum(sizes) > train_size:
            raise ValueError(
                f"data.curriculum[{i}]={stage!r} gets {sizes[-1]} of data.train_size={train_size} "
                f"rows ({sum(sizes)} so far); every stage needs at least one and the shares at most 1 "
                "in all."
            )
    held_out = {row["prompt"] for row in taken}
    seen, rows = set(held_out), []
    for i, (stage, size) in enumerate(zip(stages, sizes)):
        options = {**(task_args or {}), **stage.get("task_args", {})}
        wanted = size + (sizes[i - 1] if i and "until" in stages[i - 1] else 0)  # + the reserve
        stage_rows = _new_rows(source, options, seed + 1 + i, wanted, seen, i)
        lap = 0
        while len(stage_rows) < wanted:  # no new question left: every one again, with new draws
            lap += 1
            again = _new_rows(source, options, seed + 1 + i + 1000 * lap, wanted, held_out, i)
            if not again:
                raise ValueError(
                    f"data.curriculum[{i}]: {source} with {options!r} has no question that is not "
                    f"held out (data.val_size={len(taken)})."
                )
            stage_rows += again[: wanted - len(stage_rows)]
        seen.update(row["prompt"] for row in stage_rows)
        rows.append(stage_rows)
    return rows, sizes


def _new_rows(source: str, options: dict, seed: int, size: int, seen: set[str], stage: int) -> list[dict]:
    """Up to ``size`` rows of a built-in task (seed ``seed``) whose prompts are not in ``seen``: fewer
    only when the task has fewer other questions."""
    try:  # `size` more than are seen: at least `size` of them are new
        raw = TASKS[source](n=size + len(seen), seed=seed, **options)
    except TooFewQuestions as error:
        raw = TASKS[source](n=error.capacity, seed=seed, **options)  # every question, in this seed's order
    except (TypeError, ValueError) as error:
        raise ValueError(f"data.curriculum[{stage}]: {source} with {options!r}: {error}") from None
    return [row for row in raw if row["prompt"] not in seen][:size]


def check_until(until: object, stage: int, last: bool) -> None:
    """Refuse a malformed ``data.curriculum[stage].until``.

    ``until`` is ``{accuracy: a, pairs: n}``: the stage ends once the pairwise accuracy of its
    last ``n`` training pairs (each scored before the step that trains on it) is at least ``a``.
    """
    expected = (
        "expected {accuracy: a, pairs: n} with 0 < a <= 1 and n >= 1 (end the stage once its last n "
        "training pairs score at least a), on a stage that has one after it"
    )
    if (
        last
        or not isinstance(until, dict)
        or set(until) != {"accuracy", "pairs"}
        or not (type(until["accuracy"]) in (int, float) and 0 < until["accuracy"] <= 1)
        or not (type(until["pairs"]) is int and until["pairs"] >= 1)
    ):
        raise ValueError(f"data.curriculum[{stage}].until={until!r}; {expected}.")
