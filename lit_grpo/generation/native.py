"""The native engine: our KV-cache decode loop on the policy or on its merged weights."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lit_grpo.generation.merged import MergedPolicy, can_merge
from lit_grpo.generation.rollout import Rollout, SamplingSpec, generate
from lit_grpo.model.policy import DTYPES
from lit_grpo.training.distributed import gathered


class NativeEngine:
    """Samples with :func:`lit_grpo.generation.rollout.generate` (see :mod:`lit_grpo.generation`).

    It reads the live policy at every call, so there is nothing to push after
    an optimizer step: with ``merge`` the merged copy is rebuilt per rollout.

    Args:
        spec: The generation settings (``merge``, ``dtype``).
        module: The training module: its ``policy``, ``tokenizer``, ``spec``
            and ``device_mesh`` are read.
    """

    def __init__(self, spec, module) -> None:
        self.spec, self.module = spec, module
        self.merged: MergedPolicy | None = None  # built at the first call, on the policy's device
        self.merges = spec.merge and module.merges_for_generation

    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        sampling: SamplingSpec,
        *,
        greedy: bool = False,
        repeat: int | None = None,
        progress=None,
        episodes=None,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        with self.model() as model:
            return generate(
                model,
                self.module.tokenizer,
                prompt_ids,
                prompt_mask,
                sampling,
                greedy=greedy,
                repeat=repeat,
                generator=generator,
                progress=progress,
                episodes=episodes,
            )

    def ahead_refusal(self) -> str | None:
        """Why this engine cannot sample while the policy trains (:meth:`frozen`), or ``None``."""
        module = self.module
        if module.device_mesh is not None:
            return "an FSDP2-sharded policy decodes through its shards, which training holds"
        if module.spec.lora is None:
            return "full fine-tuning has no adapter to freeze a copy of (train a LoRA adapter)"
        if not (self.merges and can_merge(module.policy)):
            return (
                "sampling beside training decodes a merged copy of the weights, which this policy has none of "
                "(QLoRA, DoRA, model.generation.merge=false, or PPO's shared critic)"
            )
        return None

    def frozen(self, adapter: dict[str, Tensor] | None = None) -> FrozenSampler:
        """A sampler on a merged copy of the policy as it is now, which later optimizer steps leave alone.

        Args:
            adapter: Trainable weights to freeze instead of the current ones
                (a :attr:`FrozenSampler.adapter` saved in a checkpoint).
        """
        policy = self.module.policy
        current = adapter_state(policy)
        if adapter is not None:
            load_trainable(policy, adapter)
        try:
            merged = MergedPolicy(policy, DTYPES[self.spec.dtype] if self.spec.dtype else None)
            held = merged(policy)
            model = held.__enter__()
        finally:
            if adapter is not None:
                load_trainable(policy, current)
        return FrozenSampler(model, held, copy.deepcopy(self.module.tokenizer), adapter or current)

    @contextlib.contextmanager
    def model(self) -> Iterator[nn.Module]:
        """The model to decode with: the merged policy when it applies, else the
        policy itself with its FSDP2 shards gathered once for all decoding steps."""
        module, dtype = self.module, self.spec.dtype
        policy = module.policy
        if self.merged is None and self.merges and module.device_mesh is None and can_merge(policy):
            # Full fine-tuning has nothing to merge: a copy only pays in another dtype.
            if dtype is not None or module.spec.lora is not None:
                self.merged = MergedPolicy(policy, DTYPES[dtype] if dtype else None)
        if self.merged is not None:
            with self.merged(policy) as model:
                yield model
            return
        with gathered(policy):
            yield policy

    def weights_changed(self) -> None:
        pass  # the next call reads the policy as it is then

    def close(self) -> None:
        self.merged = None


class FrozenSampler:
    """Decodes with a merged copy of the policy frozen at one version (:meth:`NativeEngine.frozen`).

    Safe to run in another thread while the policy trains: it reads no tensor
    that training writes (the merged layers are new tensors, the rest frozen
    base weights), and it has its own tokenizer.

    Attributes:
        adapter: The trainable weights it was frozen from (CPU copies), to
            rebuild it after a resume.
    """

    def __init__(self, model: nn.Module, held, tokenizer, adapter: dict[str, Tensor]) -> None:
        self.model, self.held, self.tokenizer, self.adapter = model, held, tokenizer, adapter

    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        sampling: SamplingSpec,
        *,
        greedy: bool = False,
        repeat: int | None = None,
        progress=None,
        episodes=None,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        return generate(
            self.model,
            self.tokenizer,
            prompt_ids,
            prompt_mask,
            sampling,
            greedy=greedy,
            repeat=repeat,
            generator=generator,
            progress=progress,
            episodes=episodes,
        )

    def close(self) -> None:
        """Free the merged weights."""
        if self.held is not None:
            self.held.__exit__(None, None, None)
            self.held = self.model = None


def adapter_state(policy: nn.Module) -> dict[str, Tensor]:
    """CPU copies of the policy's trainable weights, by parameter name."""
    return {name: p.detach().to("cpu", copy=True) for name, p in policy.named_parameters() if p.requires_grad}


def load_trainable(policy: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (:func:`adapter_state`'s) into the policy's trainable weights."""
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if name in state:
                p.copy_(state[name])
