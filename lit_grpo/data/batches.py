"""Training batches of a fixed dataset that a run killed inside an epoch resumes exactly.

Lightning restores the optimizer and the step counters from a mid-epoch
checkpoint but restarts a plain DataLoader at the epoch's first batch, so the
resumed run trains on batches the killed one had already seen. Here every
epoch's order follows from ``(seed, epoch)`` (a ``DistributedSampler``, which
also shards the rows over ranks), the module reports each batch it starts
(:meth:`ResumableBatches.begin_batch`), the DataModule's state holds how far
the epoch got, and a resumed epoch skips what was trained. The global RNG
(adapter dropout) is re-seeded per batch from ``(seed, epoch, rank, batch)``,
so the resumed batches also draw the same random numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler


def staged_order(sizes: list[int], generator: torch.Generator) -> list[int]:
    """Indices of consecutive blocks of ``sizes`` rows: the blocks in order, each one shuffled."""
    order, start = [], 0
    for size in sizes:
        order += (start + torch.randperm(size, generator=generator)).tolist()
        start += size
    return order


class EpochSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled per epoch from ``seed + epoch``) that can start an epoch part-way.

    Args:
        rows: The dataset.
        batch_size: Rows per batch on this rank (skipping is by whole batches).
        world: How many ranks share the rows.
        rank: Which one this is.
        seed: Seed of the order.
        start_batch: ``epoch -> batches to skip``, asked when an epoch starts.
        stages: Rows per stage of a curriculum (consecutive blocks of ``rows``):
            the epoch goes through them in order, each shuffled (:func:`staged_order`),
            and the ranks share every stage; ``None`` shuffles all the rows together.
    """

    def __init__(self, rows, batch_size: int, world: int, rank: int, seed: int,
                 start_batch: Callable[[int], int], stages: list[int] | None = None) -> None:
        super().__init__(rows, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        self.batch_size = batch_size
        self.start_batch = start_batch  # epoch -> batches of it already trained
        self.stages = stages

    def __iter__(self) -> Iterator[int]:
        start = self.start_batch(self.epoch)
        return iter(self._indices()[start * self.batch_size :])

    def _indices(self) -> list[int]:
        if self.stages is None:
            return list(super().__iter__())
        order = staged_order(self.stages, torch.Generator().manual_seed(self.seed + self.epoch))
        order += order[: self.total_size - len(order)]  # as DistributedSampler pads: every rank the same count
        return order[self.rank : self.total_size : self.num_replicas]


class ResumableBatches:
    """Mixin for a LightningDataModule with ``hparams.seed``: its training DataLoader
    resumes inside an epoch (see the module docstring)."""

    sampler: EpochSampler | None = None
    trained_batches: int = 0  # batches of the current epoch started so far
    _resume: dict | None = None

    def resumable_loader(self, rows: list, batch_size: int, collate: Callable,
                         stages: list[int] | None = None) -> DataLoader:
        """A training DataLoader over ``rows`` whose order is fixed by the seed and the epoch
        (``stages``: a curriculum's blocks, see :class:`EpochSampler`)."""
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        self.sampler = EpochSampler(rows, batch_size, world, rank, self.hparams.seed, self._start_batch, stages)
        return DataLoader(rows, batch_size=batch_size, sampler=self.sampler, collate_fn=collate)

    def _start_batch(self, epoch: int) -> int:
        """Where ``epoch`` starts: after the batches a restored checkpoint had trained of it, else at 0."""
        resume, self._resume = self._resume, None
        self.trained_batches = resume["trained"] if resume is not None and resume["epoch"] == epoch else 0
        return self.trained_batches

    def begin_batch(self) -> None:
        """The module starts training the next batch: count it, and seed the RNG for it."""
        rank = self.trainer.global_rank if self.trainer else 0
        torch.manual_seed(hash((self.hparams.seed, self.sampler.epoch, rank, self.trained_batches)) % 2**31)
        self.trained_batches += 1

    def state_dict(self) -> dict:
        """How far the current epoch got (saved in every checkpoint)."""
        epoch = self.sampler.epoch if self.sampler is not None else 0
        return {"epoch": epoch, "trained": self.trained_batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = dict(state_dict)
