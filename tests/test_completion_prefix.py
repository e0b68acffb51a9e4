"""data.prompt.completion_prefix: the reply starts with fixed text (R1-Zero's ``<think>``) that the
policy continues from, and every reader of a completion sees it in front."""

from __future__ import annotations

import json

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_grpo.algorithms.answers import answer_rows
from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, PromptSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import PolicySpec

PREFIX = "<think>"


class Seen:
    """A reward that records what it was given (its score varies, so steps have gradients)."""

    def __init__(self):
        self.completions: list[str] = []

    def __call__(self, prompts, completions, **columns):
        self.completions += completions
        return [float(len(c)) for c in completions]


def test_prefix_ends_each_prompt_and_starts_each_completion_the_readers_see(tmp_path, tiny_model_dir):
    train_seen, val_seen = Seen(), Seen()
    module = GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), progress=False, log_samples=2)
    data = OnPolicyDataModule(
        prompts_per_epoch=2,
        batch_size=4,
        held_out=HeldOutSpec(size=2, batch_size=2, reward=val_seen),
        source=SourceSpec(train_size=8),
        sampling=SamplingSpec(group_size=4, max_new_tokens=5),
        rewards=[train_seen],
        prompt=PromptSpec(completion_prefix=PREFIX),
    )
    trainer = L.Trainer(
        max_epochs=1,
        reload_dataloaders_every_n_epochs=1,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)

    # The policy continues from the prefix: it is the prompt's last text, not part of what is sampled.
    prompt_ids, prompt_mask = data.encode(data.val_rows)
    prefix_ids = module.tokenizer(PREFIX, add_special_tokens=False)["input_ids"]
    assert prompt_ids[0, -len(prefix_ids) :].tolist() == prefix_ids
    # Training rewards, validation and the samples file all read "<think>" + the sampled text.
    assert len(train_seen.completions) == 8 and len(val_seen.completions) >= 2

    def once(text: str) -> bool:
        return text.startswith(PREFIX) and not text.startswith(PREFIX * 2)

    assert all(once(c) for c in train_seen.completions + val_seen.completions)
    samples = [json.loads(line) for line in next(tmp_path.rglob("samples.jsonl")).read_text().splitlines()]
    assert samples and all(once(s["completion"]) for s in samples)
    answers, _ = answer_rows(module, data, data.val_rows)
    assert all(once(a) for a in answers)
    # Without a prefix nothing is added.
    assert OnPolicyDataModule().full_completions(["x"]) == ["x"]
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
