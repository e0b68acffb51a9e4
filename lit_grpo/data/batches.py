"""Training batches that a run killed inside an epoch resumes exactly, for every DataModule.

Lightning restores the optimizer and the step counters from a mid-epoch
checkpoint but restarts a plain DataLoader at the epoch's first batch, so the
resumed run would train on batches the killed one had already seen, with other
random numbers. Every DataModule here keeps a :class:`BatchCursor` instead:

- the module reports each batch it starts (``datamodule.begin_batch``), which
  re-seeds the global RNG (adapter dropout) from ``(seed, epoch, rank, batch)``
  and counts the batch;
- the DataModule's state holds the epoch and how many of its batches trained,
  and a resumed epoch starts after them.

Over a fixed dataset (SFT, DPO, the reward model) the epoch's order follows from
``(seed, epoch)`` (:class:`EpochSampler`, a ``DistributedSampler`` that also
shards the rows over ranks and may follow a
:class:`~lit_grpo.data.curriculum.Curriculum`). An on-policy epoch's batches
are the micro-batches of its rollout (:mod:`lit_grpo.data.grpo`), which a
mid-epoch checkpoint carries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lit_grpo.data.curriculum import Curriculum


class BatchCursor:
    """The epoch being trained, how many of its batches started, and every seed drawn from them.

    Args:
        seed: The DataModule's ``seed``.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch = 0
        self.trained = 0  # batches of the epoch started so far

    def seed_of(self, *parts: int) -> int:
        """The seed of ``(seed, *parts)``: every random draw of a DataModule comes from one of these."""
        return hash((self.seed, *parts)) % 2**31

    def begin(self, rank: int, index: int | None = None) -> None:
        """Batch ``index`` (default: the next) of the epoch starts on ``rank``: seed the global RNG for it
        and count it."""
        index = self.trained if index is None else index
        torch.manual_seed(self.seed_of(self.epoch, rank, index))
        self.trained = index + 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "trained": self.trained}


class EpochSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled per epoch from ``seed + epoch``) that can start an epoch part-way.

    Args:
        rows: The dataset.
        batch_size: Rows per batch on this rank (skipping is by whole batches).
        world: How many ranks share the rows.
        rank: Which one this is.
        seed: Seed of the order.
        start_batch: ``epoch -> batches to skip``, asked when an epoch starts.
        curriculum: Train the rows as its stages, in order; ``None`` shuffles all the rows together.
    """

    def __init__(
        self,
        rows,
        batch_size: int,
        world: int,
        rank: int,
        seed: int,
        start_batch: Callable[[int], int],
        curriculum: Curriculum | None = None,
    ) -> None:
        super().__init__(rows, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        self.batch_size = batch_size
        self.start_batch = start_batch
        self.curriculum = curriculum
        if curriculum is not None:  # the reserve rows are not an epoch's: it trains the budgets
            self.num_samples = math.ceil(curriculum.budget / world)
            self.total_size = self.num_samples * world

    def __iter__(self) -> Iterator[int]:
        start = self.start_batch(self.epoch)
        if self.curriculum is None:
            return iter(list(super().__iter__())[start * self.batch_size :])
        return self._staged(start)

    def _staged(self, start: int) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        batches = self.curriculum.batches(generator, self.batch_size * self.num_replicas, self.total_size)
        for batch, rows in enumerate(batches):
            if batch >= start:
                yield from rows[self.rank :: self.num_replicas]


class ResumableBatches:
    """Mixin for a LightningDataModule over a fixed dataset with ``hparams.seed``: its training
    DataLoader resumes inside an epoch (see the module docstring)."""

    sampler: EpochSampler | None = None
    curriculum: Curriculum | None = None
    _cursor: BatchCursor | None = None
    _resume: dict | None = None

    @property
    def cursor(self) -> BatchCursor:
        if self._cursor is None:
            self._cursor = BatchCursor(self.hparams.seed)
        return self._cursor

    def resumable_loader(self, rows: list, batch_size: int, collate: Callable) -> DataLoader:
        """A training DataLoader over ``rows`` whose order is fixed by the seed and the epoch (and by
        ``self.curriculum``'s stages, if set)."""
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        self.sampler = EpochSampler(
            rows, batch_size, world, rank, self.hparams.seed, self._start_batch, self.curriculum
        )
        return DataLoader(rows, batch_size=batch_size, sampler=self.sampler, collate_fn=collate)

    def _start_batch(self, epoch: int) -> int:
        """Where ``epoch`` starts: after the batches a restored checkpoint had trained of it, else at 0."""
        resume, self._resume = self._resume, None
        same = resume is not None and resume["epoch"] == epoch
        self.cursor.epoch, self.cursor.trained = epoch, resume["trained"] if same else 0
        if self.curriculum is not None:
            self.curriculum.restart(resume if same else None)
        return self.cursor.trained

    def begin_batch(self, index: int | None = None) -> None:
        """The module starts training batch ``index`` (default: the next): count it, and seed the RNG for it."""
        self.cursor.begin(self.trainer.global_rank if self.trainer else 0, index)

    def batch_stage(self) -> int | None:
        """The curriculum stage of the batch being trained (that of its last row); ``None`` without one."""
        if self.curriculum is None:
            return None
        return self.curriculum.batch_stages[self.cursor.trained - 1]

    def end_batch(self, accuracy: float, pairs: float) -> None:
        """The module scored the batch it is training: ``accuracy`` of its ``pairs`` (over all ranks,
        before the step), which may end a curriculum stage (:meth:`Curriculum.score`)."""
        if self.curriculum is not None:
            self.curriculum.score(self.cursor.trained - 1, accuracy, pairs, self.cursor.epoch)

    def state_dict(self) -> dict:
        """How far the current epoch got, and where its curriculum stages ended (saved in every checkpoint)."""
        return {**self.cursor.state_dict(), **(self.curriculum.state_dict() if self.curriculum else {})}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = dict(state_dict)
