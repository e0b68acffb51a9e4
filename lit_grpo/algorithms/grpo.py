"""GRPOModule: the LightningModule that trains a policy with GRPO.

It orchestrates; the math is in :mod:`lit_grpo.objectives`, sampling in
:mod:`lit_grpo.generation`, rewards in :mod:`lit_grpo.rewards`, the rollout in
:mod:`lit_grpo.rollout`, and what every on-policy objective shares (the
engine, the rollout's logging, validation) in
:class:`~lit_grpo.algorithms.on_policy.OnPolicyModule`. One training step reads like the algorithm:
current log-probs -> clipped, KL-regularised objective -> log.

Departures from the paper, on purpose:

* The reference policy is the frozen base model with the LoRA adapter
  disabled, not a separate copy (full fine-tuning keeps a copy).
* When a rollout gets exactly one optimizer step, pi_old = pi_theta and the
  ratio is computed against the detached current log-probs (it is 1, with
  the right gradient) instead of a second forward pass.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lit_grpo.algorithms.on_policy import SCORED_KEYS, OnPolicyModule
from lit_grpo.generation import GenerationSpec
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.model.policy import PolicySpec
from lit_grpo.objectives import grpo_loss
from lit_grpo.objectives.grpo import CLIP_METRICS, IMPORTANCE_LEVELS, LOSS_TYPES, sampler_gap

__all__ = ["SCORED_KEYS", "GRPOModule"]

# Loss types normalised by a count taken over the whole optimizer step on all
# ranks; Lightning averages micro-batches and DDP averages ranks, so these
# losses are scaled back up to a plain sum.
_GLOBALLY_NORMALISED = {"dapo", "cispo"}
# The truncated importance-sampling cap of rollouts sampled ahead (data.staleness) where
# model.generation.importance_sampling_cap sets none: TRL's and verl's default.
AHEAD_IMPORTANCE_SAMPLING_CAP = 2.0


class GRPOModule(OnPolicyModule):
    """Group Relative Policy Optimization for a causal language model.

    Args:
        policy: Which model to train, its adapter, quantization and dtype.
        beta: Weight of the k3 KL penalty to the reference policy; 0 skips the
            reference forward pass entirely. Under an estimator that puts the
            KL into its rewards (``data.advantage.estimator: reinforce_pp``)
            it weighs the k1 KL inside the per-token rewards instead, and the
            loss has no KL term.
        epsilon_low: Lower clip range of the ratio (1 - epsilon_low).
        epsilon_high: Upper clip range (1 + epsilon_high); DAPO's clip-higher
            uses 0.28.
        loss_type: The clipped surrogate aggregated over tokens as ``grpo``
            (mean per sequence, then over sequences), ``bnpo`` (token mean per
            micro-batch), ``dapo`` (token sum over all tokens of the optimizer
            step on all ranks) or ``dr_grpo`` (sum / (rows x
            max_completion_length)); or ``cispo`` (MiniMax-M1, arXiv:2506.13585:
            REINFORCE weighted by the detached ratio capped at 1 +
            epsilon_high; aggregated as ``dapo``) or ``sapo`` (Qwen,
            arXiv:2511.20347: a soft sigmoid gate instead of the clip;
            aggregated as ``grpo``). docs/algorithms.md has each formula.
        importance_level: ``token`` (PPO/GRPO ratio per token) or ``sequence``
            (GSPO: one geometric-mean ratio per completion).
        max_completion_length: Denominator of ``dr_grpo``; defaults to the
            DataModule's ``sampling.max_new_tokens``.
        optimizer: Optimizer factory over the trainable parameters; ``None``
            gives AdamW with lr 1e-4 and no weight decay.
        scheduler: Optional learning-rate scheduler factory (stepped per
            optimizer step).
        max_nonfinite_steps: Consecutive optimizer steps with a NaN/inf
            gradient that are skipped before training stops with an error.
        log_samples: Sample completions written per epoch to
            ``samples.jsonl`` in the log directory.
        progress: Show progress for each phase of a rollout and of validation: a bar
            where the trainer shows its own (``trainer.enable_progress_bar``), else one
            line when the phase ends; and a line per epoch with its reward, accuracy
            and time.
        validate_before_training: Score the validation prompts (and each
            ``data.held_out.slices`` slice) once before the first step (logged as
            ``val/accuracy``, ``val/<slice>/accuracy`` at step 0), so the gain is visible.
        skip_zero_gradient_rows: With ``beta == 0``, leave rows with zero
            advantage (collapsed groups) out of the forward and backward passes;
            their gradient is exactly zero, and the loss is rescaled so the
            step is unchanged.
        sapo_temperature_pos: ``sapo``'s gate temperature where the advantage is positive.
        sapo_temperature_neg: ``sapo``'s gate temperature elsewhere (larger: the gate closes sooner).
        entropy_coef: Entropy bonus: this times the policy's entropy at each
            sampled token is subtracted from the loss (0: none).
        top_entropy_quantile: Train the policy term on this fraction of each
            micro-batch's tokens with the highest entropy only (TRL's
            ``top_entropy_quantile``; Wang et al. 2025, "80/20"); 1.0: all.
        generation: Which engine samples rollouts and validation answers
            (``native`` or ``vllm``), in which dtype, and the importance-sampling
            correction for a sampler that differs from the trainer; see
            :class:`~lit_grpo.generation.GenerationSpec`.
    """

    def __init__(
        self,
        policy: PolicySpec | None = None,
        beta: float = 0.04,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo"] = "grpo",
        importance_level: Literal["token", "sequence"] = "token",
        max_completion_length: int | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        max_nonfinite_steps: int = 3,
        log_samples: int = 2,
        progress: bool = True,
        validate_before_training: bool = True,
        skip_zero_gradient_rows: bool = True,
        generation: GenerationSpec | None = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        entropy_coef: float = 0.0,
        top_entropy_quantile: float = 1.0,
    ) -> None:
        super().__init__(policy, optimizer, scheduler, max_nonfinite_steps, generation)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        if beta < 0:
            raise ValueError(f"model.beta={beta}; expected >= 0.")
        for name, value in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high)):
            if value < 0:
                raise ValueError(f"model.{name}={value}; expected >= 0.")
        for name, value in (
            ("sapo_temperature_pos", sapo_temperature_pos),
            ("sapo_temperature_neg", sapo_temperature_neg),
        ):
            if not value > 0:
                raise ValueError(f"model.{name}={value}; expected > 0.")
        if not 0 < top_entropy_quantile <= 1:
            raise ValueError(
                f"model.top_entropy_quantile={top_entropy_quantile}; expected a fraction in (0, 1] "
                "(1.0 trains on every token)."
            )
        for name, value, choices in (
            ("loss_type", loss_type, LOSS_TYPES),
            ("importance_level", importance_level, IMPORTANCE_LEVELS),
        ):
            if value not in choices:
                raise ValueError(f"model.{name}={value!r}; expected one of {sorted(choices)}.")

    # The DataModule's advantage estimators this objective trains with; the first is the default.
    ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")

    # ------------------------------------------------------------------ model
    @property
    def needs_reference(self) -> bool:
        return self.hparams.beta > 0

    def estimator_options(self) -> dict[str, float]:
        """What the advantage estimators read of this objective (REINFORCE++ weighs its KL rewards by ``beta``)."""
        return {"beta": self.hparams.beta}

    # --------------------------------------------------------------- training
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        self._log_rollout_stats(batch)
        kl_in_rewards = batch["kl_in_rewards"]  # the estimator weighed the KL into the rewards: not in the loss
        start = time.perf_counter()
        batch, scale = self._rows_with_gradient(batch, kl_in_rewards)
        if batch is not None:
            self.throughput.step(batch)
        if batch is None:  # every row's gradient is exactly zero: no forward, no backward
            self._log_step(dict.fromkeys(self._step_metric_names(kl_in_rewards), 0.0), 0.0, rows=0)
            self._backward_start = time.perf_counter()
            return sum(p.sum() for p in self.trainable_parameters()) * 0.0  # keeps DDP/FSDP in step
        logprobs, entropy = completion_logprobs(
            self.policy,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            temperature=batch["temperature"],
            with_entropy=True,
            completion_attention=batch.get("completion_attention"),
            entropy_grad=hp.entropy_coef != 0,
        )  # [n, C]
        mask = batch["completion_mask"]
        old_logprobs = batch.get("old_logprobs", logprobs.detach())
        cap = self.generation.importance_sampling_cap
        if cap is None and batch["sampled_ahead"]:  # older weights sampled it: always corrected
            cap = AHEAD_IMPORTANCE_SAMPLING_CAP
        weights, sampler_metrics = sampler_gap(old_logprobs, batch.get("sampler_logprobs", old_logprobs), mask, cap)
        result = grpo_loss(
            logprobs,
            old_logprobs,
            batch["advantages"],
            mask,
            ref_logprobs=batch.get("ref_logprobs"),
            beta=0.0 if kl_in_rewards else hp.beta,
            epsilon_low=hp.epsilon_low,
            epsilon_high=hp.epsilon_high,
            loss_type=hp.loss_type,
            importance_level=hp.importance_level,
            max_completion_length=hp.max_completion_length or batch["max_new_tokens"],
            num_items=batch["num_items"],
            importance_weights=weights,
            sapo_temperature_pos=hp.sapo_temperature_pos,
            sapo_temperature_neg=hp.sapo_temperature_neg,
            entropies=entropy,
            entropy_coef=hp.entropy_coef,
            top_entropy_quantile=hp.top_entropy_quantile,
        )
        loss = result.loss * scale
        if hp.loss_type in _GLOBALLY_NORMALISED:
            loss = loss * self.trainer.accumulate_grad_batches * self.trainer.world_size
        self._add_time("policy_forward", time.perf_counter() - start)
        values = {f"train/{k}": v for k, v in result.metrics.items()}
        values["train/entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        values.update(sampler_metrics)
        metrics = {name: values[name] for name in self._step_metric_names(kl_in_rewards)}
        self._log_step(metrics, result.loss.detach(), rows=mask.shape[0])
        self._backward_start = time.perf_counter()
        return loss

    def _step_metric_names(self, kl_in_rewards: bool) -> list[str]:
        """The metrics every training step logs, in a fixed order (the same on every rank)."""
        kl = ["kl"] if self.hparams.beta > 0 and not kl_in_rewards else []
        trained = ["entropy/trained_fraction"] if self.hparams.top_entropy_quantile < 1 else []
        return [f"train/{k}" for k in (*CLIP_METRICS, *kl, "entropy", *trained)] + [
            "sampler/logprob_abs_diff",
            "sampler/kl",
            "sampler/is_capped_fraction",
        ]

    def _rows_with_gradient(self, batch: dict, kl_in_rewards: bool) -> tuple[dict | None, float]:
        """Drop the rows whose gradient is exactly zero; return the rest and the loss scale.

        With no KL in the loss (``beta == 0``, or the KL in the rewards) a row
        whose advantages are all zero (every row of a collapsed group)
        contributes exactly 0 to the loss and its gradient, but it still
        counts in the denominator of ``grpo``/``dr_grpo`` (rows) and ``bnpo``
        (tokens); the loss of the remaining rows is scaled by kept/all of that
        denominator, so the step is the same as with every row. ``dapo`` and
        ``cispo`` divide by a count fixed for the whole step. Returns ``(None, 0)`` when
        no row is left. The logged training metrics then cover the kept rows.
        """
        hp = self.hparams
        if (
            not hp.skip_zero_gradient_rows
            or (hp.beta > 0 and not kl_in_rewards)
            or hp.entropy_coef != 0
            or hp.top_entropy_quantile < 1
        ):
            return batch, 1.0  # the KL or the entropy bonus trains every row; the quantile is over every row
        advantages = batch["advantages"]  # [n] or [n, C]
        keep = (advantages != 0).reshape(len(advantages), -1).any(-1)  # [n]
        if bool(keep.all()):
            return batch, 1.0
        if not bool(keep.any()):
            return None, 0.0
        mask = batch["completion_mask"]
        if hp.loss_type in _GLOBALLY_NORMALISED:
            scale = 1.0
        elif hp.loss_type == "bnpo":
            scale = float(mask[keep].sum() / mask.sum().clamp(min=1))
        else:
            scale = float(keep.sum()) / len(keep)
        kept = {
            k: v[keep] if torch.is_tensor(v) and v.dim() > 0 and len(v) == len(keep) else v for k, v in batch.items()
        }
        return kept, scale
