"""OnPolicyModule: what the objectives that train on rollouts share (GRPO, RLOO, REINFORCE++, PPO).

The engine that samples, the scoring passes a rollout needs (reference and old
log-probs, a critic's values), the rollout's statistics and samples arriving
with its first micro-batch, the per-epoch timings and MFU, greedy validation
on the held-out sets, and the epoch line. :class:`~lit_grpo.algorithms.grpo.GRPOModule`
and :class:`~lit_grpo.algorithms.ppo.PPOModule` are siblings over it; each
adds its arguments, its loss (``training_step``) and what it tells the
advantage estimators (``estimator_options``).

Subclasses save ``log_samples``, ``progress`` and ``validate_before_training``
among their hyper-parameters; this class reads them there.
"""

from __future__ import annotations

import contextlib
import time

import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric
from tqdm.auto import tqdm

from lit_grpo.algorithms.answers import answer_batch, greedy_accuracy
from lit_grpo.algorithms.base import PolicyModule
from lit_grpo.evaluation.samples import append_samples
from lit_grpo.generation import Engine, GenerationSpec, build_engine
from lit_grpo.generation.vllm import check_policy
from lit_grpo.model.hardware import peak_bandwidth, peak_flops
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.model.policy import PolicySpec
from lit_grpo.rollout.producer import MAX_STATS
from lit_grpo.training.summary import PhaseLine
from lit_grpo.training.throughput import EpochThroughput, FlopModel

# The rollout columns a scoring pass reads (and an episode's attention mask, where the rollout has one).
SCORED_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
# Phases of a training step timed per epoch (logged as time/<phase>).
_STEP_PHASES = ("policy_forward", "policy_backward", "optimizer")


# What the progress bar shows of a run: the reward and the KL to the reference (a GRPO loss is ~0 by
# construction and reads as "nothing trains"); validation adds its accuracy.
_ON_THE_BAR = ("reward/total", "train/kl")


class OnPolicyModule(PolicyModule):
    """Base class of the objectives that train on rollouts (see the module docstring).

    Args:
        policy: Which model to train, its adapter, quantization and dtype.
        optimizer: Optimizer factory over the trainable parameters.
        scheduler: Optional learning-rate scheduler factory.
        max_nonfinite_steps: Consecutive non-finite steps skipped before training stops.
        generation: Which engine samples rollouts and validation answers.
    """

    # Whether the native engine may decode on the adapter folded into the weights.
    merges_for_generation = True
    # The DataModule's advantage estimators this objective trains with; the first is the default.
    ADVANTAGE_ESTIMATORS: tuple[str, ...] = ()
    # Why this objective cannot train on episodes (tools, environments); empty: it can.
    EPISODES_REFUSED = ""

    def __init__(
        self,
        policy: PolicySpec | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        max_nonfinite_steps: int = 3,
        generation: GenerationSpec | None = None,
    ) -> None:
        super().__init__(policy, optimizer, scheduler, max_nonfinite_steps)
        self.generation = generation or GenerationSpec()
        if self.generation.backend == "vllm":
            check_policy(self.spec)
        self.val_accuracy = torch.nn.ModuleList([MeanMetric()])  # one per held-out set (data.val_sets())

    # ------------------------------------------------------------------ model
    @property
    def policy_version(self) -> int:
        """The version of the weights: optimizer steps taken (what a rollout sampled now is tagged with)."""
        return self.global_step if self._trainer is not None else 0

    @property
    def engine(self) -> Engine:
        """What samples completions (:mod:`lit_grpo.generation`), built on first use."""
        if self._engine is None:
            self._engine = build_engine(self.generation, self)
        return self._engine

    def show_progress(self, description: str, total: int | None = None, unit: str = "step"):
        """A tqdm bar (decoding steps, or another ``unit``) for a phase on rank 0 under a tqdm progress
        bar (or without a trainer); lines (:class:`PhaseLine`) without one or under the rich bar; ``None``
        on the other ranks or without ``progress``."""
        if not self.hparams.progress or self.global_rank != 0:
            return None
        if self._trainer is not None and not isinstance(self._trainer.progress_bar_callback, TQDMProgressBar):
            return PhaseLine(description, unit, total)  # no bar, or the rich one, which hides a tqdm bar
        return tqdm(desc=description, total=total, unit=unit, leave=False, dynamic_ncols=True)

    @torch.no_grad()
    def rollout_logprobs(
        self, rows: dict, temperature: float, reference: bool, batch_size: int | None = None
    ) -> torch.Tensor:
        """Log-probs of rollout completions without grad: ``[N, C]``, ``batch_size`` rows per pass
        (``None``: all at once).

        ``reference=True`` scores with the reference policy (the adapter
        disabled, or the frozen copy under full fine-tuning).
        """
        bar = self.show_progress(f"{'reference' if reference else 'old'} log-probs", len(rows["prompt_ids"]), "row")
        with self.reference_model() if reference else contextlib.nullcontext(self.policy) as model:
            was_training = model.training
            model.eval()
            logprobs = self.score_rollout(
                rows, lambda **part: completion_logprobs(model, **part, temperature=temperature)[0], batch_size, bar
            )
            model.train(was_training)
        return logprobs

    def score_rollout(self, rows: dict, score, batch_size: int | None = None, progress=None) -> torch.Tensor:
        """``score(**part)`` over the rollout's rows, ``batch_size`` at a time (``None``: all at once),
        concatenated on the CPU: ``[N, C]`` (``progress``: a bar advanced by the rows scored, closed at
        the end).

        ``part`` holds a micro-batch's ``prompt_ids``, ``prompt_mask``,
        ``completion_ids`` and ``completion_mask`` on the module's device, and
        ``completion_attention`` where the rollout has one (episodes).
        """
        size = batch_size or len(rows["prompt_ids"])
        keys = SCORED_KEYS + tuple(k for k in ("completion_attention",) if k in rows)
        out = []
        try:
            for start in range(0, rows["prompt_ids"].shape[0], size):
                part = {k: rows[k][start : start + size].to(self.device) for k in keys}
                out.append(score(**part).float().cpu())
                if progress is not None:
                    progress.update(len(out[-1]))
        finally:
            if progress is not None:
                progress.close()
        return torch.cat(out)  # [N, C]

    def _log_rollout_stats(self, batch: dict) -> None:
        """Log the rollout's statistics, which its first micro-batch carries (on every rank at once)."""
        if "rollout_stats" in batch:
            stats, self.rollout_samples = batch["rollout_stats"], batch["rollout_samples"]
            self.throughput.rollout(batch["rollout_counts"])
            self.rollout_seconds = {k.removeprefix("time/"): v for k, v in stats.items() if k.startswith("time/")}
            plain = {k: v for k, v in stats.items() if k not in MAX_STATS}
            self.log_reduced({k: plain.pop(k) for k in _ON_THE_BAR if k in plain}, prog_bar=True)
            self.log_reduced(plain)
            self.log_reduced({k: stats[k] for k in MAX_STATS}, op="max")

    def _log_step(self, metrics: dict, loss, rows: int) -> None:
        # Every rank reaches this in every step, also one whose rows were all skipped
        # (weight 0), so the reduction inside is a collective all ranks take part in.
        shown = {k: metrics[k] for k in _ON_THE_BAR if k in metrics}
        self.log_reduced({k: v for k, v in metrics.items() if k not in shown}, weight=rows)
        if shown:  # the same keys on every rank: the objective's settings decide them
            self.log_reduced(shown, weight=rows, prog_bar=True)
        # A policy-gradient loss is ~0 by construction (advantages are centred): logged, not shown.
        self.log_reduced({"train/loss": loss}, weight=rows, on_step=True)

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self.trainer.datamodule.begin_batch(batch["micro_batch"])

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
        super().on_fit_start()
        # Trainer.log_dir is a broadcast: asked once here, where every rank asks,
        # never in the epoch-end hooks that only rank 0 gets to write from.
        self.log_dir = self.trainer.log_dir
        # The peak and the bandwidth are measured on a CPU (cached after the first run): by rank 0
        # alone, so that ranks sharing the cores do not slow each other's probes, and broadcast.
        probed = (0.0, 0.0)
        if self.global_rank == 0:
            probed = (peak_flops(self.device, self.spec.cache_dir), peak_bandwidth(self.device, self.spec.cache_dir))
        peak, bandwidth = self.trainer.strategy.broadcast(probed, src=0)
        self.throughput = EpochThroughput(FlopModel.of(self.policy), peak, bandwidth)
        self.rollout_seconds: dict[str, float] = {}
        self.rollout_samples: list[tuple] = []  # the latest rollout's, written at the epoch's end

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self.phase_seconds = {}
        self.throughput.reset()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.EPISODES_REFUSED and getattr(self.trainer.datamodule, "episodes", None) is not None:
            raise ValueError(
                f"data.episodes.tools / data.episodes.environment with {type(self).__name__}: {self.EPISODES_REFUSED}"
            )
        sets = len(self.trainer.datamodule.val_sets()) if self.trainer.datamodule is not None else 1
        self.val_accuracy.extend(MeanMetric() for _ in range(sets - len(self.val_accuracy)))

    def on_train_start(self) -> None:
        check = getattr(self.engine, "check", None)  # a remote engine's servers, before any rollout
        if check is not None:
            check()
        super().on_train_start()
        # The epoch clock runs from one epoch's end to the next, so it includes the
        # rollout, which Lightning runs after on_train_epoch_start.
        self.epoch_started = time.perf_counter()

    @property
    def validates_before_training(self) -> bool:
        return self.hparams.validate_before_training

    def held_out_metrics(self) -> dict[str, float]:
        """Greedy accuracy on each held-out set (``val/accuracy``, ``val/<slice>/accuracy``), all ranks sharing
        the work (see :func:`greedy_accuracy`)."""
        datamodule = self.trainer.datamodule
        if not datamodule.val_rows:
            return {}
        sets = datamodule.val_sets()
        bar = self.show_progress("held-out prompts (greedy)", sum(len(rows) for rows in sets.values()), "prompt")
        try:
            return {name: greedy_accuracy(self, datamodule, rows, bar) for name, rows in sets.items()}
        finally:
            if bar is not None:
                bar.close()

    def on_train_epoch_end(self) -> None:
        # No collective here: only rank 0 reaches the progress bar's and our own
        # rank-0 work, so everything logged was reduced in the steps already.
        self._write_samples()
        metrics = self.trainer.callback_metrics
        summary = f"epoch {self.current_epoch}: reward {float(metrics.get('reward/total', float('nan'))):.3f}"
        if self.validated_step == self.global_step:  # this epoch validated (not an earlier one's figures)
            names = self.trainer.datamodule.val_sets()
            summary += "".join(f" | {name} {float(metrics[name]):.3f}" for name in names if name in metrics)
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
        answers, scores = answer_batch(self, self.trainer.datamodule, batch)
        metric = self.val_accuracy[dataloader_idx]
        metric.update(scores.to(self.device))
        name = list(self.trainer.datamodule.val_sets())[dataloader_idx]
        self.log(
            name,
            metric,
            on_step=False,
            on_epoch=True,
            prog_bar=True,
            batch_size=len(answers.texts),
            add_dataloader_idx=False,
            metric_attribute=f"val_accuracy.{dataloader_idx}",
        )
