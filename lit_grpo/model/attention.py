"""``sdpa_gqa``: transformers' SDPA attention with grouped-query attention left to the kernel.

transformers' ``sdpa`` attention copies every key/value head once per query
head it serves (``repeat_kv``) whenever a multi-token pass carries an
attention mask, and on a CPU a rollout batch always does (left padding, or a
shared prompt's cache). Autograd then saves those copies: for SmolLM2, 9 query
heads on 3 key/value heads, three times the key/value memory of every layer.
PyTorch's SDPA takes ``enable_gqa=True`` and serves the groups inside its CPU
flash kernel, masked or not, without copies (and faster). This function does
that for CPU passes of more than one token and hands everything else
(decoding steps, GPUs, soft-capping, position biases) to transformers' own
``sdpa`` unchanged. :func:`use_sdpa_gqa` switches a loaded model over.

A completion pass over a shared prompt's cache (:mod:`lit_grpo.model.logprob_passes`)
attends to the prompt's keys, some of them left padding, and causally to its
own. As one masked call, SDPA's flash kernel scores every (query, key) block,
the half above the diagonal too, since a mask hides the causal structure from
it. Given ``prefix_mask`` (the prompt's real keys, passed down by the pass),
:func:`prefix_causal_attention` runs the two parts apart, the completion's
with ``is_causal`` so its kernel skips the blocks above the diagonal, and
merges them by their log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NAME = "sdpa_gqa"

# Completion passes at least this wide attend through prefix_causal_attention, where the
# causal kernel's skipped blocks outweigh the second call: one layer's attention, forward and
# backward, 8 rows after a 40-token prompt on a 2-core CPU, took 1.08x the masked call's time
# at 512 tokens, 0.83x at 768, 0.56x at 4,096 (benchmarks/memory.py --lengths: a whole step).
SPLIT_FROM_TOKENS = 768


def sdpa_gqa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over ``query [B, H, Lq, D]``, ``key/value [B, Hkv, Lk, D]``; returns ``[B, Lq, H, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = query.shape[1] != key.shape[1]
    plain = kwargs.get("softcap") is None and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None
    prefix_mask = kwargs.pop("prefix_mask", None)
    window = kwargs.get("sliding_window")  # a sliding window lives in attention_mask, which the split leaves out
    if (
        prefix_mask is not None
        and plain
        and query.device.type == "cpu"
        and key.shape[2] == prefix_mask.shape[1] + query.shape[2]
        and (window is None or window >= key.shape[2])
        and not dropout
    ):
        out = prefix_causal_attention(query, key, value, prefix_mask, scaling or query.shape[-1] ** -0.5)
        return out.transpose(1, 2).contiguous(), None
    if not (grouped and plain and query.device.type == "cpu" and query.shape[2] > 1):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and key.shape[2] > query.shape[2]:  # an unmasked pass over a cache: let transformers slice it
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def prefix_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention over a prefix's real keys, then causally over the queries' own keys.

    What one SDPA call with the mask ``[prefix_mask | lower triangle]`` computes,
    within float rounding, with the causal part's blocks above the diagonal
    skipped (CPU flash kernels). Query rows past a right-padded row's end
    attend to that row's padding too; what they yield is padding, masked by
    the caller. Under autocast all three inputs run in its dtype, as SDPA's
    would (an fp32 residual stream rotates its queries and keys in fp32 beside
    bf16 values).

    Args:
        query: ``[B, H, C, D]``, the ``C`` queries at the keys' last ``C`` positions.
        key: ``[B, K, P + C, D]``, ``H`` a multiple of ``K`` (grouped-query heads).
        value: ``[B, K, P + C, D]``.
        prefix_mask: ``[B, P]``, true where a prefix key is real (false: left padding).
        scale: The scores' factor (``D ** -0.5`` for most models).

    Returns:
        ``[B, H, C, D]``.
    """
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    query, key, value = (x.to(dtype) for x in (query, key, value))
    return _PrefixCausal.apply(query, key, value, prefix_mask, scale)


class _PrefixCausal(torch.autograd.Function):
    """The prefix and the causal part as two flash-attention calls merged by their log-sum-exp.

    Backward runs each part's flash backward with the merged output and
    log-sum-exp: the softmax over all keys factors over the two key sets, so
    the parts' query gradients add up to the whole's, and each part's key and
    value gradients are the whole's on its keys.
    """

    @staticmethod
    def forward(ctx, query, key, value, prefix_mask, scale):
        prefix = prefix_mask.shape[1]
        batch, _, length, _ = query.shape
        bias = query.new_zeros(batch, 1, 1, prefix).masked_fill_(~prefix_mask.bool()[:, None, None], float("-inf"))
        bias = bias.expand(batch, 1, length, prefix)
        parts = [
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key[:, :, :prefix], value[:, :, :prefix], 0.0, False, attn_mask=bias, scale=scale
            ),
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key[:, :, prefix:], value[:, :, prefix:], 0.0, True, scale=scale
            ),
        ]
        (out_prefix, lse_prefix), (out_own, lse_own) = parts  # [B, H, C, D], [B, H, C] (fp32)
        # The kernel leaves a row whose keys are all masked at out 0, lse 0: it must weigh nothing.
        lse_prefix = lse_prefix.masked_fill(~prefix_mask.bool().any(-1)[:, None, None], float("-inf"))
        lse = torch.logaddexp(lse_prefix, lse_own)
        out = (
            torch.exp(lse_prefix - lse)[..., None] * out_prefix.float()
            + torch.exp(lse_own - lse)[..., None] * out_own.float()
        ).to(query.dtype)
        ctx.save_for_backward(query, key, value, bias, out, lse)
        ctx.prefix, ctx.scale = prefix, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, bias, out, lse = ctx.saved_tensors
        prefix, scale = ctx.prefix, ctx.scale
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq_prefix, dk_prefix, dv_prefix = backward(
            grad, query, key[:, :, :prefix], value[:, :, :prefix], out, lse, 0.0, False, attn_mask=bias, scale=scale
        )
        dq_own, dk_own, dv_own = backward(
            grad, query, key[:, :, prefix:], value[:, :, prefix:], out, lse, 0.0, True, scale=scale
        )
        return dq_prefix + dq_own, torch.cat([dk_prefix, dk_own], 2), torch.cat([dv_prefix, dv_own], 2), None, None


def use_sdpa_gqa(model: nn.Module) -> bool:
    """Switch a model on transformers' ``sdpa`` attention to ``sdpa_gqa``; report whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not getattr(
        model, "_supports_attention_backend", False
    ):
        return False
    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
