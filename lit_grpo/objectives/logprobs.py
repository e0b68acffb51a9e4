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
def _chunk_logprobs(chunk: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    logp = torch.log_softmax(_scaled(chunk, temperature), dim=-1)  # [n, t, V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n, t]


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
            out[rows, positions] = _chunk_logprobs(
                logits[rows, positions], tokens[rows, positions], temperature
            )
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
                logits[rows, positions], tokens[rows, positions],
                grad_out[rows, positions], ctx.temperature,
            )
        return grad_logits, None, None, None


def _chunk_entropy(chunk: Tensor, temperature: float) -> Tensor:
    probs = torch.softmax(_scaled(chunk, temperature), dim=-1)  # [n, t, V]
    # entr(p) = -p log p with entr(0) = 0, so -inf logits (masked vocab) give no NaN.
    return torch.special.entr(probs).sum(-1)  # [n, t]


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


@torch.no_grad()
def token_entropy(
    logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position, for logging.

    Computed chunk-wise like :func:`token_logprobs`, without gradient.

    Args:
        logits: ``[N, T, V]`` logits (fp32, bf16 or fp16).
        temperature: The sampling temperature.
        chunk_size: Positions processed at once.

    Returns:
        ``[N, T]`` fp32 entropies in nats (float64 for float64 logits), detached.

    Raises:
        ValueError: ``logits`` is not 3-D, ``temperature <= 0`` or ``chunk_size < 1``.
    """
    _check_inputs(logits, temperature, chunk_size)
    n_rows, n_positions, _ = logits.shape
    out = logits.new_empty((n_rows, n_positions), dtype=_compute_dtype(logits))  # [N, T]
    for rows, positions in _chunks(n_rows, n_positions, chunk_size):
        out[rows, positions] = _chunk_entropy(logits[rows, positions], temperature)
    return out
