"""The native engine: our KV-cache decode loop on the policy or on its merged weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

from lit_grpo.training.distributed import gathered
from lit_grpo.generation.merged import MergedPolicy, can_merge
from lit_grpo.generation.rollout import Rollout, SamplingSpec, generate
from lit_grpo.model.policy import DTYPES


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

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingSpec, *,
                 greedy: bool = False, repeat: int | None = None, progress=None, episodes=None) -> Rollout:
        with self.model() as model:
            return generate(model, self.module.tokenizer, prompt_ids, prompt_mask, sampling,
                            greedy=greedy, repeat=repeat, progress=progress, episodes=episodes)

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
