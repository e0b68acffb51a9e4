"""Half-precision weights, a float32 residual stream.

A ``bfloat16`` policy stores its frozen base weights in bf16, which halves
their memory and puts the matmuls on the bf16 units. Left alone, transformers
then runs the whole model in bf16, residual stream included: each layer adds
its output to a bf16 sum, rounded to 8 bits of the running total.

:func:`keep_stream_fp32` gives a half-precision model bf16-mixed's arithmetic
on its half-precision weights: the input embedding's output is cast to fp32,
so every residual sum and norm is fp32, and the model's forward runs under
autocast in the weights' dtype, so each matmul casts its input to bf16 and
multiplies on the fast units. Nothing is copied: the weights stay as stored.
Measured on the embedded SmolLM2-135M (``docs/speed.md``): log-probs a third
closer to fp32's, 14-20% less peak memory in a GRPO step (peft keeps no fp32
copies of the adapted layers' inputs under autocast), 3-18% slower training
passes; the quickstart learnt no better over 3 seeds than with a bf16 stream.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

HALF = (torch.bfloat16, torch.float16)


def keep_stream_fp32(model: nn.Module) -> nn.Module:
    """Run a half-precision causal LM with an fp32 residual stream (no-op for fp32 models).

    The input embedding's output is cast to fp32, and the model's forward (and
    its decoder's, which reward and value heads call directly) runs under
    autocast in the embedding weight's dtype at the call (none once it holds
    fp32 weights: an fp32 decoding copy). A call already under autocast keeps
    the caller's.

    Args:
        model: A transformers model (a ``...ForCausalLM`` or
            ``...ForSequenceClassification``), before any peft wrapping.

    Returns:
        ``model``, changed in place.
    """
    if model.get_input_embeddings().weight.dtype not in HALF or getattr(model, "_stream_fp32", False):
        return model
    model.get_input_embeddings().register_forward_hook(_to_fp32)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for module in {model, decoder} - {None}:
        # The class's forward, wrapped where it is looked up: a `with` block ends autocast on any exit
        # (hooks would miss a KeyboardInterrupt), and a deep copy of the model wraps its own copy.
        wrapped = functools.partial(_in_autocast, type(module).forward, module)
        wrapped.__signature__ = inspect.signature(module.forward)  # transformers reads forward's parameters
        module.forward = wrapped
    model._stream_fp32 = True
    return model


def _to_fp32(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def _in_autocast(forward, module: nn.Module, *args, **kwargs):
    weight = module.get_input_embeddings().weight
    device = weight.device.type
    if weight.dtype not in HALF or torch.is_autocast_enabled(device):
        return forward(module, *args, **kwargs)
    with torch.autocast(device, dtype=weight.dtype):
        return forward(module, *args, **kwargs)
