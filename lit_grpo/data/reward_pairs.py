"""RewardDataModule: preference pairs as whole conversations, for training a reward model.

The rows, sources, column maps and checks are :class:`~lit_grpo.data.preferences.PreferenceDataModule`'s
(the same files train DPO and the reward model). Each pair becomes two
conversations ``[system?, user: prompt, assistant: reply]`` rendered by the
chat template exactly as :class:`~lit_grpo.rewards.RewardModel` renders what
it scores later (:func:`~lit_grpo.rewards.reward_model.encode_conversations`):
a batch of B pairs is ``input_ids``/``attention_mask`` ``[2B, T]``,
right-padded, chosen first.
"""

from __future__ import annotations

import torch

from lit_grpo.data.preferences import PreferenceDataModule, column_text
from lit_grpo.rewards.reward_model import encode_conversations


class RewardDataModule(PreferenceDataModule):
    """Preference pairs in, chosen/rejected conversations out (arguments: :class:`PreferenceDataModule`'s;
    a conversation is at most ``max_prompt_length + max_completion_length`` tokens, keeping its end)."""

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Tokenize B pairs into 2B conversations, chosen first, with the module's tokenizer."""
        return self.encode_pairs(self.trainer.lightning_module.tokenizer, rows)

    def encode_pairs(self, tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Tokenize B pairs into 2B conversations, chosen first, with ``tokenizer`` (``collate``
        without a trainer: an exported reward model's tokenizer scores the pairs as training saw them)."""
        hp = self.hparams
        prompts = [hp.prompt_template.format(prompt=column_text(r["prompt"], "prompt")) for r in rows]
        replies = [column_text(r["chosen"], "chosen") for r in rows] + [
            column_text(r["rejected"], "rejected") for r in rows
        ]
        limit = (
            None
            if None in (hp.max_prompt_length, hp.max_completion_length)
            else (hp.max_prompt_length + hp.max_completion_length)
        )
        input_ids, attention_mask = encode_conversations(tokenizer, prompts * 2, replies, hp.system_prompt, limit)
        return {"input_ids": input_ids, "attention_mask": attention_mask}  # [2B, T] each
