"""Which Lightning strategies lit_grpo trains under, checked before any weights load.

A rollout calls the policy directly, outside the LightningModule's forward,
once per new token. Under FSDP2 (Lightning's ``ModelParallelStrategy``, whose
``configure_model`` hook applies ``fully_shard``),
:func:`lit_grpo.training.distributed.gathered` unshards the weights for the rollout.
Lightning's ``FSDPStrategy`` (FSDP1) and DeepSpeed's ZeRO-3 gather shards only
inside their wrapper's forward, so a rollout there would decode with weights
it cannot read; :func:`check_strategy` refuses them at setup with a line that
says what to use instead. DDP and a single device keep whole weights on every
rank and need nothing.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

_MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"
# Lightning imports deepspeed only when a DeepSpeedStrategy is built, so naming the class here is free.
_REFUSED = {
    FSDPStrategy: f"lit_grpo shards with FSDP2 through {_MODEL_PARALLEL} (see configs/fsdp.yaml); FSDPStrategy's "
    "FSDP1 gathers weights only inside the model's forward, and rollouts decode outside it.",
    DeepSpeedStrategy: f"use strategy=ddp, or shard with FSDP2 through {_MODEL_PARALLEL} (see configs/fsdp.yaml); "
    "ZeRO-3 gathers weights only inside the engine's forward, and rollouts decode outside it.",
}


def check_strategy(trainer) -> None:
    """Refuse a strategy lit_grpo cannot train under: Lightning's ``FSDPStrategy``, DeepSpeed.

    Args:
        trainer: The Trainer about to fit; only ``trainer.strategy`` is read.

    Raises:
        ValueError: One line naming the strategy and what to use instead.
    """
    strategy = trainer.strategy
    for refused, advice in _REFUSED.items():
        if isinstance(strategy, refused):
            raise ValueError(f"trainer.strategy={type(strategy).__name__} is not supported: {advice}")
