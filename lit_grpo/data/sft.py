"""SFTDataModule: demonstrations, tokenized with the loss on the completion only.

Rows take TRL's dataset formats, after a column map:

* ``prompt`` + ``completion``: strings (the prompt gets the chat template, as
  GRPO's prompts do; the completion is the assistant's reply and ends with
  EOS), or chat message lists (the prompt's messages go through the chat
  template with the generation prompt; the completion's last message is the
  reply);
* ``messages``: a conversation; every assistant turn is trained on, as the
  chat template renders it (its end-of-turn markup included), and every other
  turn is context.

A batch is split where the first trained token starts, so that it fits
:func:`lit_grpo.model.logprob_passes.completion_logprobs` as it is:
``prompt_ids``/``prompt_mask`` ``[B, P]`` (left-padded) and
``completion_ids``/``completion_mask``/``loss_mask`` ``[B, C]`` (right-padded;
``loss_mask`` leaves out later user turns). Validation batches also carry
their ``rows``, whose ``answer`` column scores greedy answers.
"""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_grpo.data.batches import ResumableBatches
from lit_grpo.data.prompts import chat_prompts, columns_of
from lit_grpo.data.sources import load_rows, rename_columns, split_rows
from lit_grpo.rewards import Accuracy, Reward


class SFTDataModule(ResumableBatches, L.LightningDataModule):
    """Demonstrations in, tokenized batches with a completion-only loss mask out.

    Args:
        source: A built-in task (``arithmetic_sft``), a local
            ``.json/.jsonl/.parquet/.csv`` file, or a hub dataset (``name`` or
            ``name:config``) with ``prompt`` + ``completion`` or ``messages`` columns.
        split: Training split of a file or hub source.
        val_split: Held-out split; ``None`` holds out the first ``val_size``
            rows of the training split instead.
        val_size: Validation rows.
        task_args: Options of a built-in task (e.g. ``{"digits": 2, "ops": "+"}``).
        train_size: Rows a built-in task generates for training.
        columns: Our column name -> the dataset's, e.g. ``{"prompt": "question",
            "completion": "solution"}`` or ``{"messages": "conversation"}``.
        system_prompt: Optional system message for string prompts.
        prompt_template: Format string wrapping each string prompt (``{prompt}``).
        max_length: Longest row in tokens, prompt and completion (``None``: no limit).
        overflow: ``error`` refuses longer rows; ``truncate`` cuts their end and warns.
        batch_size: Rows per micro-batch.
        val_batch_size: Rows per validation batch.
        val_reward: Scores greedy answers to the validation prompts
            (``val/accuracy``); ``None`` uses ``Accuracy`` when the rows have
            an ``answer`` column, and skips greedy validation otherwise.
        val_max_new_tokens: Longest greedy validation answer, in tokens.
        seed: Seed of a built-in task's generator and of the shuffling.
    """

    def __init__(
        self,
        source: str = "arithmetic_sft",
        split: str = "train",
        val_split: str | None = None,
        val_size: int = 64,
        task_args: dict | list[dict] | None = None,
        train_size: int = 512,
        columns: dict[str, str] | None = None,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        max_length: int | None = 1024,
        overflow: Literal["error", "truncate"] = "error",
        batch_size: int = 8,
        val_batch_size: int = 32,
        val_reward: Reward | None = None,
        val_max_new_tokens: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["val_reward"])
        for name, value in (
            ("batch_size", batch_size),
            ("val_batch_size", val_batch_size),
            ("train_size", train_size),
            ("val_size", val_size),
            ("val_max_new_tokens", val_max_new_tokens),
        ):
            if value < 1:
                raise ValueError(f"data.{name}={value}; expected >= 1.")
        if "{prompt}" not in prompt_template:
            raise ValueError(f"data.prompt_template={prompt_template!r} must contain '{{prompt}}'.")
        self.val_reward = val_reward
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []

    # ----------------------------------------------------------------- set-up
    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        hp = self.hparams
        self.train_rows, self.val_rows = split_rows(
            self._load, hp.source, hp.split, hp.val_split, hp.train_size, hp.val_size
        )
        if self.val_reward is None and "answer" in self.val_rows[0]:
            self.val_reward = Accuracy()
        if self.trainer is not None:
            self.collate(self.train_rows[:1])  # a tokenizer without a chat template fails now, not at batch 1

    def _load(self, split: str, size: int) -> list[dict]:
        hp = self.hparams
        rows = rename_columns(
            load_rows(hp.source, split, hp.task_args, hp.seed, size), hp.columns or {}, hp.source, require_prompt=False
        )  # conversations have messages instead
        if "messages" not in rows[0] and not {"prompt", "completion"} <= set(rows[0]):
            raise ValueError(
                f"data.source={hp.source!r} has neither 'prompt' + 'completion' nor 'messages' columns, which "
                f"demonstrations need; map yours with data.columns, e.g. {{'completion': 'your_column'}}. "
                f"Available columns: {sorted(rows[0])}."
            )
        for i, row in enumerate(rows):  # every row now: an empty one would fail mid-epoch
            if not any(text.strip() for text, trained in self.segments(row, None) if trained):
                raise ValueError(
                    f"data.source={hp.source!r} split {split!r} row {i}: the completion (assistant "
                    "reply) is empty, so there is nothing to train on; fill or drop the row."
                )
        return rows

    def segments(self, row: dict, tokenizer) -> list[tuple[str, bool]]:
        """A row as ``(text, trained)`` pieces, chat template applied (raw pieces while ``tokenizer`` is None)."""
        hp = self.hparams
        if "messages" in row:
            return _conversation_segments(row["messages"], tokenizer)
        prompt, completion = row["prompt"], _reply(row["completion"])
        if tokenizer is None:
            return [(str(prompt), False), (completion, True)]
        if isinstance(prompt, list):
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        else:
            text = chat_prompts(tokenizer, [prompt], hp.system_prompt, hp.prompt_template)[0]
        return [(text, False), (completion, True), (tokenizer.eos_token, True)]

    # ---------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        return self.resumable_loader(self.train_rows, self.hparams.batch_size, self.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_rows,
            batch_size=self.hparams.val_batch_size,
            collate_fn=lambda rows: {**self.collate(rows), "rows": rows},
        )

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Tokenize rows, split each where its first trained token starts (see the module docstring)."""
        tokenizer = self.trainer.lightning_module.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template, which SFT rows need (prompts and assistant turns "
                "are rendered with it); use an instruct/chat model or set tokenizer.chat_template."
            )
        prompts, completions, trained = [], [], []
        for row in rows:
            ids, mask = [], []
            for text, is_trained in self.segments(row, tokenizer):
                piece = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [int(is_trained)] * len(piece)
            ids, mask = self._fit(ids, mask)
            first = mask.index(1)
            prompts.append(ids[:first])
            completions.append(ids[first:])
            trained.append(mask[first:])
        pad = tokenizer.pad_token_id
        P, C = max(map(len, prompts)), max(map(len, completions))
        return {
            "prompt_ids": torch.tensor([[pad] * (P - len(p)) + p for p in prompts]),  # [B, P]
            "prompt_mask": torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts]),  # [B, P]
            "completion_ids": torch.tensor([c + [pad] * (C - len(c)) for c in completions]),  # [B, C]
            "completion_mask": torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in completions]),  # [B, C]
            "loss_mask": torch.tensor([m + [0] * (C - len(m)) for m in trained]),  # [B, C]
        }

    def _fit(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        limit = self.hparams.max_length
        if limit is None or len(ids) <= limit:
            return ids, mask
        if self.hparams.overflow == "error" or 1 not in mask[:limit]:
            raise ValueError(
                f"a row has {len(ids)} tokens (chat template included) > data.max_length={limit}"
                + ("" if 1 in mask[:limit] else ", and its reply starts after that")
                + "; raise the limit, or set data.overflow='truncate' to cut the end."
            )
        return ids[:limit], mask[:limit]

    # ------------------------------------------------------------- validation
    def score_validation(self, rows: list[dict], completions: list[str]) -> torch.Tensor:
        """Scores of greedy answers to ``rows`` under ``val_reward``: ``[B]`` floats."""
        columns = columns_of(rows)
        prompts = [str(p) for p in columns.pop("prompt", [""] * len(rows))]
        values = self.val_reward(prompts, completions, **columns)
        return torch.tensor([0.0 if v is None else float(v) for v in values])


def _reply(value) -> str:
    """A completion column's text: a string, or the last message's content."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict) and "content" in value[-1]:
        return str(value[-1]["content"])
    raise ValueError(
        f"data column 'completion' holds {type(value).__name__} {value!r:.80}; "
        "expected a string or a list of chat messages."
    )


def _conversation_segments(messages, tokenizer) -> list[tuple[str, bool]]:
    """A conversation as context and assistant pieces, each assistant turn as the template renders it."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(
            f"data column 'messages' holds {messages!r:.80}; expected a list of "
            "{'role': ..., 'content': ...} messages."
        )
    if tokenizer is None:
        return [(str(m.get("content", "")), m["role"] == "assistant") for m in messages]
    pieces, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        after = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise ValueError(
                "the tokenizer's chat template does not render a conversation turn by turn (a "
                "shorter conversation is not a prefix of a longer one), so the assistant turns "
                "cannot be told apart; use prompt + completion columns instead of messages."
            )
        pieces += [(before[len(done) :], False), (after[len(before) :], True)]
        done = after
    return pieces
