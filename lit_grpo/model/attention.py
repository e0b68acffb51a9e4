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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NAME = "sdpa_gqa"


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
