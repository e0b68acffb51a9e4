"""GRPOModule: the LightningModule that trains a policy with GRPO.

It orchestrates; the math is in :mod:`lit_grpo.objectives`, sampling in
:mod:`lit_grpo.generation`, rewards in :mod:`lit_grpo.rewards`, and the rollout
round in the DataModule. One training step reads like the algorithm:
current log-probs -> clipped, KL-regularised objective -> log.

Departures from the paper, on purpose:

* The reference policy is the frozen base model with the LoRA adapter
  disabled, not a separate copy (full fine-tuning keeps a copy).
* When a rollout gets exactly one optimizer step, pi_old = pi_theta and the
  ratio is computed against the detached current log-probs (it is 1, with
  the right gradient) instead of a second forward pass.
"""

from __future__ import annotations

import contextlib
import time
from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric
from tqdm.auto import tqdm

from lit_grpo.objectives import grpo_loss
from lit_grpo.objectives.grpo import CLIP_METRICS, IMPORTANCE_LEVELS, LOSS_TYPES, sampler_gap
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.generation import Engine, GenerationSpec, build_engine
from lit_grpo.model.policy import PolicySpec
from lit_grpo.algorithms.base import PolicyModule
from lit_grpo.algorithms.answers import greedy_accuracy
from lit_grpo.evaluation.samples import append_samples
from lit_grpo.rollout.producer import MAX_STATS
from lit_grpo.model.hardware import peak_flops
from lit_grpo.training.throughput import EpochThroughput, FlopModel

# Loss types normalised by a count taken over the whole optimizer step on all
# ranks; Lightning averages micro-batches and DDP averages ranks, so these
# losses are scaled back up to a plain sum.
_GLOBALLY_NORMALISED = {"dapo"}
# The rollout columns a scoring pass reads (and an episode's attention mask, where the rollout has one).
SCORED_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
# The truncated importance-sampling cap of rollouts sampled ahead (data.staleness) where
# model.generation.importance_sampling_cap sets none: TRL's and verl's default.
AHEAD_IMPORTANCE_SAMPLING_CAP = 2.0
# Phases of a training step timed per epoch (logged as time/<phase>).
_STEP_PHASES = ("policy_forward", "policy_backward", "optimizer")


class GRPOModule(PolicyModule):
    """Group Relative Policy Optimization for a causal language model.

    Args:
        policy: Which model to train, its adapter, quantization and dtype.
        beta: Weight of the k3 KL penalty to the reference policy; 0 skips the
            reference forward pass entirely. Under an estimator that puts the
            KL into its rewards (``data.advantage_estimator: reinforce_pp``)
            it weighs the k1 KL inside the per-token rewards instead, and the
            loss has no KL term.
        epsilon_low: Lower clip range of the ratio (1 - epsilon_low).
        epsilon_high: Upper clip range (1 + epsilon_high); DAPO's clip-higher
            uses 0.28.
        loss_type: Aggregation over tokens: ``grpo`` (mean per sequence, then
            over sequences), ``bnpo`` (token mean per micro-batch), ``dapo``
            (token sum over all tokens of the optimizer step on all ranks),
            ``dr_grpo`` (sum / (rows x max_completion_length)).
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
        progress: Show progress bars for rollout generation (only where the
            trainer shows its own, ``trainer.enable_progress_bar``) and a
            line per epoch with its reward, accuracy and time.
        validate_before_training: Score the validation prompts (and each
            ``data.val_slices`` slice) once before the first step (logged as
            ``val/accuracy``, ``val/<slice>/accuracy`` at step 0), so the gain is visible.
        skip_zero_gradient_rows: With ``beta == 0``, leave rows with zero
            advantage (collapsed groups) out of the forward and backward passes;
            their gradient is exactly zero, and the loss is rescaled so the
            step is unchanged.
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
        loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "grpo",
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
    ) -> None:
        super().__init__(policy, optimizer, scheduler, max_nonfinite_steps)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        if beta < 0:
            raise ValueError(f"model.beta={beta}; expected >= 0.")
        for name, value in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high)):
            if value < 0:
                raise ValueError(f"model.{name}={value}; expected >= 0.")
        for name, value, choices in (("loss_type", loss_type, LOSS_TYPES),
                                     ("importance_level", importance_level, IMPORTANCE_LEVELS)):
            if value not in choices:
                raise ValueError(f"model.{name}={value!r}; expected one of {sorted(choices)}.")
        self.generation = generation or GenerationSpec()
        if self.generation.backend == "vllm":
            from lit_grpo.generation.vllm import check_policy

            check_policy(self.spec)
        self.val_accuracy = torch.nn.ModuleList([MeanMetric()])  # one per held-out set (data.val_sets())
        self._engine: Engine | None = None  # built at the first rollout, on the policy's device

    # Whether the native engine may decode on the adapter folded into the weights.
    merges_for_generation = True
    # The DataModule's advantage estimators this objective trains with; the first is the default.
    ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
    # Why this objective cannot train on episodes (tools, environments); empty: it can.
    EPISODES_REFUSED = ""

    # ------------------------------------------------------------------ model
    @property
    def needs_reference(self) -> bool:
        return self.hparams.beta > 0

    @property
    def policy_version(self) -> int:
        """The version of the weights: optimizer steps taken (what a rollout sampled now is tagged with)."""
        return self.global_step if self._trainer is not None else 0

    def estimator_options(self) -> dict[str, float]:
        """What the advantage estimators read of this objective (REINFORCE++ weighs its KL rewards by ``beta``)."""
        return {"beta": self.hparams.beta}

    @property
    def engine(self) -> Engine:
        """What samples completions (:mod:`lit_grpo.generation`), built on first use."""
        if self._engine is None:
            self._engine = build_engine(self.generation, self)
        return self._engine

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        if self._engine is not None:
            self._engine.weights_changed()

    def teardown(self, stage: str) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def show_progress(self, description: str, total: int | None = None):
        """A progress bar (decoding steps) for a rollout phase on rank 0, or ``None``."""
        shown = self._trainer is None or self._trainer.progress_bar_callback is not None
        if not (self.hparams.progress and shown) or self.global_rank != 0:
            return None
        return tqdm(desc=description, total=total, unit="step", leave=False, dynamic_ncols=True)

    @torch.no_grad()
    def rollout_logprobs(self, rows: dict, temperature: float, reference: bool,
                         batch_size: int | None = None) -> torch.Tensor:
        """Log-probs of rollout completions without grad: ``[N, C]``, ``batch_size`` rows per pass
        (``None``: all at once).

        ``reference=True`` scores with the reference policy (the adapter
        disabled, or the frozen copy under full fine-tuning).
        """
        with self.reference_model() if reference else contextlib.nullcontext(self.policy) as model:
            was_training = model.training
            model.eval()
            logprobs = self.score_rollout(rows, lambda **part: completion_logprobs(
                model, **part, temperature=temperature)[0], batch_size)
            model.train(was_training)
        return logprobs

    def score_rollout(self, rows: dict, score, batch_size: int | None = None) -> torch.Tensor:
        """``score(**part)`` over the rollout's rows, ``batch_size`` at a time (``None``: all at once),
        concatenated on the CPU: ``[N, C]``.

        ``part`` holds a micro-batch's ``prompt_ids``, ``prompt_mask``,
        ``completion_ids`` and ``completion_mask`` on the module's device, and
        ``completion_attention`` where the rollout has one (episodes).
        """
        size = batch_size or len(rows["prompt_ids"])
        keys = SCORED_KEYS + tuple(k for k in ("completion_attention",) if k in rows)
        out = []
        for start in range(0, rows["prompt_ids"].shape[0], size):
            part = {k: rows[k][start : start + size].to(self.device) for k in keys}
            out.append(score(**part).float().cpu())
        return torch.cat(out)  # [N, C]

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
            self.policy, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
            batch["completion_mask"], temperature=batch["temperature"], with_entropy=True,
            completion_attention=batch.get("completion_attention"),
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
        )
        loss = result.loss * scale
        if hp.loss_type in _GLOBALLY_NORMALISED:
            loss = loss * self.trainer.accumulate_grad_batches * self.trainer.world_size
        self._add_time("policy_forward", time.perf_counter() - start)
        values = {f"train/{k}": v for k, v in result.metrics.items()}
        values["train/entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        values.update(sampler_metrics)
        metrics = {name: values[name] for name in self._step_metric_names(kl_in_rewards)}
        self._log_step(metrics, result.loss.detach(), rows=mask.shape[0])
        self._backward_start = time.perf_counter()
        return loss

    def _log_rollout_stats(self, batch: dict) -> None:
        """Log the rollout's statistics, which its first micro-batch carries (on every rank at once)."""
        if "rollout_stats" in batch:
            stats, self.rollout_samples = batch["rollout_stats"], batch["rollout_samples"]
            self.throughput.rollout(batch["rollout_counts"])
            self.rollout_seconds = {k.removeprefix("time/"): v for k, v in stats.items() if k.startswith("time/")}
            self.log_reduced({k: v for k, v in stats.items() if k not in MAX_STATS})
            self.log_reduced({k: stats[k] for k in MAX_STATS}, op="max")

    def _log_step(self, metrics: dict, loss, rows: int) -> None:
        # Every rank reaches this in every step, also one whose rows were all skipped
        # (weight 0), so the reduction inside is a collective all ranks take part in.
        self.log_reduced(metrics, weight=rows)
        self.log_reduced({"train/loss": loss}, weight=rows, prog_bar=True, on_step=True)

    def _step_metric_names(self, kl_in_rewards: bool) -> list[str]:
        """The metrics every training step logs, in a fixed order (the same on every rank)."""
        kl = ["kl"] if self.hparams.beta > 0 and not kl_in_rewards else []
        return [f"train/{k}" for k in (*CLIP_METRICS, *kl, "entropy")] + [
            "sampler/logprob_abs_diff", "sampler/kl", "sampler/is_capped_fraction"]

    def _rows_with_gradient(self, batch: dict, kl_in_rewards: bool) -> tuple[dict | None, float]:
        """Drop the rows whose gradient is exactly zero; return the rest and the loss scale.

        With no KL in the loss (``beta == 0``, or the KL in the rewards) a row
        whose advantages are all zero (every row of a collapsed group)
        contributes exactly 0 to the loss and its gradient, but it still
        counts in the denominator of ``grpo``/``dr_grpo`` (rows) and ``bnpo``
        (tokens); the loss of the remaining rows is scaled by kept/all of that
        denominator, so the step is the same as with every row. ``dapo``
        divides by a count fixed for the whole step. Returns ``(None, 0)`` when
        no row is left. The logged training metrics then cover the kept rows.
        """
        if not self.hparams.skip_zero_gradient_rows or (self.hparams.beta > 0 and not kl_in_rewards):
            return batch, 1.0
        advantages = batch["advantages"]  # [n] or [n, C]
        keep = (advantages != 0).reshape(len(advantages), -1).any(-1)  # [n]
        if bool(keep.all()):
            return batch, 1.0
        if not bool(keep.any()):
            return None, 0.0
        mask = batch["completion_mask"]
        scale = {"bnpo": float(mask[keep].sum() / mask.sum().clamp(min=1)), "dapo": 1.0}.get(
            self.hparams.loss_type, float(keep.sum()) / len(keep))
        kept = {k: v[keep] if torch.is_tensor(v) and v.dim() > 0 and len(v) == len(keep) else v
                for k, v in batch.items()}
        return kept, scale

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self.trainer.datamodule.begin_micro_batch(batch["micro_batch"])

    def on_after_backward(self) -> None:
        self._add_time("policy_backward", time.perf_counter() - self._backward_start)

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        # The epoch's timings are complete after its last step (optimizer included);
        # they are reduced here, where every rank is in step, not at epoch end.
        if batch["micro_batch"] + 1 == batch["micro_batches"]:
            values = {f"time/{phase}": self.phase_seconds.get(phase, 0.0) for phase in _STEP_PHASES}
            values.update(self.throughput.metrics({**self.rollout_seconds, **self.phase_seconds}))
            self.log_reduced({**values, "train/skipped_steps": float(self.guard.skipped)})

    # ---------------------------------------------------------------- logging
    def on_fit_start(self) -> None:
        # Trainer.log_dir is a broadcast: asked once here, where every rank asks,
        # never in the epoch-end hooks that only rank 0 gets to write from.
        self.log_dir = self.trainer.log_dir
        # The peak is measured on a CPU (cached after the first run): by rank 0 alone, so that
        # ranks sharing the cores do not slow each other's probe, and broadcast.
        peak = peak_flops(self.device, self.spec.cache_dir) if self.global_rank == 0 else 0.0
        self.throughput = EpochThroughput(FlopModel.of(self.policy), self.trainer.strategy.broadcast(peak, src=0))
        self.rollout_seconds: dict[str, float] = {}
        self.rollout_samples: list[tuple] = []  # the latest rollout's, written at the epoch's end

    def on_train_epoch_start(self) -> None:
        self.phase_seconds = {}
        self.throughput.reset()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.EPISODES_REFUSED and getattr(self.trainer.datamodule, "episodes", None) is not None:
            raise ValueError(f"data.tools / data.environment with {type(self).__name__}: {self.EPISODES_REFUSED}")
        sets = len(self.trainer.datamodule.val_sets()) if self.trainer.datamodule is not None else 1
        self.val_accuracy.extend(MeanMetric() for _ in range(sets - len(self.val_accuracy)))

    def on_train_start(self) -> None:
        check = getattr(self.engine, "check", None)  # a remote engine's servers, before any rollout
        if check is not None:
            check()
        datamodule = self.trainer.datamodule
        if self.hparams.validate_before_training and self.global_step == 0 and datamodule.val_rows:
            self.initial_val_accuracy = {name: self.evaluate(rows) for name, rows in datamodule.val_sets().items()}
            for logger in self.loggers:
                logger.log_metrics(self.initial_val_accuracy, step=0)
            if self.global_rank == 0 and self.hparams.progress:
                tqdm.write("before training: " + _accuracies(self.initial_val_accuracy))
        # The epoch clock runs from one epoch's end to the next, so it includes the
        # rollout, which Lightning runs before on_train_epoch_start.
        self.epoch_started = time.perf_counter()

    def evaluate(self, rows: list[dict] | None = None) -> float:
        """Greedy accuracy on ``rows``, by default the validation prompts (see :func:`greedy_accuracy`)."""
        datamodule = self.trainer.datamodule
        return greedy_accuracy(self, datamodule, datamodule.val_rows if rows is None else rows)

    def on_train_epoch_end(self) -> None:
        # No collective here: only rank 0 reaches the progress bar's and our own
        # rank-0 work, so everything logged was reduced in the steps already.
        self._write_samples()
        metrics = self.trainer.callback_metrics
        summary = f"epoch {self.current_epoch}: reward {float(metrics.get('reward/total', float('nan'))):.3f}"
        validated = {name: float(metrics[name]) for name in self.trainer.datamodule.val_sets() if name in metrics}
        if validated:
            summary += " | " + _accuracies(validated)
        summary += f" | {time.perf_counter() - self.epoch_started:.1f} s"
        if self.global_rank == 0 and self.hparams.progress:
            tqdm.write(summary)
        self.epoch_started = time.perf_counter()

    def _write_samples(self) -> None:
        samples = self.rollout_samples[: self.hparams.log_samples]
        if samples and self.log_dir is not None and self.global_rank == 0:
            append_samples(self.log_dir, self.current_epoch, samples)

    # ------------------------------------------------------------- validation
    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        completions = self.answer(batch["prompt_ids"], batch["prompt_mask"], batch.get("episodes"))
        scores = self.trainer.datamodule.score_validation(batch["rows"], completions)
        metric = self.val_accuracy[dataloader_idx]
        metric.update(scores.to(self.device))
        name = list(self.trainer.datamodule.val_sets())[dataloader_idx]
        self.log(name, metric, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(completions),
                 add_dataloader_idx=False, metric_attribute=f"val_accuracy.{dataloader_idx}")

    def answer(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, episodes=None) -> list[str]:
        """Greedy completions of left-padded prompts (what validation scores); with ``episodes``
        (an :class:`~lit_grpo.generation.episodes.EpisodeSpec`) greedy episodes' final answers."""
        return self.engine.generate(prompt_ids, prompt_mask, self.trainer.datamodule.sampling, greedy=True,
                                    episodes=episodes).texts


def _accuracies(values: dict[str, float]) -> str:
    """``val/accuracy 0.125 | val/3+2/accuracy 0.031``."""
    return " | ".join(f"{name} {value:.3f}" for name, value in values.items())
