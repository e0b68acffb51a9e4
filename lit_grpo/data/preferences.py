"""PreferenceDataModule: prompt / chosen / rejected pairs, tokenized for DPO.

Rows come from the same sources as GRPO prompts (:func:`lit_grpo.data.sources.load_rows`:
a built-in task such as ``arithmetic_preferences``, a local file, or a hub
dataset) through a column map. Prompts get the tokenizer's chat template,
exactly as GRPO's do; ``chosen`` and ``rejected`` are the assistant's reply
and end with EOS, so the policy also learns where its answer stops.

A batch of B pairs is served as 2B rows, chosen first, so that one forward
pass scores both sides and the rows fit :func:`lit_grpo.model.logprob_passes.completion_logprobs`
as they are: ``prompt_ids``/``prompt_mask`` ``[2B, P]`` (left-padded, each
prompt twice) and ``completion_ids``/``completion_mask`` ``[2B, C]``
(right-padded). Training batches resume exactly inside an epoch
(:mod:`lit_grpo.data.batches`), for DPO as for the reward model.
"""

from __future__ import annotations

import warnings
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_grpo.data.batches import ResumableBatches
from lit_grpo.data.curriculum import Curriculum, Stage, curriculum_rows
from lit_grpo.data.prompts import chat_prompts
from lit_grpo.data.sources import load_rows, rename_columns, split_rows
from lit_grpo.generation.rollout import encode_prompts

_PAIR_COLUMNS = ("prompt", "chosen", "rejected")


class PreferenceDataModule(ResumableBatches, L.LightningDataModule):
    """Preference pairs in, tokenized chosen/rejected batches out.

    Args:
        source: A built-in task (``arithmetic_preferences``), a local
            ``.json/.jsonl/.parquet/.csv`` file, or a hub dataset (``name`` or
            ``name:config``) with prompt, chosen and rejected columns.
        split: Training split of a file or hub source.
        val_split: Held-out split; ``None`` holds out the first ``val_size``
            rows of the training split instead.
        val_size: Validation pairs.
        task_args: Options of a built-in task (e.g. ``{"digits": 2, "ops": "+"}``).
        train_size: Pairs a built-in task generates for training.
        columns: Our column name -> the dataset's, e.g.
            ``{"prompt": "question", "chosen": "good", "rejected": "bad"}``.
            ``chosen``/``rejected`` values may be strings or chat message
            lists (the last message's content is the reply).
        system_prompt: Optional system message of the chat template.
        prompt_template: Format string wrapping each prompt (``{prompt}``).
        max_prompt_length: Longest prompt in tokens (``None``: no limit).
        max_completion_length: Longest chosen/rejected reply in tokens, EOS
            included (``None``: no limit).
        prompt_overflow: ``error`` refuses longer prompts; ``truncate`` keeps
            their last tokens (the question's end and the assistant header) and warns.
        completion_overflow: ``error`` refuses longer replies; ``truncate``
            keeps their first tokens (dropping the EOS) and warns.
        batch_size: Preference pairs per micro-batch (2x rows per forward pass).
        val_batch_size: Pairs per validation batch.
        seed: Seed of a built-in task's generator and of the shuffling.
        curriculum: Training stages of a built-in task, trained in order:
            ``[{share: 0.35, task_args: {slips: [off_by_1]}}, {}]``. Each stage
            generates its ``share`` of ``train_size`` in new pairs with
            ``task_args`` updated by its own (the last has no ``share``: it
            takes the rest; past the task's questions a stage goes round them
            again with new near misses, never the held-out ones); each epoch
            shuffles the pairs within a stage, never across stages. A stage with
            ``until: {accuracy: 0.95, pairs: 160}`` ends once its last 160
            training pairs score 0.95 (each scored before its step: the reward
            model's ``train/accuracy``, DPO's ``train/rewards/accuracy``), and
            the next stage trains the rest of its share. The held-out pairs stay
            ``task_args``'.
    """

    def __init__(
        self,
        source: str = "arithmetic_preferences",
        split: str = "train",
        val_split: str | None = None,
        val_size: int = 64,
        task_args: dict | None = None,
        train_size: int = 512,
        columns: dict[str, str] | None = None,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        max_prompt_length: int | None = 256,
        max_completion_length: int | None = 256,
        prompt_overflow: Literal["error", "truncate"] = "error",
        completion_overflow: Literal["error", "truncate"] = "error",
        batch_size: int = 8,
        val_batch_size: int = 16,
        seed: int = 0,
        curriculum: list[dict] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        for name, value in (
            ("batch_size", batch_size),
            ("val_batch_size", val_batch_size),
            ("train_size", train_size),
            ("val_size", val_size),
        ):
            if value < 1:
                raise ValueError(f"data.{name}={value}; expected >= 1.")
        if "{prompt}" not in prompt_template:
            raise ValueError(f"data.prompt_template={prompt_template!r} must contain '{{prompt}}'.")
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []
        self.curriculum: Curriculum | None = None  # stages: consecutive blocks of train_rows, trained in order

    # ----------------------------------------------------------------- set-up
    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        hp = self.hparams
        if not hp.curriculum:
            self.train_rows, self.val_rows = split_rows(
                self._load, hp.source, hp.split, hp.val_split, hp.train_size, hp.val_size
            )
            return
        # The stages generate the training pairs (train_size may exceed the task's questions: they
        # come round again); the held-out pairs are those a run without a curriculum holds out.
        self.val_rows = split_rows(self._load, hp.source, hp.split, hp.val_split, 1, hp.val_size)[1]
        blocks, budgets = curriculum_rows(hp.source, hp.curriculum, hp.task_args, hp.seed, hp.train_size, self.val_rows)
        blocks = [self._checked(rows, "train") for rows in blocks]
        self.train_rows = [row for rows in blocks for row in rows]
        self.curriculum = Curriculum(
            [
                Stage(len(rows), budget, stage.get("until"))
                for rows, budget, stage in zip(blocks, budgets, hp.curriculum)
            ]
        )

    def _load(self, split: str, size: int) -> list[dict]:
        hp = self.hparams
        return self._checked(load_rows(hp.source, split, hp.task_args, hp.seed, size), split)

    def _checked(self, raw: list[dict], split: str) -> list[dict]:
        """``raw`` rows under our column names, refused early if a pair is unusable."""
        hp = self.hparams
        rows = rename_columns(raw, hp.columns or {}, hp.source)
        missing = [name for name in _PAIR_COLUMNS if name not in rows[0]]
        if missing:
            raise ValueError(
                f"data.source={hp.source!r} has no {missing[0]!r} column, which preference pairs "
                f"need; map one with data.columns, e.g. {{{missing[0]!r}: 'your_column'}}. "
                f"Available columns: {sorted(rows[0])}."
            )
        for name in _PAIR_COLUMNS:
            column_text(rows[0][name], name)  # fail now, not mid-epoch, on an unusable value
        for i, row in enumerate(rows):
            if column_text(row["chosen"], "chosen").strip() == column_text(row["rejected"], "rejected").strip():
                raise ValueError(
                    f"data.source={hp.source!r} split {split!r} row {i}: chosen and rejected are the same reply "
                    f"({column_text(row['chosen'], 'chosen')!r:.60}), so the pair prefers nothing; drop the row "
                    "or fix one side."
                )
        return rows

    # ---------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        return self.resumable_loader(self.train_rows, self.hparams.batch_size, self.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_rows, batch_size=self.hparams.val_batch_size, collate_fn=self.collate)

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Tokenize B pairs into 2B rows, chosen first (see the module docstring)."""
        hp = self.hparams
        tokenizer = self.trainer.lightning_module.tokenizer
        prompts = chat_prompts(
            tokenizer, [column_text(r["prompt"], "prompt") for r in rows], hp.system_prompt, hp.prompt_template
        )
        prompt_ids, prompt_mask = encode_prompts(
            tokenizer,
            prompts,
            hp.max_prompt_length,
            hp.prompt_overflow,
            ("data.max_prompt_length", "data.prompt_overflow"),
        )
        replies = [column_text(r["chosen"], "chosen") for r in rows] + [
            column_text(r["rejected"], "rejected") for r in rows
        ]
        completion_ids, completion_mask = encode_completions(
            tokenizer, replies, hp.max_completion_length, hp.completion_overflow
        )
        return {
            "prompt_ids": torch.cat([prompt_ids, prompt_ids]),  # [2B, P]
            "prompt_mask": torch.cat([prompt_mask, prompt_mask]),  # [2B, P]
            "completion_ids": completion_ids,  # [2B, C]
            "completion_mask": completion_mask,  # [2B, C]
        }


def column_text(value, column: str) -> str:
    """A column's text: a string, or the content of a chat message list's last message."""
    if isinstance(value, str):
        return value
    if column != "prompt" and isinstance(value, list) and value and isinstance(value[-1], dict):
        return value[-1]["content"]
    expected = "a string" if column == "prompt" else "a string or a list of chat messages"
    raise ValueError(f"data column {column!r} holds {type(value).__name__} {value!r:.80}; expected {expected}.")


def encode_completions(
    tokenizer, texts: list[str], max_length: int | None, overflow: str = "error"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize replies, append EOS, right-pad.

    Args:
        tokenizer: A Hugging Face tokenizer.
        texts: The replies, without any chat markup.
        max_length: Longest reply in tokens, EOS included (``None``: no limit).
        overflow: ``"error"`` refuses longer replies; ``"truncate"`` keeps their
            first ``max_length`` tokens and warns.

    Returns:
        ``(completion_ids [N, C], completion_mask [N, C])``.
    """
    rows = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if max_length is not None:
        long = [i for i, r in enumerate(rows) if len(r) > max_length]
        if long and overflow == "error":
            i = long[0]
            raise ValueError(
                f"reply {texts[i][:80]!r}... has {len(rows[i])} tokens (EOS included) > "
                f"data.max_completion_length={max_length}; raise the limit or set "
                "data.completion_overflow='truncate'."
            )
        if long:
            warnings.warn(
                f"{len(long)} reply(ies) longer than max_completion_length={max_length} "
                "tokens were truncated from the right.",
                stacklevel=2,
            )
            rows = [r[:max_length] for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])  # [N, C]
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # [N, C]
    return ids, mask
