"""Per-token log-probs of rollout completions: the policy's scoring passes.

Training, the reference pass, the old-log-prob pass and DPO all score
completions through :func:`completion_logprobs`. Three things make it cheap:

* Rows that share a prompt run it once; its key/value cache is indexed out to
  them and gradients sum back through it.
* Completion tokens run in length buckets, each pass only as wide as its
  longest row.
* The output head is fused with the log-softmax where the logits are a plain
  linear head, so ``[N, C, V]`` logits are never held.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn


def completion_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the completion under ``model``.

    Rows that share a prompt (a GRPO group, a DPO pair) run the prompt once:
    its key/value cache is computed for each distinct prompt and indexed out to
    the rows, and only the completion tokens run per row, in length buckets
    (:func:`length_buckets`) so each pass is only as wide as its longest row.
    Gradients flow through the shared cache (its index sums them over the
    rows), so the result equals one full pass per row at every real token;
    positions past a row's end are 0. Models in gradient checkpointing, whose
    recomputation would append to the cache a second time, and batches without
    a repeated prompt take one full pass.

    When the model's logits are a plain linear head on its last hidden states
    (Llama, Qwen, Mistral, SmolLM... not soft-capped or scaled ones), the head
    is taken out of the forward pass and fused with the log-softmax
    (:func:`~lit_grpo.objectives.head_logprobs`): the ``[N, C, V]`` logits are
    never held, in either direction. Otherwise only completion positions get
    logits, and log-probs are gathered chunk-wise.

    Returns:
        ``(logprobs [N, C], entropy [N, C] or None)``.
    """
    from lit_grpo.objectives import head_logprobs, token_entropy, token_logprobs

    prompts, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    shared = len(prompts) < len(prompt_ids) and completion_ids.shape[1] > 1 and not _checkpoints_activations(model)
    head = _fusable_head(model)
    with _head_removed(model, head):  # the model's "logits" are then its final hidden states
        if shared:
            chunks = _shared_prompt_logits(model, prompts, inverse, prompt_mask, completion_ids, completion_mask)
        else:
            every_row = torch.arange(len(completion_ids), device=completion_ids.device)
            chunks = [(every_row, 0, _full_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask))]
    logprobs = entropy = None
    for rows, column, chunk in chunks:  # [n, c, V] logits (or [n, c, H] hidden states) of `rows`, columns column..+c
        columns = torch.arange(column, column + chunk.shape[1], device=chunk.device)
        tokens = completion_ids[rows[:, None], columns]  # [n, c]
        if head is not None:
            part, part_entropy = head_logprobs(chunk, head.weight, tokens, temperature, with_entropy)
        else:
            part = token_logprobs(chunk, tokens, temperature=temperature)
            part_entropy = token_entropy(chunk.detach(), temperature=temperature) if with_entropy else None
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
    hidden = _base_model(model).get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
    ).last_hidden_state  # [N, P + C, H]
    return hidden[:, P - 1 : P + C - 1]  # [N, C, H]


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
    """Swap the output head for an identity while the model runs (no-op for ``None``)."""
    if head is None:
        yield
        return
    base = _base_model(model)
    base.set_output_embeddings(nn.Identity())
    try:
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
    as wide as its longest row, on the prompt cache indexed out to its rows.
    """
    from transformers import DynamicCache

    from lit_grpo.kv_cache import with_cache

    P = prompt_mask.shape[1]
    unique_ids, unique_mask = prompts[:, :P], prompts[:, P:]  # [U, P] each
    cache = DynamicCache()
    first = model(
        input_ids=unique_ids,
        attention_mask=unique_mask,
        position_ids=(unique_mask.cumsum(-1) - 1).clamp(min=0),
        **with_cache(cache),
        use_cache=True,
        logits_to_keep=1,
    ).logits  # [U, 1, V]
    every_row = torch.arange(len(completion_ids), device=completion_ids.device)
    chunks = [(every_row, 0, first[inverse])]
    lengths = completion_mask.sum(-1)  # [N]
    for rows in length_buckets(lengths):
        width = int(lengths[rows].max())
        if width < 2:
            continue  # only a first token: the prompt pass predicted it
        chunks.append((rows, 1, model(
            input_ids=completion_ids[rows, :width],
            attention_mask=torch.cat([prompt_mask[rows], completion_mask[rows, :width]], dim=1),
            position_ids=prompt_mask[rows].sum(-1, keepdim=True) + torch.arange(width, device=rows.device),
            **with_cache(_cache_rows(cache, inverse[rows])),  # backward sums over each prompt's rows
            use_cache=True,
            logits_to_keep=_positions(0, width - 1, rows.device),
        ).logits))  # [n, width - 1, V]
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


def _cache_rows(cache, rows: torch.Tensor):
    """A new cache holding ``rows`` of ``cache`` (which stays as it is)."""
    selected = copy.copy(cache)
    selected.layers = [copy.copy(layer) for layer in cache.layers]
    selected.batch_select_indices(rows)  # rebinds each copied layer's keys/values
    return selected


def _checkpoints_activations(model: nn.Module) -> bool:
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def _positions(start: int, stop: int, device) -> torch.Tensor:
    # An index tensor rather than an int: logits_to_keep=k slices the hidden states
    # into a non-contiguous view, which the output head then multiplies through a
    # copy of its weight per row (seconds in bf16); indexing gathers them contiguously.
    return torch.arange(start, stop, device=device)
