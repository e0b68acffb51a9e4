"""A merged view of the policy for decoding: the adapter folded into the weights.

Decoding runs the whole model once per new token on a few dozen rows, so its
cost is per-layer overhead and weight reads more than arithmetic. A LoRA
policy pays for its adapter in every adapted layer at every step (two extra
small matmuls, a scale and an add each): a tenth to a quarter of a decode
step on a CPU (docs/speed.md). :class:`MergedPolicy` holds an empty skeleton of the plain model and, for
one rollout at a time, fills it with ``W + scale * B @ A`` for the adapted
layers and the policy's own tensors (shared, not copied) for everything else.
The merged weights are freed when the rollout ends, so they never add to the
memory peak of the training step.

In another dtype (``bfloat16`` on hardware with bf16 matrix units) every
weight is cast for the rollout, which halves the bytes read per token. Samples
then come from a rounded copy of the policy while the objective scores them in
the policy's own precision; the importance ratio does not correct for that
small gap when ``pi_old`` is the current policy, as in every trainer that
samples with a separate inference engine.

Where the decoding weights are less precise than the adapter (bf16 weights,
an fp32 adapter: a ``bfloat16`` policy, or ``generation.dtype: bfloat16``),
the update is not folded in: ``W + delta`` rounded to bf16 loses every entry
of ``delta`` under half an ulp of ``W``, and a young adapter's update is a few
ulps at most, so the sampler would decode from the base model more than from
the policy (SmolLM2-135M learning the quickstart: ``sampler/kl`` grew from 0.002 to
0.032 over 40 epochs merged, against ~1e-9 in fp32). Those layers become :class:`LowRankLinear`:
the bf16 weight plus the adapter's factors in their own dtype, added before
rounding, which is the arithmetic of peft's own layer on the training side.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class MergedPolicy:
    """Merged, adapter-free copies of a policy, materialised per rollout.

    Which layers keep their update apart depends on the dtype the decode
    multiplies in: ``dtype``, else autocast's where autocast is on at the call
    (``precision="bf16-mixed"`` validates under it), else the weights' own; a
    skeleton is built per such dtype, at its first call.

    Args:
        policy: The trainable policy: a peft LoRA model, or a plain model
            (full fine-tuning; only worth it with another ``dtype``).
        dtype: Weight dtype for decoding; ``None`` keeps the policy's.
    """

    def __init__(self, policy: nn.Module, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.copies: dict[torch.dtype | None, _Skeleton] = {}
        self._skeleton(policy)  # for the autocast state at construction (the native engine's: none)

    def _skeleton(self, policy: nn.Module) -> _Skeleton:
        device = next(policy.parameters()).device.type
        multiplies = self.dtype or (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        if multiplies not in self.copies:
            self.copies[multiplies] = _Skeleton(policy, self.dtype, multiplies)
        return self.copies[multiplies]

    @contextlib.contextmanager
    def __call__(self, policy: nn.Module) -> Iterator[nn.Module]:
        """Yield the skeleton holding ``policy``'s current merged weights; free them on exit."""
        held = self._skeleton(policy)
        with torch.no_grad():
            weights = merged_weights(policy, apart=set(held.apart), dtype=self.dtype)
            if self.dtype is not None:
                weights = {name: w.to(self.dtype) for name, w in weights.items()}
            for name, layer in held.apart.items():
                weights[f"{name}.down"], weights[f"{name}.up"] = lora_factors(layer)
        held.model.load_state_dict(weights, strict=False, assign=True)
        try:
            yield held.model
        finally:
            held.model.load_state_dict(held.empty, strict=False, assign=True)


class _Skeleton:
    """The plain model's module tree on empty meta tensors, LoRA layers whose update
    rounding to ``multiplies`` would lose made :class:`LowRankLinear` (``apart``)."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype | None, multiplies: torch.dtype | None) -> None:
        # Copy the module tree only: every parameter becomes an empty meta tensor (the
        # memo makes deepcopy reuse it), so not even a transient copy of the weights is made.
        memo = {
            id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False) for p in policy.parameters()
        }
        model = copy.deepcopy(policy, memo)
        self.apart = low_rank_layers(policy, multiplies)
        if _is_peft(model):
            model = model.unload()  # the plain architecture, adapter layers removed
        for name, layer in self.apart.items():
            down, _ = lora_factors(layer)
            model.set_submodule(name, LowRankLinear(model.get_submodule(name), len(down), down.dtype))
        factors = {f"{name}.{factor}" for name in self.apart for factor in ("down", "up")}  # stay in their dtype
        self.empty = {
            name: torch.empty_like(p, dtype=p.dtype if name in factors else dtype or p.dtype)
            for name, p in model.named_parameters(remove_duplicate=False)
        }
        # nn.Module's train(), not transformers' override: that one re-applies hub kernels on a
        # mode change (transformers >= 5.25 turns them on at load), which fails on meta tensors.
        self.model = nn.Module.train(model.requires_grad_(False), False)


def merged_weights(
    policy: nn.Module, apart: set[str] = frozenset(), dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter of the plain model, by its name there (tied weights under each name).

    Adapted layers get ``W + delta`` for each active adapter, except those
    named in ``apart`` (plain-model module names), which keep ``W``; every
    other tensor is the policy's own (detached, no copy). The sum is rounded
    once, to ``dtype`` (the base weights' own by default): a bf16 base with an
    fp32 adapter merged for an fp32 decode keeps the whole update.
    """
    if not _is_peft(policy):
        return {name: p.detach() for name, p in policy.named_parameters(remove_duplicate=False)}
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    weights = {
        name.replace(".base_layer.", "."): p.detach()
        for name, p in base.named_parameters(remove_duplicate=False)
        if ".lora_" not in name
    }
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged and name not in apart:
            key = f"{name}.weight"
            weight = weights[key]
            for adapter in module.active_adapters:
                if adapter in module.lora_A or adapter in module.lora_embedding_A:
                    weights[key] = weights[key] + module.get_delta_weight(adapter)
            weights[key] = weights[key].to(dtype or weight.dtype)
    return weights


class LowRankLinear(nn.Module):
    """``x @ W.T + b`` plus a low-rank update ``(x @ down.T) @ up.T`` kept apart from ``W``.

    The update runs in its factors' dtype and is added before the result is
    rounded to ``W``'s, as peft's LoRA layer adds it (see the module docstring).

    Args:
        linear: The plain layer (its ``weight`` and ``bias`` are reused).
        rank: Rows of ``down`` (the adapters' ranks summed).
        dtype: The factors' dtype.
    """

    def __init__(self, linear: nn.Linear, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.down = nn.Parameter(torch.empty(rank, self.in_features, dtype=dtype, device="meta"), requires_grad=False)
        self.up = nn.Parameter(torch.empty(self.out_features, rank, dtype=dtype, device="meta"), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        return (out + F.linear(F.linear(x.to(self.down.dtype), self.down), self.up)).to(out.dtype)


def low_rank_layers(policy: nn.Module, dtype: torch.dtype | None) -> dict:
    """The LoRA linear layers, by plain-model name, whose update would be lost to
    rounding if merged into weights of ``dtype`` (the weights' own if ``None``):
    those where that dtype is less precise than the adapter's. Plain LoRA on
    ``nn.Linear`` only (other layers merge)."""
    if not _is_peft(policy):
        return {}
    from peft.tuners.lora import Linear as LoraLinear

    layers = {}
    for name, module in policy.get_base_model().named_modules():
        adapters = [a for a in module.active_adapters if a in module.lora_A] if isinstance(module, LoraLinear) else []
        if (
            not adapters
            or module.merged
            or module.fan_in_fan_out
            or module.lora_variant
            or type(module.base_layer) is not nn.Linear
            or any(module.lora_B[a].bias is not None for a in adapters)
        ):
            continue
        weights, adapter = dtype or module.base_layer.weight.dtype, module.lora_A[adapters[0]].weight.dtype
        if torch.finfo(weights).eps > torch.finfo(adapter).eps:
            layers[name] = module
    return layers


def lora_factors(layer) -> tuple[Tensor, Tensor]:
    """``down [r, in]`` and ``up [out, r]`` of a peft LoRA linear layer's active
    adapters, stacked along the rank, the scale folded into ``up``: the update is
    ``up @ down``."""
    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    down = torch.cat([layer.lora_A[a].weight.detach() for a in adapters])
    up = torch.cat([layer.lora_B[a].weight.detach() * layer.scaling[a] for a in adapters], dim=1)
    return down, up


def trained_weight_names(policy: nn.Module) -> set[str]:
    """The plain-model names in :func:`merged_weights` that training changes: the
    adapted layers' weights under LoRA, every trainable tensor without an adapter."""
    if not _is_peft(policy):
        return {name for name, p in policy.named_parameters(remove_duplicate=False) if p.requires_grad}
    from peft.tuners.lora import LoraLayer

    return {
        f"{name}.weight" for name, module in policy.get_base_model().named_modules() if isinstance(module, LoraLayer)
    }


def can_merge(policy: nn.Module) -> bool:
    """Whether :class:`MergedPolicy` reproduces ``policy``: plain weights, plain LoRA (no DoRA)."""
    if any(
        getattr(p, "quant_state", None) is not None or p.dtype in (torch.uint8, torch.int8) for p in policy.parameters()
    ):
        return False  # 4-bit/8-bit weights: merging would re-quantize them
    if not _is_peft(policy):
        return True
    from peft.tuners.lora import LoraLayer

    return all(not any(module.use_dora.values()) for module in policy.modules() if isinstance(module, LoraLayer))


def _is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)
