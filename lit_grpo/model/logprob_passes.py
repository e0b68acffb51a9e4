"""Per-token log-probs of rollout completions: the policy's scoring passes.

Training, the reference pass, the old-log-prob pass and DPO all score
completions through :func:`completion_logprobs`. Three things make it cheap:

* Rows that share a prompt run it once; its key/value cache is indexed out to
  them and gradients sum back through it. This composes with gradient
  checkpointing: the passes checkpoint the model's layers themselves, against
  a cache that no pass (and no recomputation in backward) appends to.
* Completion tokens run in length buckets, each pass only as wide as its
  longest row.
* The output head is fused with the log-softmax where the logits are a plain
  linear head, so ``[N, C, V]`` logits are never held.

A long completion pass also attends to the prompt's keys and to its own
causal ones in two calls (:func:`~lit_grpo.model.attention.prefix_causal_attention`),
so the attention kernel skips the blocks above the diagonal that one masked
call would score.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lit_grpo.model.attention import NAME as SDPA_GQA
from lit_grpo.model.attention import SPLIT_FROM_TOKENS

# Completion tokens per pass (rows x width) while the layers are checkpointed. What is
# kept for backward is then a layer input per token per layer; the rest of a pass's
# activations exist for one layer at a time, forward and recomputed, and grow with
# the pass, so capping it keeps a step's peak linear in completion length with a
# small slope (one uncapped pass per bucket makes the slope several times steeper).
CHECKPOINTED_PASS_TOKENS = 1024


def completion_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    completion_attention: torch.Tensor | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the completion under ``model``.

    Rows that share a prompt (a GRPO group, a DPO pair) run the prompt once:
    its key/value cache is computed for each distinct prompt and indexed out to
    the rows, and only the completion tokens run per row, in length buckets
    (:func:`length_buckets`) so each pass is only as wide as its longest row.
    Gradients flow through the shared cache (its index sums them over the
    rows), so the result equals one full pass per row at every real token;
    positions past a row's end are 0. Batches without a repeated prompt take
    one full pass.

    A model in gradient checkpointing stays checkpointed on this path, prompt
    pass included: the layers the model checkpoints are checkpointed here
    instead (:func:`_own_checkpointing`), against a prompt cache that nothing
    appends to once the prompt pass has written it, so a layer recomputed in
    backward reads exactly what its first run read. The completion passes then
    hold at most :data:`CHECKPOINTED_PASS_TOKENS` tokens each, so a step's
    peak memory grows linearly in completion length, with a small slope.

    When the model's logits are a plain linear head on its last hidden states
    (Llama, Qwen, Mistral, SmolLM... not soft-capped or scaled ones), the head
    is taken out of the forward pass and fused with the log-softmax
    (:func:`~lit_grpo.objectives.head_logprobs`): the ``[N, C, V]`` logits are
    never held, in either direction. Otherwise only completion positions get
    logits, and log-probs are gathered chunk-wise.

    Args:
        model: A causal LM (or a peft model wrapping one).
        prompt_ids: ``[N, P]`` left-padded prompt token ids.
        prompt_mask: ``[N, P]`` 1 for real prompt tokens.
        completion_ids: ``[N, C]`` right-padded completion token ids.
        completion_mask: ``[N, C]`` 1 for the tokens the policy sampled (the model-token mask).
        temperature: The sampling temperature; logits are divided by it.
        with_entropy: Also return each position's entropy.
        entropy_grad: The entropy trains (an entropy bonus): differentiable on every path (the
            fused head's always is; the logits path then holds the ``[n, c, V]`` probabilities).
        completion_attention: ``[N, C]`` 1 for every real completion token, the
            policy's and a tool's or environment's (an episode, see
            :mod:`lit_grpo.generation.episodes`): what the passes attend to and
            score. ``None``: ``completion_mask`` (a single-turn rollout).

    Returns:
        ``(logprobs [N, C], entropy [N, C] or None)``.
    """
    from lit_grpo.objectives import head_logprobs, token_entropy, token_logprobs

    attention = completion_mask if completion_attention is None else completion_attention  # [N, C]
    prompts, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    shared = len(prompts) < len(prompt_ids) and completion_ids.shape[1] > 1
    head = _fusable_head(model)
    with _head_removed(model, head):  # the model's "logits" are then its final hidden states
        if shared:
            chunks = _shared_prompt_logits(model, prompts, inverse, prompt_mask, completion_ids, attention)
        else:
            every_row = torch.arange(len(completion_ids), device=completion_ids.device)
            chunks = [(every_row, 0, _full_logits(model, prompt_ids, prompt_mask, completion_ids, attention))]
    logprobs = entropy = None
    for rows, column, chunk in chunks:  # [n, c, V] logits (or [n, c, H] hidden states) of `rows`, columns column..+c
        columns = torch.arange(column, column + chunk.shape[1], device=chunk.device)
        tokens = completion_ids[rows[:, None], columns]  # [n, c]
        if head is not None:
            part, part_entropy = head_logprobs(chunk, head.weight, tokens, temperature, with_entropy)
        else:
            part = token_logprobs(chunk, tokens, temperature=temperature)
            part_entropy = (
                token_entropy(chunk if entropy_grad else chunk.detach(), temperature=temperature, grad=entropy_grad)
                if with_entropy
                else None
            )
        if logprobs is None:  # columns no pass covered (padding past a row's end) stay 0
            logprobs = part.new_zeros(completion_ids.shape)  # [N, C]
            entropy = part.new_zeros(completion_ids.shape) if with_entropy else None
        logprobs = logprobs.index_put((rows[:, None], columns), part)
        if with_entropy:
            entropy = entropy.index_put((rows[:, None], columns), part_entropy)
    return logprobs, entropy


def completion_hidden_states(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Final hidden states of the decoder (no output head) at the positions that
    predict each completion token: ``[N, C, H]``, one full pass.

    Position ``t`` holds the state *before* completion token ``t`` (the one
    its log-prob is read from), which is what a critic's value ``V_t`` scores.
    Adapters active in ``model`` apply (peft injects them into the layers).
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P + C]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P + C]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P + C], as in _full_logits
    P, C = prompt_ids.shape[1], completion_ids.shape[1]
    hidden = final_hidden_states(
        model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )  # [N, P + C, H]
    return hidden[:, P - 1 : P + C - 1]  # [N, C, H]


def final_hidden_states(model: nn.Module, **inputs) -> torch.Tensor:
    """The decoder's final hidden states ``[N, T, H]`` of a causal LM (or a peft model around one).

    The model runs through its own ``forward`` (the output head on the last position only,
    ``logits_to_keep=1``) and the states are taken from its decoder's output: calling the
    decoder directly would skip the hooks FSDP2 sets on the model's root, which gather the
    root's own weights (embeddings, final norm) and reduce their gradients. ``inputs`` go to
    ``forward`` as they are (a key/value cache fills as it would there).
    """
    captured: list[torch.Tensor] = []
    hook = (
        _base_model(model).get_decoder().register_forward_hook(lambda module, args, output: captured.append(output[0]))
    )
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    return captured[0]


def _fusable_head(model: nn.Module) -> nn.Linear | None:
    """The output head when the logits are exactly ``head(hidden)``, else ``None``."""
    from torch.distributed.tensor import DTensor

    base = _base_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.bias is not None or isinstance(head.weight, DTensor):
        return None  # FSDP2 shards: the head's weight is only whole inside the model's forward
    config = getattr(base, "config", None)
    rescaled = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in rescaled):
        return None
    return head


@contextlib.contextmanager
def _head_removed(model: nn.Module, head: nn.Linear | None):
    """Swap the output head for an identity while the model runs (no-op for ``None``).

    The model's "logits" are then a slice of its final hidden states (the positions kept),
    a view: FSDP2 warns that its root returned one, for fear of an in-place op on it that
    would skip its pre-backward hook. Only :func:`~lit_grpo.objectives.head_logprobs` reads
    them, out of place, so that warning is silenced here, and only here.
    """
    if head is None:
        yield
        return
    base = _base_model(model)
    base.set_output_embeddings(nn.Identity())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
            )
            yield
    finally:
        base.set_output_embeddings(head)


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _full_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Logits at the positions that predict each completion token, from one pass: ``[N, C, V]``
    (``[N, C, H]`` hidden states while the head is removed)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P + C]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P + C]
    # Left padding shifts where each row starts: positions count real tokens only,
    # exactly as generate() numbered them while sampling.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P + C]
    P, C = prompt_ids.shape[1], completion_ids.shape[1]
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=_positions(P - 1, P + C - 1, input_ids.device),
        use_cache=False,
    ).logits  # [N, C, V]


def _shared_prompt_logits(model, prompts, inverse, prompt_mask, completion_ids, completion_mask):
    """The logits of :func:`_full_logits`, each distinct prompt run once, as ``(rows, column, logits)`` chunks.

    The prompt pass gives every row's first completion token; the completion
    tokens then run in length buckets (:func:`length_buckets`), each pass only
    as wide as its longest row, on the prompt cache indexed out to its rows;
    checkpointed, a bucket is split into passes of at most
    :data:`CHECKPOINTED_PASS_TOKENS` tokens (or one row).
    """
    from transformers import DynamicCache

    from lit_grpo.model.kv_cache import with_cache

    P = prompt_mask.shape[1]
    unique_ids, unique_mask = prompts[:, :P], prompts[:, P:]  # [U, P] each
    split_attention = getattr(_base_model(model).config, "_attn_implementation", None) == SDPA_GQA
    cache = DynamicCache()
    with _own_checkpointing(model) as layers, _checkpointed(layers):
        first = model(
            input_ids=unique_ids,
            attention_mask=unique_mask,
            position_ids=(unique_mask.cumsum(-1) - 1).clamp(min=0),
            **with_cache(cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits  # [U, 1, V]
        for layer in cache.layers:  # written once: the prompt pass recomputed in backward keeps its own states
            layer.update = _own_states
        every_row = torch.arange(len(completion_ids), device=completion_ids.device)
        chunks = [(every_row, 0, first.index_select(0, inverse))]
        lengths = completion_mask.sum(-1)  # [N]
        for bucket in length_buckets(lengths):
            size = max(1, CHECKPOINTED_PASS_TOKENS // int(lengths[bucket].max())) if layers else len(bucket)
            for rows in bucket.split(size):
                width = int(lengths[rows].max())
                if width < 2:
                    continue  # only a first token: the prompt pass predicted it
                attended = completion_mask[rows, :width]
                split = (
                    split_attention
                    and width >= SPLIT_FROM_TOKENS
                    and bool((attended.cummin(-1).values == attended).all())  # right padding only: causal suffices
                )
                chunks.append(
                    (
                        rows,
                        1,
                        model(
                            input_ids=completion_ids[rows, :width],
                            attention_mask=torch.cat([prompt_mask[rows], attended], dim=1),
                            position_ids=prompt_mask[rows].sum(-1, keepdim=True)
                            + torch.arange(width, device=rows.device),
                            **with_cache(cache_rows(cache, inverse[rows])),  # backward sums over each prompt's rows
                            use_cache=True,
                            logits_to_keep=_positions(0, width - 1, rows.device),
                            **({"prefix_mask": prompt_mask[rows]} if split else {}),
                        ).logits,
                    )
                )  # [n, width - 1, V]
    return chunks


def length_buckets(lengths: torch.Tensor, max_buckets: int = 4) -> list[torch.Tensor]:
    """Split rows into groups of similar length, so each pass pads little.

    Minimises the padded area (rows x longest row, summed over groups) plus
    1/16 of the one-group area for every extra pass, over sorted lengths
    (dynamic programming, at most ``max_buckets`` groups). Rows of 40, 12 and
    64 tokens with 8 rows up to 64 wide typically become 2-3 passes with a
    quarter less padded work than one.

    Returns:
        Row indices per group, shortest group first.
    """
    order = lengths.clamp(min=1).argsort()
    sizes = lengths.clamp(min=1)[order].tolist()
    n = len(sizes)
    penalty = n * sizes[-1] / 16
    # cost[k][i]: best cost of the first i sorted rows in k groups
    cost = [[0.0] + [float("inf")] * n] + [[float("inf")] * (n + 1) for _ in range(max_buckets)]
    cut = [[0] * (n + 1) for _ in range(max_buckets + 1)]
    for k in range(1, max_buckets + 1):
        for i in range(1, n + 1):
            for j in range(k - 1, i):
                value = cost[k - 1][j] + (i - j) * sizes[i - 1] + (penalty if k > 1 else 0.0)
                if value < cost[k][i]:
                    cost[k][i], cut[k][i] = value, j
    best = min(range(1, max_buckets + 1), key=lambda k: cost[k][n])
    bounds, i = [], n
    for k in range(best, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [order[start:stop] for start, stop in reversed(bounds)]


def cache_rows(cache, rows: torch.Tensor):
    """A read-only cache holding ``rows`` of ``cache`` (which stays as it is).

    A pass reads the prompt's keys/values from it and appends nothing, so a
    layer recomputed in backward sees exactly what its first run saw.
    """
    selected = copy.copy(cache)
    selected.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in selected.layers:
        # index_select, not the cache's own batch_select_indices (``keys[rows]``): the backward of
        # advanced indexing accumulates with atomic float adds on a CPU with more than one thread,
        # so its sum over a prompt's rows came out in a different order run to run; index_select's
        # backward (index_add_) adds the rows in index order.
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        layer.update = functools.partial(_prefixed, layer.keys, layer.values)
    return selected


def _prefixed(keys, values, key_states, value_states, *args, **kwargs):
    """A cache layer's ``update`` that keeps nothing: the prompt's keys/values, then the pass's own."""
    return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)


def _own_states(key_states, value_states, *args, **kwargs):
    """A written prompt cache layer's ``update`` that keeps nothing: the pass's own keys/values.

    What the prompt pass read from the empty layer the first time, so its
    recomputation in backward reads the same. (That first concatenation onto
    an empty layer saves nothing for backward, so both runs save the same
    tensors; the checkpoint's shape check would stop a run where they differ.)
    """
    return key_states, value_states


@contextlib.contextmanager
def _own_checkpointing(model: nn.Module):
    """Switch the model's own activation checkpointing off while the block runs.

    transformers drops the cache argument of a layer it checkpoints (a
    recomputation would append to the cache a second time), which would leave
    the completion passes without their prompt. Yields the decoder layers it
    checkpoints, for :func:`_checkpointed`: none without grad or in eval mode,
    where it checkpoints nothing either.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    switched = [module for module in model.modules() if getattr(module, "gradient_checkpointing", False) is True]
    for module in switched:
        module.gradient_checkpointing = False
    try:
        yield [
            module
            for module in switched
            if isinstance(module, GradientCheckpointingLayer) and module.training and torch.is_grad_enabled()
        ]
    finally:
        for module in switched:
            module.gradient_checkpointing = True


@contextlib.contextmanager
def _checkpointed(layers: list[nn.Module]):
    """Checkpoint each of ``layers`` while the block runs, keyword arguments (the cache) included.

    Non-reentrant whatever the model was configured with: reentrant
    checkpointing only carries gradients to positional inputs, not to the
    prompt cache the layers read.
    """
    own = [(layer, layer.__dict__.get("forward")) for layer in layers]  # e.g. accelerate's device hooks
    for layer in layers:
        run = functools.partial(_forward_unchecked, layer, layer.forward)
        layer.forward = functools.partial(checkpoint, run, use_reentrant=False)
    try:
        yield
    finally:
        for layer, forward in own:
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def _forward_unchecked(layer: nn.Module, forward, *args, **kwargs):
    """``forward(*args, **kwargs)`` with the layer's own checkpointing off.

    The recomputation runs in backward, after :func:`_own_checkpointing` has
    switched it back on.
    """
    switched, layer.gradient_checkpointing = layer.gradient_checkpointing, False
    try:
        return forward(*args, **kwargs)
    finally:
        layer.gradient_checkpointing = switched


def _positions(start: int, stop: int, device) -> torch.Tensor:
    # An index tensor rather than an int: logits_to_keep=k slices the hidden states
    # into a non-contiguous view, which the output head then multiplies through a
    # copy of its weight per row (slow, in bf16 most); indexing gathers them contiguously.
    return torch.arange(start, stop, device=device)
