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

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler


@dataclass(frozen=True)
class Stage:
    """One stage of a curriculum: a consecutive block of a DataModule's training rows.

    Args:
        rows: Rows of the block (its share, and a reserve where an earlier stage may end early).
        budget: Rows it trains when no stage ends early.
        until: ``{accuracy, pairs}``: end the stage once its last ``pairs`` training pairs score
            at least ``accuracy`` (:meth:`ResumableBatches.end_batch`); the next stage trains
            the rest of its budget.
    """

    rows: int
    budget: int
    until: dict | None = None


class EpochSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled per epoch from ``seed + epoch``) that can start an epoch part-way.

    Args:
        rows: The dataset.
        batch_size: Rows per batch on this rank (skipping is by whole batches).
        world: How many ranks share the rows.
        rank: Which one this is.
        seed: Seed of the order.
        start_batch: ``epoch -> batches to skip``, asked when an epoch starts.
        stages: A curriculum's :class:`Stage` blocks (consecutive blocks of ``rows``): the epoch
            goes through them in order, each shuffled, and the ranks share every stage; ``None``
            shuffles all the rows together.
        ends: ``stage -> batch``: where a stage with ``until`` ended this epoch (filled by
            :meth:`ResumableBatches.end_batch` while the epoch runs, and by a resumed checkpoint);
            batches from that one on take the next stage's rows. Batches are built when the
            DataLoader asks for them, so an end takes effect from the next batch it builds.
    """

    def __init__(self, rows, batch_size: int, world: int, rank: int, seed: int,
                 start_batch: Callable[[int], int], stages: list[Stage] | None = None,
                 ends: dict[int, int] | None = None) -> None:
        super().__init__(rows, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        self.batch_size = batch_size
        self.start_batch = start_batch  # epoch -> batches of it already trained
        self.stages = stages
        self.ends = ends if ends is not None else {}
        self.built = 0  # batches of this epoch built so far
        self.batch_stages: list[int] = []  # the stage of each batch built (that of its last row)
        if stages is not None:  # the reserve rows are not an epoch's: it trains the budgets
            self.num_samples = math.ceil(sum(stage.budget for stage in stages) / world)
            self.total_size = self.num_samples * world

    def __iter__(self) -> Iterator[int]:
        start = self.start_batch(self.epoch)
        if self.stages is None:
            return iter(list(super().__iter__())[start * self.batch_size :])
        return self._staged(start)

    def _staged(self, start: int) -> Iterator[int]:
        """This rank's rows, one batch at a time, skipping the first ``start`` batches."""
        generator, blocks, first = torch.Generator().manual_seed(self.seed + self.epoch), [], 0
        for stage in self.stages:
            blocks.append((first + torch.randperm(stage.rows, generator=generator)).tolist())
            first += stage.rows
        budgets = [stage.budget for stage in self.stages]
        stage = used = 0
        per_batch = self.batch_size * self.num_replicas  # rows all ranks take per batch
        self.built, self.batch_stages = 0, []
        for batch in range(math.ceil(self.total_size / per_batch)):
            self.built = batch + 1
            if self.ends.get(stage, batch + 1) <= batch:  # ended: the next stage trains the rest
                budgets[stage + 1] += budgets[stage] - used
                stage, used = stage + 1, 0
            rows = []
            while len(rows) < min(per_batch, self.total_size - batch * per_batch):
                if used == budgets[stage] and stage + 1 < len(budgets):
                    stage, used = stage + 1, 0
                    continue
                block = blocks[stage] if used < len(blocks[stage]) else blocks[0]  # past the end: padding
                rows.append(block[used % len(block)])
                used += 1
            self.batch_stages.append(stage)
            if batch >= start:
                yield from rows[self.rank :: self.num_replicas]
class ResumableBatches:
    """Mixin for a LightningDataModule with ``hparams.seed``: its training DataLoader
    resumes inside an epoch (see the module docstring)."""

    sampler: EpochSampler | None = None
    trained_batches: int = 0  # batches of the current epoch started so far
    _resume: dict | None = None

    def resumable_loader(self, rows: list, batch_size: int, collate: Callable,
                         stages: list[Stage] | None = None) -> DataLoader:
        """A training DataLoader over ``rows`` whose order is fixed by the seed and the epoch
        (``stages``: a curriculum's blocks, see :class:`EpochSampler`)."""
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        self.stage_ends: dict[int, int] = {}  # stage -> the batch of this epoch the next one took over at
        self.stage_window: list[tuple[float, float]] = []  # (accuracy, pairs) of the current stage's last batches
        self.sampler = EpochSampler(rows, batch_size, world, rank, self.hparams.seed, self._start_batch, stages,
                                    self.stage_ends)
        return DataLoader(rows, batch_size=batch_size, sampler=self.sampler, collate_fn=collate)

    def _start_batch(self, epoch: int) -> int:
        """Where ``epoch`` starts: after the batches a restored checkpoint had trained of it, else at 0."""
        resume, self._resume = self._resume, None
        same = resume is not None and resume["epoch"] == epoch
        self.trained_batches = resume["trained"] if same else 0
        self.stage_ends.clear()
        self.stage_ends.update({int(k): v for k, v in resume.get("stage_ends", {}).items()} if same else {})
        self.stage_window[:] = [tuple(w) for w in resume.get("stage_window", [])] if same else []
        return self.trained_batches

    def begin_batch(self) -> None:
        """The module starts training the next batch: count it, and seed the RNG for it."""
        rank = self.trainer.global_rank if self.trainer else 0
        torch.manual_seed(hash((self.hparams.seed, self.sampler.epoch, rank, self.trained_batches)) % 2**31)
        self.trained_batches += 1

    def batch_stage(self) -> int | None:
        """The curriculum stage of the batch being trained (that of its last row); ``None`` without one."""
        if self.sampler is None or self.sampler.stages is None:
            return None
        return self.sampler.batch_stages[self.trained_batches - 1]

    def end_batch(self, accuracy: float, pairs: float) -> None:
        """The module scored the batch it is training: ``accuracy`` of its ``pairs`` (over all ranks,
        scored before the step), which ends a curriculum stage with ``until`` once its last
        ``until.pairs`` pairs score ``until.accuracy`` (the same decision on every rank)."""
        index = self.batch_stage()
        if index is None:
            return
        until = self.sampler.stages[index].until
        if until is None or index in self.stage_ends:
            self.stage_window.clear()
            return
        self.stage_window.append((accuracy, pairs))
        while sum(n for _, n in self.stage_window[1:]) >= until["pairs"]:
            self.stage_window.pop(0)  # the last `pairs` pairs (or just more)
        total = sum(n for _, n in self.stage_window)
        if total >= until["pairs"] and sum(a * n for a, n in self.stage_window) / total >= until["accuracy"]:
            self.stage_ends[index] = self.sampler.built
            self.stage_window.clear()
            rank_zero_info(f"data.curriculum[{index}] ends after {self.trained_batches} batches of epoch {self.sampler.epoch}: "
                           f"its last {int(total)} pairs scored {until['accuracy']:g} or more; the next stage "
                           f"from batch {self.sampler.built + 1}.")

    def state_dict(self) -> dict:
        """How far the current epoch got, and where its curriculum stages ended (saved in every checkpoint)."""
        epoch = self.sampler.epoch if self.sampler is not None else 0
        return {"epoch": epoch, "trained": self.trained_batches, "stage_ends": dict(getattr(self, "stage_ends", {})),
                "stage_window": list(getattr(self, "stage_window", []))}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = dict(state_dict)
