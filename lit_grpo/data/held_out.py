"""The on-policy DataModule's held-out prompts (``data.held_out``): their sets, loaders, batches
and the reward that scores greedy answers to them."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from lit_grpo.data.prompts import columns_of


class HeldOutPrompts:
    """Mixin of :class:`~lit_grpo.data.grpo.OnPolicyDataModule` over its ``val_rows``, ``val_slices``,
    ``held_out`` and ``val_scorer``."""

    def val_sets(self) -> dict[str, list[dict]]:
        """The held-out prompts by the metric their greedy accuracy is logged as."""
        return {
            "val/accuracy": self.val_rows,
            **{f"val/{name}/accuracy": rows for name, rows in self.val_slices.items()},
        }

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        loaders = [
            DataLoader(rows, batch_size=self.held_out.batch_size, collate_fn=self.collate_val)
            for rows in self.val_sets().values()
        ]
        return loaders if len(loaders) > 1 else loaders[0]

    def collate_val(self, rows: list[dict]) -> dict:
        """Tokenize validation rows: ``{prompt_ids, prompt_mask, rows}`` (and ``episodes``, their
        :class:`~lit_grpo.generation.episodes.EpisodePlan`, and ``environments``, each episode's
        environment or ``None``, when tools are configured)."""
        if self.episodes is not None:
            prompt_ids, prompt_mask, spec, environments = self.episodes.start(self, rows, 1)
            return {
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "rows": rows,
                "episodes": spec,
                "environments": environments,
            }
        prompt_ids, prompt_mask = self.encode(rows)
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "rows": rows}

    def score_validation(
        self, rows: list[dict], completions: list[str], environments: list | None = None
    ) -> torch.Tensor:
        """Score greedy validation answers with ``data.held_out.reward``: ``[B]`` floats (0 where it does not apply).

        ``completions`` are the sampled texts; the completion prefix is put in front here.
        ``environments``: each episode's environment, for a reward that reads them.
        """
        columns = columns_of(rows)
        prompts = columns.pop("prompt")
        supplied = {"environments": list(environments or [None] * len(rows))}
        if self.trainer is not None:
            supplied["trainer_state"] = self.trainer_state()
        scores = self.val_scorer.score(prompts, self.full_completions(completions), columns, supplied)
        return scores.per_function[self.val_scorer.names[0]].nan_to_num(0.0)
