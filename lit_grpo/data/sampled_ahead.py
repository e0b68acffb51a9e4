"""The on-policy DataModule's rollouts sampled ahead of training (``data.staleness: k``, see
:mod:`lit_grpo.rollout.ahead`): launching them with frozen weights, taking them, and keeping
the ones still pending across a checkpoint."""

from __future__ import annotations

import torch

from lit_grpo.rollout.ahead import Job, SamplingAhead
from lit_grpo.rollout.producer import ScoredRollout
from lit_grpo.training.distributed import gather_to_rank_zero


class SamplesAhead:
    """Mixin of :class:`~lit_grpo.data.grpo.OnPolicyDataModule`: its worker (``self.ahead``) and the
    rollouts a checkpoint had pending (``self.pending``)."""

    def _produce_ahead(self, epoch: int, rank: int) -> ScoredRollout:
        """Epoch ``epoch``'s rollout, sampled ahead; first launch what sampling ahead needs next."""
        self._start_ahead()
        last = epoch + self.hparams.staleness
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            last = min(last, self.trainer.max_epochs - 1)  # nothing past the run's end
        for later in range(epoch, last + 1):
            if later not in self.ahead.jobs:
                self._launch(later, self._my_prompts(rank), self.cursor.seed_of(later, rank))
        job, waits = self.ahead.take(epoch)
        # dynamic sampling's further rounds, if any, are sampled now, by the current weights
        return self._produce(
            rank,
            first=(job.request, job.rollout, job.version),
            stats=waits,
            generator=torch.Generator().manual_seed(self.cursor.seed_of(epoch, rank, -1)),
        )

    def _start_ahead(self) -> None:
        """Start the worker (refusing an engine that cannot sample beside training), and launch again
        the rollouts a checkpoint had pending."""
        if self.ahead is not None:
            return
        trainer = self.trainer
        engine = trainer.lightning_module.engine
        refusal = (
            engine.ahead_refusal()
            if hasattr(engine, "ahead_refusal")
            else (
                f"the {type(engine).__name__} samples in the weights training steps; use model.generation.backend "
                "native"
            )
        )
        if self.advantage_estimator == "gae":
            refusal = "PPO's loss has no correction for a sampler older than the trainer (its critic's GAE too)"
        if refusal:
            raise ValueError(f"data.staleness={self.hparams.staleness}: {refusal}; or set data.staleness 0.")
        self.ahead = SamplingAhead(self.producer.sample, abortable=trainer.world_size == 1)
        rank = trainer.global_rank
        for saved in self.pending:
            self._launch(
                saved["epoch"],
                saved["ranks"][rank],
                self.cursor.seed_of(saved["epoch"], rank),
                adapter=saved["adapter"],
                version=saved["version"],
            )
        self.pending = []

    def _launch(
        self, epoch: int, prompts: list[dict], seed: int, adapter: dict | None = None, version: int | None = None
    ) -> None:
        module = self.trainer.lightning_module
        self.ahead.launch(
            Job(
                epoch,
                self.producer.prepare(prompts),
                module.engine.frozen(adapter),
                seed,
                module.policy_version if version is None else version,
            )
        )

    def teardown(self, stage: str) -> None:
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None

    def on_exception(self, exception: BaseException) -> None:
        # Lightning runs no teardown hook after an error or a preemption: stop the worker here.
        self.teardown("fit")

    def _pending_state(self) -> list[dict]:
        """The rollouts sampling ahead, as a checkpoint stores them: epoch, policy version, frozen
        adapter weights and every rank's prompts (gathered to rank 0: a collective)."""
        trainer = self.trainer
        jobs = sorted(self.ahead.jobs.values(), key=lambda job: job.epoch) if self.ahead else []
        pending = [
            {
                "epoch": job.epoch,
                "version": job.version,
                "adapter": job.sampler.adapter,
                "rows": job.request.prompts,
            }
            for job in jobs
        ]
        pending += [{**saved, "rows": saved["ranks"][trainer.global_rank]} for saved in self.pending]
        ranks = gather_to_rank_zero([p["rows"] for p in pending], trainer.world_size)  # None off rank 0
        return [
            {
                "epoch": p["epoch"],
                "version": p["version"],
                "adapter": p["adapter"],
                "ranks": [rows[i] for rows in ranks or []],
            }
            for i, p in enumerate(pending)
        ]
