"""PolicyModule: what every objective's LightningModule shares about the policy.

GRPO and DPO train the same thing, a causal LM through a (Q)LoRA adapter whose
frozen base weights are the reference policy, and differ only in the loss.
This base class owns that shared part: loading the policy once in
``configure_model``, the reference model, the optimizer over the trainable
weights with the non-finite-gradient guard, checkpoints that hold only the
trainable weights, and exporting the adapter. Subclasses add the objective.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lit_grpo.distributed import shard
from lit_grpo.policy import PolicySpec, build_policy, load_tokenizer
from lit_grpo.training_guard import NonFiniteGuard


class PolicyModule(L.LightningModule):
    """Base class: a policy with its reference, optimizer and checkpoints.

    Subclasses call ``super().__init__(...)`` first, then
    ``self.save_hyperparameters(...)`` with their own arguments.

    Args:
        policy: Which model to train, its adapter, quantization and dtype.
        optimizer: Optimizer factory over the trainable parameters; ``None``
            gives AdamW with lr 1e-4 and no weight decay.
        scheduler: Optional learning-rate scheduler factory (stepped per
            optimizer step).
        max_nonfinite_steps: Consecutive optimizer steps with a NaN/inf
            gradient that are skipped before training stops with an error.
    """

    def __init__(
        self,
        policy: PolicySpec | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        max_nonfinite_steps: int = 3,
    ) -> None:
        super().__init__()
        self.spec = policy or PolicySpec()
        self.tokenizer = load_tokenizer(self.spec)
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.guard = NonFiniteGuard(max_nonfinite_steps)
        # Checkpoints hold only the trainable weights: the frozen base is reloaded
        # from its source. Filtering state_dict() itself, not just the saved dict,
        # keeps sharded (DCP) resume under ModelParallelStrategy working too: it
        # loads exactly the keys this module's state_dict() lists.
        self.register_state_dict_post_hook(_keep_trainable)
        self.strict_loading = False
        self.phase_seconds: dict[str, float] = {}

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Load the policy once (Lightning may call this more than once); shard it under FSDP2."""
        if self.policy is None:
            self.policy, self.reference = build_policy(self.spec, need_reference=self.needs_reference)
        if self.device_mesh is not None:  # ModelParallelStrategy
            for model in (self.policy, self.reference):
                if model is not None:
                    shard(model, self.device_mesh)

    @property
    def needs_reference(self) -> bool:
        """Whether the objective reads the reference policy (full fine-tuning then keeps a copy)."""
        return True

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module]:
        """Yield the reference policy in eval mode: the policy with its adapter
        disabled, or the frozen copy under full fine-tuning."""
        if self.reference is not None:
            yield self.reference
            return
        was_training = self.policy.training
        self.policy.eval()  # the reference is a fixed function: no adapter dropout
        try:
            with self.policy.disable_adapter():
                yield self.policy
        finally:
            self.policy.train(was_training)

    # -------------------------------------------------------------- optimizer
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def configure_optimizers(self):
        params = self.trainable_parameters()
        optimizer = (
            self.optimizer_factory(params) if self.optimizer_factory
            else torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        )
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Step only when the gradient is finite (see :class:`NonFiniteGuard`)."""
        optimizer_closure()
        if not self.guard.check(self.trainable_parameters()):
            optimizer.zero_grad(set_to_none=True)
            return
        start = time.perf_counter()
        optimizer.step()
        self._add_time("optimizer", time.perf_counter() - start)

    def _add_time(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    # ------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["nonfinite_guard"] = self.guard.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.configure_model()
        self.guard.load_state_dict(checkpoint.get("nonfinite_guard", {}))

    def export_adapter(self, path: str | Path) -> Path:
        """Write the trained policy as a standard PEFT adapter folder (+ tokenizer).

        ``PeftModel.from_pretrained(base_model, path)`` reloads it. Under full
        fine-tuning the whole model is written instead.
        """
        path = Path(path)
        self.policy.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path


def _keep_trainable(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict`` post-hook: drop everything but trainable parameters."""
    trainable = {prefix + name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    for key in [k for k in state_dict if k.startswith(prefix) and k not in trainable]:
        del state_dict[key]
