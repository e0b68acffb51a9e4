"""Worker of tests/test_distributed.py: fit a tiny model on 2 CPU processes (gloo).

The test starts it as a subprocess; Lightning's launcher starts it again for
rank 1. Every rank writes what the test checks to ``OUT/<run>-rank<r>.json``
(losses per epoch, synced metrics, checksums of its trainable weights) and,
for DDP, its trainable weights to ``OUT/<run>-rank<r>.pt``.

``--strategy fsdp`` also saves a sharded checkpoint every epoch, then fits
again in a fresh Trainer from the first epoch's checkpoint (run ``resumed``),
which must replay the second epoch exactly. ``--strategy ddp`` saves a
checkpoint after every step and fits again from the one saved inside epoch 0
(run ``ddp-resumed``), which must end with the same weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import PolicySpec


def text_length(prompts: list[str], completions: list, **columns) -> list[float]:
    # A random tiny model never answers correctly; its completions' lengths
    # still differ within a group, which gives non-zero advantages to learn from.
    # With tools a completion is an episode's messages: the last one's text counts.
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


class Recorder(L.Callback):
    """Collects, per rank, what the test compares across ranks and runs."""

    def __init__(self, out: Path, run: str) -> None:
        self.out, self.run = out, run
        self.record: dict = {"epochs": [], "losses": {}, "saved": {}}

    def on_train_start(self, trainer, module) -> None:
        self.record["start_checksum"] = checksum(module)

    def on_train_epoch_start(self, trainer, module) -> None:
        self.record["epochs"].append(trainer.current_epoch)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.record["losses"].setdefault(str(trainer.current_epoch), []).append(float(outputs["loss"]))

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        self.record["saved"][str(trainer.current_epoch)] = checksum(module)

    def on_train_end(self, trainer, module) -> None:
        self.record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        name = f"{self.run}-rank{trainer.global_rank}"
        (self.out / f"{name}.json").write_text(json.dumps(self.record))
        if not isinstance(trainer.strategy, ModelParallelStrategy):
            trainable = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
            torch.save(trainable, self.out / f"{name}.pt")


def checksum(module) -> list[float]:
    """Sums of this rank's (shards of the) trainable weights and their Adam moments."""
    sums = [0.0, 0.0]
    optimizer = module.trainer.optimizers[0]
    for p in module.trainable_parameters():
        moments = optimizer.state.get(p, {})
        for i, tensor in enumerate((p, moments.get("exp_avg"))):
            if tensor is not None:
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                sums[i] += float(local.detach().double().sum())
    return sums


def fit(args, run: str, max_epochs: int, ckpt_path: str | None = None) -> None:
    torch.manual_seed(0)
    fsdp = args.strategy == "fsdp"
    module = GRPOModule(policy=PolicySpec(name_or_path=args.model), beta=0.04, progress=False, log_samples=0)
    data = OnPolicyDataModule(
        prompts_per_epoch=2,
        batch_size=2,
        held_out=HeldOutSpec(size=2, batch_size=1),
        source=SourceSpec(train_size=8),
        sampling=SamplingSpec(group_size=4, max_new_tokens=3),
        rewards=[text_length],
    )
    callbacks: list[L.Callback] = [Recorder(args.out, run)]
    if fsdp:
        callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpt", filename="{epoch}", save_top_k=-1))
    else:  # after every step: each rank trains 2 micro-batches per epoch, so step 1 is inside epoch 0
        callbacks.append(
            ModelCheckpoint(dirpath=args.out / "ckpt", filename="{epoch}-{step}", save_top_k=-1, every_n_train_steps=1)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=max_epochs,
        strategy=ModelParallelStrategy() if fsdp else "ddp",
        reload_dataloaders_every_n_epochs=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=args.out,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    fit(args, args.strategy, max_epochs=2)
    if args.strategy == "fsdp":
        fit(args, "resumed", max_epochs=2, ckpt_path=str(args.out / "ckpt" / "epoch=0.ckpt"))
    else:
        fit(args, "ddp-resumed", max_epochs=2, ckpt_path=str(args.out / "ckpt" / "epoch=0-step=1.ckpt"))


if __name__ == "__main__":
    main()
