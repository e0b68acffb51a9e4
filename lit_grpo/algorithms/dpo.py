"""DPOModule: Direct Preference Optimization on the GRPO policy machinery.

When preference pairs exist instead of a verifier, DPO optimises the same
KL-regularised objective as GRPO without sampling: each step scores the
chosen and rejected replies under the policy and under the reference, and
:func:`lit_grpo.objectives.dpo_loss` does the rest. Logging, validation
(also before the first step) and exact resume inside an epoch come from
:class:`~lit_grpo.algorithms.supervised.SupervisedModule`; loading, (Q)LoRA,
the reference, the optimizer and checkpoints from :class:`PolicyModule`.

Choices, on purpose:

* The reference is the policy with its adapter disabled (a frozen copy under
  full fine-tuning), scored once per batch without grad, before the policy's
  own forward: no second model, no precomputed reference pass over the data.
* Chosen and rejected rows share one forward pass (2B rows).
* Log-probs are at temperature 1: DPO scores the data, it does not sample.
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lit_grpo.algorithms.supervised import SupervisedModule
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.model.policy import PolicySpec
from lit_grpo.objectives import LossOutput, dpo_loss, sequence_logps


class DPOModule(SupervisedModule):
    """Direct Preference Optimization (sigmoid loss) for a causal language model.

    Args:
        policy: Which model to train, its adapter, quantization and dtype.
        beta: Inverse temperature of the implicit reward
            ``beta * (log pi - log ref)``; larger keeps the policy closer to the
            reference.
        label_smoothing: Assumed probability that a pair's labels are flipped
            (conservative DPO); 0 is plain DPO.
        optimizer: Optimizer factory over the trainable parameters; ``None``
            gives AdamW with lr 1e-4 and no weight decay.
        scheduler: Optional learning-rate scheduler factory (stepped per
            optimizer step).
        max_nonfinite_steps: Consecutive optimizer steps with a NaN/inf
            gradient that are skipped before training stops with an error.
        progress: Print the validation metrics before training and after each
            validation.
    """

    shown_metrics = ("val/loss", "val/rewards/accuracy", "val/rewards/margin", "val/logps/accuracy")
    pair_accuracy = "rewards/accuracy"

    def __init__(
        self,
        policy: PolicySpec | None = None,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        max_nonfinite_steps: int = 3,
        progress: bool = True,
    ) -> None:
        super().__init__(policy, optimizer, scheduler, max_nonfinite_steps)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        if not beta > 0:
            raise ValueError(f"model.beta={beta}; expected > 0.")
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"model.label_smoothing={label_smoothing}; expected a value in [0, 0.5).")

    @property
    def needs_reference(self) -> bool:
        return True

    def batch_rows(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["completion_ids"].shape[0] // 2  # pairs

    def batch_loss(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        """DPO loss and metrics of a batch of 2B rows, chosen first."""
        with torch.no_grad(), self.reference_model() as reference:
            ref_logps = self.sequence_logps(reference, batch)  # [2B]
        policy_logps = self.sequence_logps(self.policy, batch)  # [2B]
        policy_chosen, policy_rejected = policy_logps.chunk(2)  # [B], [B]
        ref_chosen, ref_rejected = ref_logps.chunk(2)  # [B], [B]
        return dpo_loss(
            policy_chosen,
            policy_rejected,
            ref_chosen,
            ref_rejected,
            beta=self.hparams.beta,
            label_smoothing=self.hparams.label_smoothing,
        )

    def sequence_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed log-prob of each row's completion under ``model``: ``[2B]``."""
        logprobs, _ = completion_logprobs(model, **batch, temperature=1.0)  # [2B, C]
        return sequence_logps(logprobs, batch["completion_mask"])
