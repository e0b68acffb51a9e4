"""Per-token log-probabilities and entropy without a full-vocabulary fp32 copy.

A naive ``log_softmax(logits / T).gather(...)`` holds an fp32 ``[N, T, V]``
tensor (1.6 GB for 8 x 1024 x 49152) and autograd keeps it alive until the
backward, which then allocates two more of the same size. Here the logits are
visited in chunks of at most ``chunk_size`` positions: each chunk is
upcast to fp32 (a copy only for half precision), log-softmaxed, and only the
chosen token's value is kept.

Autograd would still save every chunk's fp32 log-softmax for the backward, so
:class:`_ChunkedTokenLogprobs` is a custom ``autograd.Function`` that saves
only a reference to the logits and recomputes each chunk's softmax in the
backward, writing ``(onehot - softmax) * grad / T`` straight into one gradient
tensor of the logits' dtype. Extra memory is that gradient (which any method
must return) plus a few fp32 chunks. Double backward is not supported.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 512
"""Positions per chunk: 512 x 49152 vocab x 4 B = 100 MB per fp32 temporary."""


def _chunks(n_rows: int, n_positions: int, chunk_size: int) -> Iterator[tuple[slice, slice]]:
    """(row slice, position slice) pairs covering ``[n_rows, n_positions]``.

    Slicing both leading dims keeps every chunk a view, even when ``logits``
    cannot be flattened without a copy (e.g. ``logits[:, :-1]``).
    """
    if n_rows == 0 or n_positions == 0:
        return
    if n_positions >= chunk_size:
        for row in range(n_rows):
            for start in range(0, n_positions, chunk_size):
                yield slice(row, row + 1), slice(start, start + chunk_size)
    else:
        rows_per_chunk = chunk_size // n_positions
        for start in range(0, n_rows, rows_per_chunk):
            yield slice(start, start + rows_per_chunk), slice(None)


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)  # half -> fp32; fp64 stays


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    """``chunk / temperature`` in the compute dtype, copying at most once."""
    x = chunk.to(_compute_dtype(chunk))  # [n, t, V], a copy only for half precision
    if temperature == 1.0:
        return x
    return x.div_(temperature) if x is not chunk else x / temperature


# The per-chunk bodies are functions so their [n, t, V] temporaries are freed on
# return; a loop variable would keep the previous chunk alive (2 chunks at peak).
def _log_softmax(chunk: Tensor, temperature: float) -> Tensor:
    return torch.log_softmax(_scaled(chunk, temperature), dim=-1)  # [n, t, V]


def _chosen(logp: Tensor, tokens: Tensor) -> Tensor:
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n, t]


def _entropy(logp: Tensor) -> Tensor:
    # -sum p log p; nansum drops the 0 * -inf of -inf logits (masked vocab), whose p is 0.
    return -(logp.exp() * logp).nansum(-1)  # [n, t]


def _chunk_logprobs(chunk: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    return _chosen(_log_softmax(chunk, temperature), tokens)


def _chunk_grad(chunk: Tensor, tokens: Tensor, grad_out: Tensor, temperature: float) -> Tensor:
    # d logp_k / d x = onehot_k - softmax(x); d x / d logits = 1 / T.
    g = grad_out.unsqueeze(-1)  # [n, t, 1]
    grad = torch.softmax(_scaled(chunk, temperature), dim=-1)  # [n, t, V]
    grad.mul_(-g).scatter_add_(-1, tokens.unsqueeze(-1), g)
    return grad.div_(temperature) if temperature != 1.0 else grad


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_size: int) -> Tensor:
        n_rows, n_positions, _ = logits.shape
        out = logits.new_empty((n_rows, n_positions), dtype=_compute_dtype(logits))  # [N, T]
        for rows, positions in _chunks(n_rows, n_positions, chunk_size):
            out[rows, positions] = _chunk_logprobs(logits[rows, positions], tokens[rows, positions], temperature)
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, tokens = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)  # [N, T, V]
        n_rows, n_positions, _ = logits.shape
        for rows, positions in _chunks(n_rows, n_positions, ctx.chunk_size):
            grad_logits[rows, positions] = _chunk_grad(
                logits[rows, positions],
                tokens[rows, positions],
                grad_out[rows, positions],
                ctx.temperature,
            )
        return grad_logits, None, None, None


def _chunk_entropy(chunk: Tensor, temperature: float) -> Tensor:
    return _entropy(_log_softmax(chunk, temperature))


def _check_inputs(logits: Tensor, temperature: float, chunk_size: int) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, T, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Log-probability of each chosen token under ``softmax(logits / temperature)``.

    Differentiable w.r.t. ``logits``; see the module docstring for memory.

    Args:
        logits: ``[N, T, V]`` logits at the completion positions (fp32, bf16 or
            fp16; half precision is upcast to fp32 one chunk at a time).
        tokens: ``[N, T]`` integer ids of the tokens that were sampled.
        temperature: The sampling temperature the tokens were drawn with.
        chunk_size: Positions (rows x time steps) processed at once; peak extra
            memory is a few fp32 ``[chunk_size, V]`` buffers.

    Returns:
        ``[N, T]`` fp32 log-probabilities (float64 for float64 logits).

    Raises:
        ValueError: Shapes do not match, ``temperature <= 0`` or ``chunk_size < 1``.
    """
    _check_inputs(logits, temperature, chunk_size)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} does not match logits shape "
            f"{tuple(logits.shape)} (expected tokens [N, T] for logits [N, T, V])"
        )
    return _ChunkedTokenLogprobs.apply(logits, tokens.long(), float(temperature), int(chunk_size))


def token_entropy(
    logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE, grad: bool = False
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position.

    Without ``grad`` (for logging) it is computed chunk-wise like
    :func:`token_logprobs` and detached; with ``grad`` (an entropy bonus) in
    one differentiable pass that holds the ``[N, T, V]`` probabilities.

    Args:
        logits: ``[N, T, V]`` logits (fp32, bf16 or fp16).
        temperature: The sampling temperature.
        chunk_size: Positions processed at once.
        grad: Differentiable w.r.t. ``logits``.

    Returns:
        ``[N, T]`` fp32 entropies in nats (float64 for float64 logits).

    Raises:
        ValueError: ``logits`` is not 3-D, ``temperature <= 0`` or ``chunk_size < 1``.
    """
    _check_inputs(logits, temperature, chunk_size)
    if grad:
        return _chunk_entropy(logits.to(_compute_dtype(logits)), temperature)
    n_rows, n_positions, _ = logits.shape
    out = logits.new_empty((n_rows, n_positions), dtype=_compute_dtype(logits))  # [N, T]
    with torch.no_grad():
        for rows, positions in _chunks(n_rows, n_positions, chunk_size):
            out[rows, positions] = _chunk_entropy(logits[rows, positions], temperature)
    return out


HEAD_CHUNK_SIZE = 128
"""Rows per chunk in :func:`head_logprobs`: 128 x 49152 x 4 B = 25 MB per fp32
temporary. Its chunks are live at the training step's memory peak (every
activation is still held), so they are kept small."""


class _HeadLogprobs(torch.autograd.Function):
    """Log-probs (and entropy) straight from hidden states through the output head.

    The ``[M, V]`` logits exist one chunk at a time, in both directions: the
    forward keeps only the chosen token's log-prob (and the entropy); the
    backward recomputes each chunk's softmax and multiplies
    ``(onehot - softmax) * grad / T`` (plus, where the entropy has a gradient,
    ``-softmax * (log softmax + H) * grad_H / T``) back through the head into
    the hidden states' (and, if it trains, the head weight's) gradient.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float, chunk_size: int, with_entropy: bool
    ):
        compute = torch.promote_types(weight.dtype, torch.float32)
        logprobs = hidden.new_empty(tokens.shape, dtype=compute)  # [M]
        entropy = hidden.new_empty(tokens.shape if with_entropy else (0,), dtype=compute)  # [M] or [0]
        for start in range(0, len(tokens), chunk_size):
            rows = slice(start, start + chunk_size)
            logprobs[rows], chunk_entropy = _head_chunk(hidden[rows], weight, tokens[rows], temperature, with_entropy)
            if with_entropy:
                entropy[rows] = chunk_entropy
        ctx.save_for_backward(hidden, weight, tokens)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)  # an entropy only logged gets no gradient: None, nothing computed
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, tokens = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        compute = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=compute) if ctx.needs_input_grad[1] else None
        if grad_logprobs is None:
            grad_logprobs = hidden.new_zeros(tokens.shape, dtype=compute)
        for start in range(0, len(tokens), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            scaled = hidden[rows] / ctx.temperature  # [m, H]
            logits = scaled.to(weight.dtype) @ weight.T  # [m, V]
            grad_logits = _chunk_grad(logits, tokens[rows], grad_logprobs[rows], 1.0)
            if grad_entropy is not None:
                grad_logits += _entropy_grad(logits, grad_entropy[rows])
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight) / ctx.temperature  # [m, H]
            if grad_weight is not None:
                grad_weight += grad_logits.T @ scaled.to(compute)  # [V, H]
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _entropy_grad(logits: Tensor, grad_out: Tensor) -> Tensor:
    # dH / dx_j = -p_j (log p_j + H) for H = -sum p log p; 0 where p is 0 (masked vocabulary).
    logp = torch.log_softmax(logits.to(grad_out.dtype), dim=-1)  # [m, V]
    p = logp.exp()
    entropy = -(p * logp).nansum(-1, keepdim=True)  # [m, 1]
    return torch.where(p > 0, -p * (logp + entropy), 0.0) * grad_out.unsqueeze(-1)  # [m, V]


# The chunk bodies are the logits path's own (_log_softmax, _chosen, _entropy,
# _chunk_grad), applied to a chunk of rows' logits computed here and dropped after;
# the log-prob and the entropy come from one log-softmax. The temperature divides
# the hidden states ([m, H]) before the head instead of the logits ([m, V]) after
# it: the same numbers, V / H times fewer divisions.
def _head_chunk(hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float, with_entropy: bool):
    # An fp32 residual stream meets a half-precision head: scaled in fp32, multiplied in the head's dtype
    # (as under autocast).
    logp = _log_softmax((hidden / temperature).to(weight.dtype) @ weight.T, 1.0)  # [m, V]
    return _chosen(logp, tokens), _entropy(logp) if with_entropy else None


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = HEAD_CHUNK_SIZE,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``tokens`` under ``softmax(hidden @ weight.T / temperature)``, fused.

    The same values as ``token_logprobs(hidden @ weight.T, tokens)`` without
    ever holding the ``[..., V]`` logits (or their gradient): chunks of
    ``chunk_size`` rows are computed, reduced and dropped, forward and
    backward. Gradients flow to ``hidden`` and, if it requires grad, ``weight``.

    Args:
        hidden: ``[..., H]`` final hidden states at the positions that predict ``tokens``.
        weight: ``[V, H]`` output head (no bias).
        tokens: ``[...]`` token ids.
        temperature: Logits are divided by it.
        with_entropy: Also return the entropy of each position's distribution (differentiable:
            an entropy bonus trains through it; only logged, it costs no backward work).
        chunk_size: Rows per chunk.

    Returns:
        ``(logprobs [...], entropy [...] or None)``, fp32 (fp64 for fp64 inputs).
    """
    shape = tokens.shape
    logprobs, entropy = _HeadLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, tokens.reshape(-1), temperature, chunk_size, with_entropy
    )
    return logprobs.view(shape), entropy.view(shape) if with_entropy else None
