"""A callback for tests/test_chaos.py: SIGKILL its own process at one chosen moment
(or, for tests/test_preemption.py, send it SIGTERM there and let it go on).

Each phase is a real point in a run: inside a rollout's decoding loop, inside
``backward``, half-way through writing a checkpoint file, between a sharded
checkpoint's shards and its ``meta.pt``, before an optimizer step, and half-way
through writing the exported adapter. Also the reward the
chaos runs train on (the tiny random model never answers right).
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import lightning as L
import lightning.pytorch.strategies.model_parallel as model_parallel
import peft.peft_model
import torch
from safetensors.torch import save as safetensors_bytes

import lit_grpo.generation.rollout
import lit_grpo.training.checkpointing


def letter_share(prompts, completions, **columns):
    return [sum(ch.isalpha() for ch in text) / max(len(text), 1) for text in completions]


GROUP = [False]  # Chaos(group=True): kill every rank of the run at once (its process group)
SIGNAL = [signal.SIGKILL]  # Chaos(signal=...): what strikes
STRUCK = [False]


def die() -> None:
    if SIGNAL[0] != signal.SIGKILL:  # a signal the run handles: send it once and go on
        if not STRUCK[0]:
            STRUCK[0] = True
            os.kill(os.getpid(), SIGNAL[0])
        return
    if GROUP[0]:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def write_half_then_die(write_whole, f) -> None:
    """Write the first half of what ``write_whole(buffer)`` serialises to ``f``, sync it, die."""
    buffer = io.BytesIO()
    write_whole(buffer)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    die()


class Chaos(L.Callback):
    """Kill this process at ``phase`` in ``epoch``, at micro-batch / decoding step / global step ``index``.

    Args:
        phase: ``rollout`` (decoding step ``index`` of the epoch's rollout),
            ``backward`` (inside backward of micro-batch ``index``),
            ``optimizer`` (before the optimizer step after micro-batch ``index``),
            ``checkpoint`` (half-way through writing the checkpoint of global
            step ``index``), ``sharded_checkpoint`` (under ModelParallelStrategy,
            after every rank wrote its shards of ``last.ckpt`` at global step
            ``index``, before rank 0 writes its ``meta.pt``), ``export`` (half-way
            through the adapter file), ``validation`` (before validation batch ``index``).
        epoch: The epoch in which to strike (not used by ``checkpoint``/``export``).
        index: See ``phase``.
        group: Kill the whole process group (every rank of a multi-process run started in a
            session of its own), not only this process.
        strike: ``SIGKILL``, or ``SIGTERM``/``SIGINT``: sent to this process once, which runs on.
        rank: Strike on this rank only (``None``: on every rank).
    """

    def __init__(
        self,
        phase: str,
        epoch: int = 0,
        index: int = 0,
        group: bool = False,
        strike: str = "SIGKILL",
        rank: int | None = None,
    ) -> None:
        self.phase, self.epoch, self.index, self.rank = phase, epoch, index, rank
        self.batch_idx = -1
        GROUP[0] = group
        SIGNAL[0] = getattr(signal, strike)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.rank is not None and trainer.global_rank != self.rank:
            self.phase = "none"
        if self.phase == "rollout":
            sample, draws = lit_grpo.generation.rollout.sample, []

            def counting_sample(probs, generator=None):
                if trainer.current_epoch == self.epoch:
                    draws.append(1)
                    if len(draws) > self.index:
                        die()
                return sample(probs, generator)

            lit_grpo.generation.rollout.sample = counting_sample
        elif self.phase == "checkpoint":
            save = torch.save

            def half_save(obj, f, *args, **kwargs):
                if trainer.global_step == self.index:
                    write_half_then_die(lambda buffer: save(obj, buffer, *args, **kwargs), f)
                save(obj, f, *args, **kwargs)

            lit_grpo.training.checkpointing.torch.save = half_save  # the torch.save of atomic_torch_save
        elif self.phase == "sharded_checkpoint":
            shards = model_parallel._distributed_checkpoint_save

            def shards_then_die(state, path):
                shards(state, path)
                if trainer.global_step == self.index and "last.ckpt" in Path(path).name:
                    die()

            model_parallel._distributed_checkpoint_save = shards_then_die
        elif self.phase == "export":

            def half_save_file(tensors, filename, metadata=None):
                with open(filename, "wb") as f:
                    write_half_then_die(lambda buffer: buffer.write(safetensors_bytes(tensors, metadata)), f)

            peft.peft_model.safe_save_file = half_save_file

    def _here(self, trainer: L.Trainer, phase: str) -> bool:
        return self.phase == phase and trainer.current_epoch == self.epoch and self.batch_idx == self.index

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch_idx = batch_idx

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._here(trainer, "backward"):
            parameter = next(p for p in pl_module.parameters() if p.requires_grad)
            parameter.register_hook(lambda grad: die())  # fires while backward runs

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._here(trainer, "optimizer"):
            die()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.phase == "validation" and trainer.current_epoch == self.epoch and batch_idx == self.index:
            die()
