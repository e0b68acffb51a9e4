"""One decoding step: the model's own forward, or a lean one for Llama-family models.

A decode step pushes a few rows through every layer for one new token: it is
the cost of reading the weights plus per-op overhead, hardly arithmetic. On a
CPU transformers' generic forward leaves both on the table: the default GEMM
runs few-row matmuls well below the speed the weight reads allow, and the
per-layer bookkeeping (a 4-D mask, every layer's key/value cache concatenated
with the new column, rotary and GQA reshapes, keyword plumbing) adds up over
thirty layers.

:class:`LlamaStep` does the Llama layer's arithmetic (Llama, Mistral, Qwen2:
RMSNorm, rotary attention with grouped KV heads, SwiGLU) with
* the projections that read the same input fused (``q|k|v``, ``gate|up``),
  so a layer makes four matmuls instead of seven;
* every weight reordered once per rollout into oneDNN's blocked layout
  (:class:`Matmul`), which runs few-row matmuls at the speed of reading the
  weights, so 8 rows cost about what one row does;
* the cache in buffers sized for the whole rollout, a column written per
  step, and the padding bias built once.
It calls the model's own norms, rotary embedding and activation, so epsilons,
RoPE scaling and biases are the model's; its logits agree with the model's
within 1e-5 on the tests' tiny models and 5e-5 on SmolLM2-135M (float32; the
packed matmul sums in another order).

It runs on CPUs (where oneDNN packs the weights). Any other device or
model, or one wrapped for training (a peft adapter, FSDP shards, 4-bit
layers), steps through :class:`ModelStep`, i.e. ``model(...)``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from lit_grpo.generation.merged import LowRankLinear
from lit_grpo.model.kv_cache import with_cache

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
"""``config.model_type`` values whose decoder layer is Llama's."""


class ModelStep:
    """Decode steps through ``model(...)`` and its KV cache (any causal LM).

    Args:
        model: The causal LM.
        cache: The prompt's cache (a transformers ``Cache``), one row per sample.
        attention: ``[n, P]`` prompt attention mask, one row per sample.
    """

    def __init__(self, model: nn.Module, cache, attention: Tensor) -> None:
        self.model, self.cache, self.attention = model, cache, attention

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits ``[n, V]`` after feeding ``tokens [n]`` at ``positions [n]``."""
        self.attention = torch.cat([self.attention, self.attention.new_ones(len(tokens), 1)], dim=1)
        return self.model(
            input_ids=tokens[:, None],
            attention_mask=self.attention,
            position_ids=positions[:, None],
            **with_cache(self.cache),
            use_cache=True,
        ).logits[:, -1]

    def select(self, rows: Tensor) -> None:
        """Keep only ``rows`` (finished ones leave the batch)."""
        self.attention = self.attention[rows]
        self.cache.batch_select_indices(rows)


class Matmul:
    """``x @ W.T + b`` with ``W`` the row-wise concatenation of ``linears``, packed.

    The weight is reordered into oneDNN's blocked layout once (about the cost
    of a copy) and multiplied by oneDNN's matmul kernel (CPU only, see
    :func:`can_pack`).

    A :class:`~lit_grpo.generation.merged.LowRankLinear` among ``linears``
    brings its update ``up @ down``: the group's ``down`` rows join the packed
    weight (one matmul yields the outputs and the rank-space activations) and
    a second packed matmul applies the stacked, block-diagonal ``up``, added
    to the outputs. In bf16 that rounds the update relative to itself, never
    to ``W``, which is what merging would lose.

    Args:
        linears: Layers that read the same input; their outputs are concatenated.
        dtype: The dtype to pack and multiply in (inputs are cast to it); the
            weights' own by default.
    """

    def __init__(self, *linears: nn.Module, dtype: torch.dtype | None = None) -> None:
        weights = [m.weight for m in linears]
        self.width = sum(len(w) for w in weights)  # outputs; rank-space activations follow them
        self.dtype = dtype or weights[0].dtype
        ranked = [m for m in linears if isinstance(m, LowRankLinear)]
        self.up = None
        if ranked:
            weights += [m.down for m in ranked]
            blocks = [m.up if isinstance(m, LowRankLinear) else m.weight.new_zeros(m.out_features, 0) for m in linears]
            self.up = _pack(torch.block_diag(*blocks), self.dtype)  # [width, rank]
        biases = [m.bias for m in linears]
        if any(b is not None for b in biases):
            biases = [m.weight.new_zeros(len(m.weight)) if b is None else b for m, b in zip(linears, biases)]
            biases += [m.down.new_zeros(len(m.down)) for m in ranked]
            self.bias = torch.cat(biases).detach().to(self.dtype)
        else:
            self.bias = None
        self.weight = _pack(torch.cat(weights) if len(weights) > 1 else weights[0], self.dtype)

    def __call__(self, x: Tensor) -> Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, self.bias, "none", [], "")
        if self.up is None:
            return out
        low = torch.ops.mkldnn._linear_pointwise(out[..., self.width :], self.up, None, "none", [], "")
        return out[..., : self.width] + low


def _pack(weight: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous())


def step_dtype(weight: Tensor) -> torch.dtype:
    """The dtype a decode step's matmuls run in: autocast's where autocast is on
    (``precision="bf16-mixed"``: what the model's own forward would multiply in),
    else the weights'."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


@functools.cache
def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`Matmul` runs here: oneDNN on this CPU, for this dtype.

    Half-precision packing needs CPU instructions only a probe reveals.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    probe = nn.utils.skip_init(nn.Linear, 2, 2, bias=False, dtype=dtype)  # no init: the global RNG stays untouched
    nn.init.ones_(probe.weight)
    try:
        return bool(torch.equal(Matmul(probe)(torch.ones(1, 2, dtype=dtype)), torch.full((1, 2), 2, dtype=dtype)))
    except (RuntimeError, AttributeError):
        return False


class LlamaStep:
    """Lean decode steps for a plain Llama-family model (see the module docstring).

    Args:
        model: A ``LlamaForCausalLM``-like model (:func:`llama_step_applies`).
        cache: The prompt's transformers cache, one row per sample.
        attention: ``[n, P]`` prompt attention mask, one row per sample.
        new_tokens: Most tokens that will be fed (sizes the cache buffers).
    """

    def __init__(self, model: nn.Module, cache, attention: Tensor, new_tokens: int) -> None:
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.layers, self.inner = model.model.layers, model.model
        dtype = step_dtype(model.lm_head.weight)
        self.qkv = [
            Matmul(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, dtype=dtype)
            for layer in self.layers
        ]
        self.o = [Matmul(layer.self_attn.o_proj, dtype=dtype) for layer in self.layers]
        self.gate_up = [Matmul(layer.mlp.gate_proj, layer.mlp.up_proj, dtype=dtype) for layer in self.layers]
        self.down = [Matmul(layer.mlp.down_proj, dtype=dtype) for layer in self.layers]
        self.head = Matmul(model.lm_head, dtype=dtype)
        n, prompt = attention.shape
        self.length = prompt
        self.keys, self.values = [], []
        # One dtype for both: an fp32 residual stream (lit_grpo.model.stream) caches fp32 keys (rotated
        # in the stream's precision) beside bf16 values (a bf16 matmul's output).
        stream = torch.promote_types(cache.layers[0].keys.dtype, cache.layers[0].values.dtype)
        for layer in cache.layers:  # [n, K, P, d] -> [n, K, P + new_tokens, d]
            for cached, buffers in ((layer.keys, self.keys), (layer.values, self.values)):
                buffer = cached.new_empty(*cached.shape[:2], prompt + new_tokens, cached.shape[-1], dtype=stream)
                buffer[:, :, :prompt] = cached
                buffers.append(buffer)
        self.head_dim = self.keys[0].shape[-1]
        self.scale = self.layers[0].self_attn.scaling
        padding = torch.zeros(n, prompt + new_tokens, dtype=torch.bool, device=attention.device)
        padding[:, :prompt] = attention == 0
        self.bias = torch.zeros(n, 1, 1, prompt + new_tokens, dtype=self.keys[0].dtype, device=attention.device)
        self.bias.masked_fill_(padding[:, None, None], float("-inf"))  # [n, 1, 1, P + new]: -inf on left padding

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits ``[n, V]`` after feeding ``tokens [n]`` at ``positions [n]``."""
        n, column = len(tokens), self.length
        hidden = self.inner.embed_tokens(tokens)  # [n, D]
        cos, sin = self.inner.rotary_emb(hidden, positions[:, None])  # [n, 1, d]
        bias = self.bias[..., : column + 1]  # [n, 1, 1, L]
        qk_heads = self.heads + self.kv_heads
        for i, layer in enumerate(self.layers):
            qkv = self.qkv[i](layer.input_layernorm(hidden)).view(n, qk_heads + self.kv_heads, self.head_dim)
            qk = qkv[:, :qk_heads] * cos + _rotate_half(qkv[:, :qk_heads]) * sin  # [n, H + K, d]
            self.keys[i][:, :, column] = qk[:, self.heads :]
            self.values[i][:, :, column] = qkv[:, qk_heads:]
            q = qk[:, : self.heads].reshape(n, self.kv_heads, -1, self.head_dim)  # [n, K, H/K, d]: GQA groups
            scores = q @ self.keys[i][:, :, : column + 1].transpose(-1, -2) * self.scale + bias  # [n, K, H/K, L]
            out = scores.softmax(-1) @ self.values[i][:, :, : column + 1]  # [n, K, H/K, d]
            hidden = hidden + self.o[i](out.reshape(n, -1))
            gate, up = self.gate_up[i](layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
            hidden = hidden + self.down[i](layer.mlp.act_fn(gate) * up)
        self.length += 1
        return self.head(self.inner.norm(hidden))  # [n, V]

    def select(self, rows: Tensor) -> None:
        """Keep only ``rows`` (finished ones leave the batch)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.bias = self.bias[rows]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def llama_step_applies(model: nn.Module, length: int) -> bool:
    """Whether :class:`LlamaStep` reproduces ``model`` for sequences up to ``length`` tokens.

    A plain Llama-family model (``config.model_type`` in :data:`LLAMA_FAMILY`)
    attending to all ``length`` tokens (no shorter sliding window), whose
    projections and head are plain linear layers or a merged copy's
    :class:`~lit_grpo.generation.merged.LowRankLinear` (an adapter, 4-bit
    layers or FSDP shards keep the model's own forward), on a CPU where its weights can
    be packed in the dtype the step multiplies in (:func:`can_pack`,
    :func:`step_dtype`; on a GPU transformers' forward is the one measured).
    """
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if getattr(config, "model_type", None) not in LLAMA_FAMILY or not hasattr(inner, "rotary_emb"):
        return False
    window = getattr(config, "sliding_window", None)  # Mistral: every layer; Qwen2: its sliding layer types
    sliding = config.model_type == "mistral" or "sliding_attention" in (getattr(config, "layer_types", None) or [])
    if sliding and window is not None and window < length:
        return False
    projections = [model.lm_head]
    for layer in inner.layers:
        projections += [getattr(layer.self_attn, f"{name}_proj") for name in "qkvo"]
        projections += [getattr(layer.mlp, f"{name}_proj") for name in ("gate", "up", "down")]
    weight = model.lm_head.weight
    return (
        all(type(m) in (nn.Linear, LowRankLinear) for m in projections)
        and not _sharded(model)
        and can_pack(weight.device, step_dtype(weight))
    )


def _sharded(model: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
