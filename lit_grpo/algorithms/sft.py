"""SFTModule: supervised fine-tuning on demonstrations, the completion tokens only.

The first stage of RLHF and R1's cold start: maximise the log-likelihood of
the demonstrated replies given their prompts (:func:`lit_grpo.objectives.sft_loss`).
Prompt tokens are context, never targets. The scoring pass is the one every
RL objective uses (:func:`~lit_grpo.model.logprob_passes.completion_logprobs`, at
temperature 1): the output head is fused with the log-softmax, so the
``[B, T, V]`` logits are never held. Loading, (Q)LoRA or full fine-tuning,
the optimizer, checkpoints, exports and strategies come from
:class:`~lit_grpo.algorithms.base.PolicyModule`; ``lit-grpo sft fit
--export_adapter DIR`` writes the adapter that ``policy.init_adapter``
later folds into the base of an RL run, so that its reference is this model.

Validation: the held-out loss, and where the rows have an ``answer`` (the
built-in ``arithmetic_sft``) the greedy accuracy of the policy's answers to
the held-out prompts.
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lit_grpo.algorithms.supervised import SupervisedModule
from lit_grpo.generation import GenerationSpec, build_engine
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.model.policy import PolicySpec
from lit_grpo.objectives import LossOutput, sft_loss

_SCORED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


class SFTModule(SupervisedModule):
    """Supervised fine-tuning of a causal LM, loss on the completion (assistant) tokens.

    Args:
        policy: Which model to train, its adapter, quantization and dtype.
        optimizer: Optimizer factory over the trainable parameters; ``None``
            gives AdamW with lr 1e-4 and no weight decay.
        scheduler: Optional learning-rate scheduler factory (stepped per optimizer step).
        max_nonfinite_steps: Consecutive optimizer steps with a NaN/inf
            gradient that are skipped before training stops with an error.
        progress: Print the validation metrics before training and after each validation.
    """

    shown_metrics = ("val/loss", "val/accuracy")
    merges_for_generation = True  # greedy validation may decode on the merged adapter

    def __init__(
        self,
        policy: PolicySpec | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        max_nonfinite_steps: int = 3,
        progress: bool = True,
    ) -> None:
        super().__init__(policy, optimizer, scheduler, max_nonfinite_steps)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])

    def batch_loss(self, batch: dict) -> LossOutput:
        logprobs, _ = completion_logprobs(self.policy, **{k: batch[k] for k in _SCORED}, temperature=1.0)  # [B, C]
        return sft_loss(logprobs, batch["loss_mask"])

    def validation_metrics(self, batch: dict) -> dict[str, torch.Tensor]:
        metrics = super().validation_metrics(batch)
        datamodule = self.trainer.datamodule
        if getattr(datamodule, "val_reward", None) is not None and "rows" in batch:
            texts = self.answer(batch["prompt_ids"], batch["prompt_mask"])
            metrics["accuracy"] = datamodule.score_validation(batch["rows"], texts).to(self.device).mean()
        return metrics

    def answer(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[str]:
        """Greedy answers to left-padded prompts, at most ``data.val_max_new_tokens`` tokens."""
        if self._engine is None:
            self._engine = build_engine(GenerationSpec(), self)
        sampling = SamplingSpec(group_size=1, max_new_tokens=self.trainer.datamodule.hparams.val_max_new_tokens)
        return self._engine.generate(prompt_ids, prompt_mask, sampling, greedy=True).texts
