"""Sampling ahead of training: rollout n+k is generated while rollout n trains (``data.staleness: k``).

Generation is most of a GRPO step, and it does not have to wait for the
optimizer: TRL's asynchronous GRPO, verl's one-step-off and fully async modes
and AReaL all sample the next rollouts with slightly older weights while the
trainer works. Here a worker thread decodes with a *frozen* sampler
(:meth:`~lit_grpo.generation.native.NativeEngine.frozen`: a merged copy of the
weights as they were when its job was launched) while the training thread
steps the live adapter; prompts are drawn, tokenized and, after sampling,
scored on the training thread. At epoch n the DataModule launches the job for
epoch n+k with the current weights and takes epoch n's (launched k epochs
earlier), so every rollout is sampled by weights k rollouts old (epochs
0..k-1 by the first weights). The loss then anchors its ratio at the current
weights' log-probs and corrects for the sampler with truncated importance
sampling (:attr:`~lit_grpo.generation.GenerationSpec.importance_sampling_cap`).

Every job is a pure function of its prompts, the frozen weights and the seed
of ``(seed, epoch, rank)``, so a checkpoint stores the jobs still pending
(their prompts and frozen adapter weights) and a resumed run samples them
again, bit for bit.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from lit_grpo.generation.rollout import Rollout
from lit_grpo.rollout.producer import Request
from lit_grpo.training.preemption import abortable, check_abort


@dataclass
class Job:
    """One rollout to sample ahead: epoch ``epoch``'s prompts, by the weights of ``version``."""

    epoch: int
    request: Request
    sampler: object  # a FrozenSampler
    seed: int
    version: int
    launched: float = field(default_factory=time.perf_counter)
    idle: float = 0.0  # seconds the worker waited for this job (for the weights it samples with)
    dropped: bool = False
    started: float | None = None
    finished: float | None = None
    rollout: Rollout | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class SamplingAhead:
    """A worker thread that samples launched jobs in order, and the jobs still to be taken.

    Args:
        sample: ``(request, sampler, generator) -> Rollout``.
        abortable: Whether a stop request (SIGTERM) may abandon a job in the
            middle (one process; under several the ranks must finish theirs).
    """

    def __init__(self, sample, abortable: bool) -> None:
        self.sample, self.abortable = sample, abortable
        self.jobs: dict[int, Job] = {}  # epoch -> job, launched and not yet taken
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.last_finished: float | None = None
        self.cancelled = threading.Event()  # set by close(): the job running stops at its next decoding step
        self.worker = threading.Thread(target=self._work, name="lit-grpo-sampling-ahead", daemon=True)
        self.worker.start()

    def launch(self, job: Job) -> None:
        """Queue ``job`` (its sampler frozen already)."""
        self.jobs[job.epoch] = job
        self.queue.put(job)

    def take(self, epoch: int) -> tuple[Job, dict[str, float]]:
        """Wait for epoch ``epoch``'s job; return it with the seconds the trainer waited and the
        seconds the sampler waited for its weights (idle before the job was launched).

        A stop request on one process abandons the wait; the job then stays pending.
        """
        job = self.jobs[epoch]
        start = time.perf_counter()
        with abortable(self.abortable):
            while not job.done.wait(0.1):
                check_abort()
            if job.error is not None:
                raise job.error
        del self.jobs[epoch]
        job.sampler.close()
        return job, {"time/rollout_wait": time.perf_counter() - start, "time/sampler_waited_for_weights": job.idle}

    def drop(self, epochs) -> None:
        """Forget the jobs of ``epochs`` (launched by a rollout that was abandoned)."""
        for epoch in epochs:
            job = self.jobs.pop(epoch, None)
            if job is not None:
                job.dropped = True  # the worker frees it, or here if it is done with it
                if job.done.is_set():
                    job.sampler.close()

    def close(self) -> None:
        """Stop the worker (the job it is on at its next decoding step) and wait for it; free every
        frozen sampler. A worker thread left running would end the process in C++ at its exit."""
        self.drop(list(self.jobs))
        self.cancelled.set()
        self.queue.put(None)
        self.worker.join()

    def _work(self) -> None:
        while (job := self.queue.get()) is not None:
            if not job.dropped:
                job.started = time.perf_counter()
                job.idle = max(0.0, job.started - max(job.launched, self.last_finished or job.launched))
                try:
                    with abortable(self.abortable, cancel=self.cancelled):
                        generator = torch.Generator().manual_seed(job.seed)
                        job.rollout = self.sample(job.request, job.sampler, generator)
                except BaseException as error:  # handed to the training thread by take()
                    job.error = error
                job.finished = self.last_finished = time.perf_counter()
            if job.dropped:
                job.sampler.close()
            job.done.set()
