"""Fewer saved activations for the training passes, the same forward arithmetic.

What a policy's backward keeps from its forward is most of a GRPO step's peak
memory at long completions (``docs/speed.md``, "Peak memory"). Two copies
that autograd keeps by default are not needed:

* **The gated MLP's activation.** ``down(silu(gate(x)) * up(x))`` keeps
  ``gate(x)``, ``silu(gate(x))`` and ``up(x)``: the product's backward wants
  both of its factors and the SiLU's backward its input. :func:`recompute_swiglu`
  keeps ``gate(x)`` and ``up(x)`` only and recomputes the SiLU in the backward,
  with the same operations in the same order, so forward and gradients are
  bitwise those of the default (a test); a third of the MLP's saved
  activations goes.
* **The adapters' input casts in a bf16 model with an fp32 stream.** Under
  autocast each LoRA ``A`` matrix casts its fp32 input to bf16 and keeps the
  cast for its weight's gradient, so the query, key and value adapters keep
  three copies of one normed input, the gate and up adapters two.
  :func:`share_adapter_input_casts` casts once per input and hands the same
  bf16 tensor to every adapter that reads it. The forward is unchanged bit
  for bit; in the backward the adapters' gradients with respect to that
  input are summed in bf16 before they join the base layers' in fp32, a
  rounding of the adapters' share of that gradient only.

:func:`~lit_grpo.model.policy.build_policy` applies both.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

_SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' (the same function)


class _SiluMul(torch.autograd.Function):
    """``silu(gate) * up``, keeping ``gate`` and ``up`` and recomputing the SiLU in the backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        # autograd's own: the product's backward (grad * other), then SiLU's on its input
        return torch.ops.aten.silu_backward(grad * up, gate), grad * nn.functional.silu(gate)


def _swiglu_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(_SiluMul.apply(mlp.gate_proj(x), mlp.up_proj(x)))


def recompute_swiglu(model: nn.Module) -> int:
    """Recompute the SiLU of every gated MLP in the backward instead of keeping it.

    A module counts as a gated MLP when its class is a transformers ``...MLP``
    with ``gate_proj``, ``up_proj`` and ``down_proj`` and a SiLU ``act_fn``
    (Llama, Qwen2/3, Mistral, SmolLM2: ``down(silu(gate(x)) * up(x))``);
    others are left as they are. Call it before any peft wrapping
    or after: the projections are called, not read.

    Args:
        model: A transformers model.

    Returns:
        How many MLPs were changed.
    """
    changed = 0
    for module in model.modules():
        if not all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")):
            continue
        silu = type(getattr(module, "act_fn", None)).__name__ in _SILU
        if not silu or not type(module).__name__.endswith("MLP") or getattr(module, "_swiglu_recomputed", False):
            continue
        module.forward = functools.partial(_swiglu_forward, module)  # a partial pickles and deep-copies
        module._swiglu_recomputed = True
        changed += 1
    return changed


def _nothing() -> None:
    return None


class _CastOnce:
    """A forward pre-hook for the adapters of one decoder layer: one bf16 cast per fp32 input.

    It holds its input and the cast by weak reference only, so it keeps nothing
    alive (a pass cut short, as gradient checkpointing's early-stopping
    recomputation is, leaves nothing behind) and a tensor freed and replaced
    at the same address never matches.
    """

    def __init__(self) -> None:
        self.source = self.cast = _nothing
        self.key: tuple | None = None

    def __getstate__(self) -> dict:  # a pickled or copied model starts with an empty cache
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        x = args[0]
        device = x.device.type
        if x.dtype != torch.float32 or not torch.is_autocast_enabled(device):
            return None
        dtype = torch.get_autocast_dtype(device)
        key = (x._version, dtype, torch.is_grad_enabled())
        cast = self.cast()
        if cast is None or self.source() is not x or self.key != key:
            cast = x.to(dtype)
            self.source, self.cast, self.key = weakref.ref(x), weakref.ref(cast), key
        return (cast, *args[1:])


def share_adapter_input_casts(policy: nn.Module) -> int:
    """Let the LoRA adapters of each decoder layer share one bf16 cast of an input they all read.

    Only acts under autocast on fp32 inputs (a half-precision model with an fp32
    residual stream, :mod:`lit_grpo.model.stream`); elsewhere the hooks pass
    their input through.

    Args:
        policy: A peft model whose base has ``get_decoder().layers``.

    Returns:
        How many adapter matrices share a layer's cast.
    """
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    hooked = 0
    for layer in getattr(decoder, "layers", ()):
        cache = _CastOnce()
        for module in layer.modules():
            if isinstance(module, LoraLayer):
                for lora_a in module.lora_A.values():
                    lora_a.register_forward_pre_hook(cache)
                    hooked += 1
    return hooked
