"""The rollout buffer: one epoch's scored completions, served as micro-batches.

It is an ``IterableDataset`` that yields ready micro-batches. That keeps
Lightning from injecting a ``DistributedSampler``: under DDP/FSDP each rank
already holds only its own prompts' groups, and sharding them again would
drop data.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.utils.data import IterableDataset

# Lightning warns at every epoch that an IterableDataset with __len__ may be miscounted by several
# loader workers; these micro-batches are built in the main process (num_workers 0), where the
# length is exact, so the warning says nothing about this loader.
warnings.filterwarnings(
    "ignore", message=r"Your `IterableDataset` has `__len__` defined", module="lightning.pytorch.utilities.data"
)

# Tensors with one row per completion; sliced per micro-batch.
ROW_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "completion_attention",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "values",
    "returns",
    "rewards",
)
# Of those, the ones with one column per completion token (trimmed with the completions).
# ``advantages`` is one of them when the estimator is token-level ([N, C], e.g. GAE).
TOKEN_KEYS = (
    "completion_ids",
    "completion_mask",
    "completion_attention",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "sampler_logprobs",
    "values",
    "returns",
)


class RolloutBuffer(IterableDataset):
    """Micro-batches over a rollout, ``num_iterations`` passes, shuffled per pass.

    Each micro-batch holds its rows' tensors, ``num_items`` (the step's
    completion tokens over all ranks), ``micro_batch`` (its place in the
    epoch), ``micro_batches`` (how many the epoch has), ``policy_version``
    (what sampled it) and ``every_batch``'s entries; the first one served
    also carries the rollout's ``rollout_stats``, ``rollout_samples`` and
    ``rollout_counts``, to be logged once.

    Args:
        rollout: Its rows are tensors keyed by :data:`ROW_KEYS` (``completion_attention``,
            ``old_logprobs``, ``ref_logprobs``, ``values`` and ``returns``
            may be absent), all with N rows; ``advantages`` is ``[N]`` or ``[N, C]``.
        batch_size: Rows per micro-batch; must divide N.
        num_iterations: Passes over the buffer (mu).
        accumulate: Micro-batches per optimizer step; ``num_items`` counts the
            completion tokens of each such group.
        generator: Shuffles the order of rows in each pass.
        token_counts: Callable reducing a ``[steps]`` tensor of token counts
            across ranks (sum); identity on one process.
        every_batch: Entries every micro-batch carries (the sampling
            ``temperature`` the objective divides by, ...).
        start: Micro-batches already trained on (a run resumed inside the
            epoch); iteration begins after them.
    """

    def __init__(
        self,
        rollout,
        batch_size: int,
        num_iterations: int,
        accumulate: int,
        generator: torch.Generator,
        token_counts,
        every_batch: dict,
        start: int = 0,
    ) -> None:
        self.rollout, self.rows, self.start = rollout, rollout.rows, start
        n = self.rows["advantages"].shape[0]
        order = [torch.randperm(n, generator=generator) for _ in range(num_iterations)]
        self.batches = [pass_order[i : i + batch_size] for pass_order in order for i in range(0, n, batch_size)]
        self.every_batch = every_batch
        self.num_items = self._num_items(accumulate, token_counts)

    def _num_items(self, accumulate: int, token_counts) -> list[Tensor]:
        mask = self.rows["completion_mask"]
        per_batch = torch.stack([mask[idx].sum() for idx in self.batches]).float()  # [batches]
        steps = [per_batch[i : i + accumulate].sum() for i in range(0, len(per_batch), accumulate)]
        totals = token_counts(torch.stack(steps))  # [steps], summed over ranks
        return [totals[i // accumulate] for i in range(len(per_batch))]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for i, idx in enumerate(self.batches[self.start :], start=self.start):
            batch = _trim({key: value[idx] for key, value in self.rows.items()})
            batch.update(self.every_batch)
            batch["num_items"] = self.num_items[i]
            batch["micro_batch"] = i  # its place in the epoch, whatever a resumed run's loop counts
            batch["micro_batches"] = len(self.batches)
            batch["policy_version"] = self.rollout.version
            if i == self.start:  # logged once per rollout, also when a resumed run restored it
                batch.update(
                    rollout_stats=self.rollout.stats,
                    rollout_samples=self.rollout.samples,
                    rollout_counts=self.rollout.counts,
                )
            yield batch


class OnDemand(IterableDataset):
    """Builds its :class:`RolloutBuffer` on first iteration; its length is known up front.

    Args:
        build: Runs the rollout and returns the buffer, or ``None`` when this
            epoch has nothing left to train on.
        length: Micro-batches the buffer will hold (for progress bars and
            Lightning's epoch bookkeeping).
    """

    def __init__(self, build, length: int) -> None:
        self.build, self.length = build, length
        self.buffer: RolloutBuffer | None = None

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        # A generator: the rollout runs at the first next(), after Lightning's
        # CombinedLoader has its iterator. Run inside iter() itself, an error in
        # the rollout (a reward, a tool, an environment) left the loader without
        # one, and Lightning's teardown then raised "Please call
        # `iter(combined_loader)` first." over the real error.
        if self.buffer is None:
            self.buffer = self.build()
        yield from self.buffer if self.buffer is not None else ()


def _trim(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop columns that are padding in every row of a micro-batch.

    Rows are padded to the longest prompt/completion of the whole rollout; a
    micro-batch only needs to be as wide as its own longest, which saves
    forward/backward work in proportion. An episode's completion is as wide
    as its attention mask (tool tokens included), not its model tokens.
    """
    real_prompt = batch["prompt_mask"].any(0).nonzero()
    start = int(real_prompt.min()) if len(real_prompt) else 0
    batch["prompt_ids"] = batch["prompt_ids"][:, start:]
    batch["prompt_mask"] = batch["prompt_mask"][:, start:]
    real_completion = batch.get("completion_attention", batch["completion_mask"]).any(0).nonzero()
    width = int(real_completion.max()) + 1 if len(real_completion) else 1
    for key in TOKEN_KEYS:
        if key in batch and batch[key].dim() == 2:
            batch[key] = batch[key][:, :width]
    return batch
