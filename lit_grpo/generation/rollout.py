"""Rollouts: sample G completions per prompt from the current policy.

Prompts are left-padded so every row's completion starts at the same column;
the completion mask covers real tokens up to and including the EOS that ended
them. A completion that hit ``max_new_tokens`` without EOS is *truncated*; its
mask still covers all its tokens unless ``mask_truncated`` drops it from the
loss (DAPO's "overlong filtering").
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lit_grpo.generation.decode_step import LlamaStep, ModelStep, llama_step_applies
from lit_grpo.generation.episodes import Episodes
from lit_grpo.generation.samples import Rollout
from lit_grpo.model.kv_cache import with_cache
from lit_grpo.training.preemption import check_abort

__all__ = ["Rollout", "SamplingSpec", "encode_prompts", "eos_ids", "finish_rollout", "generate"]


@dataclass
class SamplingSpec:
    """How completions are sampled.

    Args:
        group_size: Completions per prompt (G); group-relative advantages
            (``grpo``, ``rloo``) need G >= 2, a critic (``gae``) works with 1.
        temperature: Sampling temperature (> 0). The objective's log-probs use
            the same temperature, so the ratio compares like with like.
        top_p: Nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: Keep only the k most likely tokens; 0 disables it.
        max_new_tokens: Longest completion, in tokens.
        mask_truncated: Drop completions that never produced EOS from the loss.
        ignore_eos: Never end a completion at EOS: every row samples
            ``max_new_tokens`` tokens and all of them count (fixed-length
            rollouts, e.g. to measure speed on a randomly initialised model).
    """

    group_size: int = 8
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    mask_truncated: bool = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 1:  # >= 2 for group estimators: checked where the estimator is known
            raise ValueError(f"sampling.group_size={self.group_size}; expected >= 1.")
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature={self.temperature}; expected > 0.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p}; expected a value in (0, 1].")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k}; expected >= 0 (0 disables it).")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens}; expected >= 1.")
        if self.ignore_eos and self.mask_truncated:
            raise ValueError(
                "sampling.mask_truncated=True with sampling.ignore_eos=True would drop every "
                "completion from the loss (none ends at EOS); set one of them to false."
            )


def eos_ids(tokenizer, model: nn.Module) -> list[int]:
    """All token ids that end a completion (tokenizer EOS and generation config EOS)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def completion_mask(completion_ids: Tensor, eos: list[int]) -> tuple[Tensor, Tensor]:
    """Mask of real completion tokens (through the first EOS) and the truncated flags."""
    eos = torch.tensor(eos, dtype=completion_ids.dtype, device=completion_ids.device)  # may be empty (ignore_eos)
    is_eos = torch.isin(completion_ids, eos)  # [N, C]
    seen_before = is_eos.cumsum(-1) - is_eos.long()  # EOS tokens strictly before t
    mask = (seen_before == 0).long()  # [N, C]
    truncated = ~is_eos.any(-1)  # [N]
    return mask, truncated


def encode_prompts(
    tokenizer,
    texts: list[str],
    max_prompt_length: int | None,
    overflow: str = "error",
    fields: tuple[str, str] = ("data.prompt.max_length", "data.prompt.overflow"),
) -> tuple[Tensor, Tensor]:
    """Tokenize chat-formatted prompts, left-padded.

    Args:
        tokenizer: A Hugging Face tokenizer with ``padding_side="left"``.
        texts: Prompts with the chat template already applied.
        max_prompt_length: Longest prompt in tokens (``None``: no limit).
        overflow: ``"error"`` refuses longer prompts; ``"truncate"`` keeps their
            last ``max_prompt_length`` tokens (the question's end and the
            assistant header survive) and warns.
        fields: How messages name the two settings (the preference DataModule's differ).

    Returns:
        ``(input_ids [B, P], attention_mask [B, P])``.
    """
    rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if max_prompt_length is not None:
        long = [i for i, r in enumerate(rows) if len(r) > max_prompt_length]
        if long and overflow == "error":
            i = long[0]
            raise ValueError(
                f"prompt {texts[i][:80]!r}... has {len(rows[i])} tokens > {fields[0]}="
                f"{max_prompt_length}; raise the limit or set {fields[1]}='truncate'."
            )
        if long:
            warnings.warn(
                f"{len(long)} prompt(s) longer than {fields[0]}={max_prompt_length} "
                "tokens were truncated from the left.",
                stacklevel=2,
            )
            rows = [r[-max_prompt_length:] for r in rows]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # [B, P]
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # [B, P]
    return ids, mask


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sampling: SamplingSpec,
    *,
    greedy: bool = False,
    repeat: int | None = None,
    generator: torch.Generator | None = None,
    progress=None,
    episodes=None,
) -> Rollout:
    """Sample completions for each prompt with a KV cache.

    Our own decode loop rather than ``model.generate``: rows that finished
    (EOS) leave the decode batch, so late steps only pay for the rows still
    writing, and sampling draws from an explicit ``generator`` (reproducible
    without touching the global RNG). It only calls ``model(...)``, so it works
    on any causal LM, peft-wrapped or FSDP-sharded.

    Args:
        model: The policy (peft or plain HF causal LM, possibly FSDP-sharded).
        tokenizer: Its tokenizer.
        prompt_ids: ``[B, P]`` left-padded prompts.
        prompt_mask: ``[B, P]`` attention mask.
        sampling: Sampling settings.
        greedy: Decode greedily (validation) instead of sampling.
        repeat: Completions per prompt; defaults to ``sampling.group_size``
            (1 when ``greedy``). Rows of one prompt are contiguous.
        generator: Source of randomness for sampling (default: global RNG).
        progress: A tqdm bar advanced once per decoding step, or ``None``.
        episodes: An :class:`~lit_grpo.generation.episodes.EpisodePlan`: run
            episodes with tools, continuing from the KV cache after each
            turn's tool tokens; ``None``: single-turn completions.

    Returns:
        The :class:`Rollout` for ``B * repeat`` rows.
    """
    repeat = repeat or (1 if greedy else sampling.group_size)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)  # [B, P]
    eos = torch.tensor([] if sampling.ignore_eos else eos_ids(tokenizer, model), dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    state = None
    if episodes is not None:
        state = Episodes(episodes, tokenizer, sampling.max_new_tokens, eos.tolist())
    start = time.perf_counter()
    try:
        completion_ids, logprobs = _decode(
            model,
            prompt_ids,
            prompt_mask,
            repeat,
            sampling,
            greedy,
            eos,
            tokenizer.pad_token_id,
            generator,
            progress,
            state,
        )  # [N, C] x 2
    finally:
        model.train(was_training)
        if progress is not None:
            progress.close()
    seconds = time.perf_counter() - start
    if state is not None:
        return state.rollout(prompt_ids, prompt_mask, repeat, greedy, seconds)
    return finish_rollout(
        tokenizer, prompt_ids, prompt_mask, repeat, completion_ids, None if greedy else logprobs, eos.tolist(), seconds
    )


def finish_rollout(
    tokenizer,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    repeat: int,
    completion_ids: Tensor,
    logprobs: Tensor | None,
    eos: list[int],
    seconds: float,
) -> Rollout:
    """A :class:`Rollout` from an engine's raw tokens (what every engine ends with).

    Args:
        tokenizer: Decodes the completions.
        prompt_ids: ``[B, P]`` left-padded prompts, each completed ``repeat`` times.
        prompt_mask: ``[B, P]`` their attention mask.
        repeat: Completions per prompt (rows of one prompt contiguous).
        completion_ids: ``[B * repeat, C]`` sampled tokens; what follows a row's first EOS is ignored.
        logprobs: ``[B * repeat, C]`` the sampler's log-probs of those tokens, or ``None`` (greedy).
        eos: Token ids that end a completion (empty: none does).
        seconds: How long the engine took.
    """
    mask, truncated = completion_mask(completion_ids, eos)
    completion_ids = completion_ids.masked_fill(mask == 0, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if logprobs is not None:
        logprobs = logprobs.masked_fill(mask == 0, 0.0).cpu()
    return Rollout(
        prompt_ids.repeat_interleave(repeat, 0),
        prompt_mask.repeat_interleave(repeat, 0),
        completion_ids,
        mask,
        truncated,
        texts,
        seconds,
        logprobs,
    )


def _decode(
    model, prompt_ids, prompt_mask, repeat, sampling, greedy, eos, pad, generator, progress, episodes=None
) -> tuple[Tensor, Tensor]:
    """Token ids and their log-probs, ``[B * repeat, max_new_tokens]`` each; each prompt's
    cache is computed once and repeated. With ``episodes`` (an
    :class:`~lit_grpo.generation.episodes.Episodes`) each step feeds every row
    a token, sampled or its next tool token, and the episodes record them."""
    from transformers import DynamicCache  # transformers loads on first use, not with this module

    n = prompt_ids.shape[0] * repeat
    width = sampling.max_new_tokens if episodes is None else episodes.width
    tokens = torch.full((n, width), pad, dtype=torch.long, device=prompt_ids.device)
    logprobs = torch.zeros(n, width, device=prompt_ids.device)
    active = torch.arange(n, device=prompt_ids.device)  # rows still writing
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]: left padding shifts starts
    cache = DynamicCache()
    logits = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        **with_cache(cache),
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]  # [B, V]
    if repeat > 1:  # the samples of one prompt share its prefill
        cache.batch_repeat_interleave(repeat)
        logits = logits.repeat_interleave(repeat, 0)  # [n, V]
    attention = prompt_mask.repeat_interleave(repeat, 0)  # [n, P]
    if llama_step_applies(model, prompt_ids.shape[1] + width):
        forward = LlamaStep(model, cache, attention, width)
    else:
        forward = ModelStep(model, cache, attention)
    next_position = positions[:, -1].repeat_interleave(repeat, 0) + 1  # [n_active]
    for step in range(width):
        if episodes is None:
            token, logprob = _next_token(logits, sampling, greedy, generator)  # [n_active] x 2
            tokens[active, step] = token
            if logprob is not None:
                logprobs[active, step] = logprob
            alive = ~torch.isin(token, eos)
        else:
            token, alive = _episode_step(episodes, active, logits, sampling, greedy, generator)
            tokens[active, step] = token
        if progress is not None:
            progress.update(1)
        check_abort()  # a rollout stops here on SIGTERM (lit_grpo.training.preemption)
        if step == width - 1 or not alive.any():
            break
        if not alive.all():  # finished rows leave the batch, and their cache with them
            keep = alive.nonzero().squeeze(-1)
            active, token, next_position = active[keep], token[keep], next_position[keep]
            forward.select(keep)
        logits = forward(token, next_position)  # [n_active, V]
        next_position = next_position + 1
    return tokens, logprobs


def _episode_step(
    episodes, active: Tensor, logits: Tensor, sampling: SamplingSpec, greedy: bool, generator
) -> tuple[Tensor, Tensor]:
    """One step of episodes: rows with tool tokens queued feed the next one, the others sample;
    turns that end run their calls. Returns the tokens fed ``[n_active]`` and which rows go on."""
    rows = active.tolist()
    forcing = [j for j, row in enumerate(rows) if episodes.queue[row]]
    sampling_rows = [j for j, row in enumerate(rows) if not episodes.queue[row]]
    token = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    ended = {}
    if sampling_rows:
        chosen = logits if not forcing else logits[sampling_rows]  # every row samples: the single-turn draws
        sampled, logprob = _next_token(chosen, sampling, greedy, generator)  # [n_sampling] x 2
        token[sampling_rows] = sampled
        values = [None] * len(sampling_rows) if logprob is None else logprob.tolist()
        for j, value, t in zip(sampling_rows, values, sampled.tolist()):
            reason = episodes.sample(rows[j], t, value)
            if reason is not None:
                ended[rows[j]] = reason
    for j in forcing:
        token[j] = episodes.force(rows[j])
    episodes.end_turns(ended)
    alive = torch.tensor([not episodes.done[row] for row in rows], device=logits.device)
    return token, alive


def _next_token(logits: Tensor, sampling: SamplingSpec, greedy: bool, generator) -> tuple[Tensor, Tensor | None]:
    """Pick the next token from ``[n, V]`` logits: argmax, or sample after top-k/top-p.

    Returns the tokens and, when sampling, their log-probs under the
    distribution they were drawn from (temperature, then top-k/top-p
    renormalised: with neither, exactly what the objective computes).
    """
    if greedy:
        return logits.argmax(-1), None
    logits = logits.float() / sampling.temperature  # [n, V]
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (cumulative - sorted_logits.softmax(-1)) >= sampling.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    token = sample(logits.softmax(-1), generator)  # [n]
    return token, logits.gather(-1, token[:, None]).squeeze(-1) - logits.logsumexp(-1)


SAMPLE_BLOCK = 256
"""Vocabulary entries per block in :func:`sample`'s two-level search."""


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row of ``[n, V]`` probabilities, by inverting the CDF.

    One uniform number per row instead of ``torch.multinomial``'s one per
    vocabulary entry: on a CPU its exponential draws over 49k entries take
    longer than the decode step of a small model. The CDF is inverted in two
    levels, first over blocks of :data:`SAMPLE_BLOCK` entries, then inside the
    chosen block, so the float64 cumulative sums run over ``V / 256 + 256``
    entries per row instead of ``V``.
    Float64 keeps rounding from shifting mass between tokens at float32
    resolution, and a token with probability 0 (cut by top-k/top-p) is never
    drawn.
    """
    n, vocab = probs.shape
    if vocab % SAMPLE_BLOCK:
        probs = nn.functional.pad(probs, (0, -vocab % SAMPLE_BLOCK))
    blocks = probs.view(n, -1, SAMPLE_BLOCK)  # [n, nb, w]
    mass = blocks.sum(-1).double()  # [n, nb]
    cdf = mass.cumsum(-1)  # [n, nb]
    target = torch.rand(n, 1, generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # [n, 1]
    block = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[1] - 1)  # [n, 1]: first block past it
    target = target - (cdf.gather(-1, block) - mass.gather(-1, block))  # the mass still to cover inside it
    inside = blocks.gather(1, block[:, :, None].expand(-1, 1, SAMPLE_BLOCK)).squeeze(1)  # [n, w]
    index = torch.searchsorted(inside.double().cumsum(-1), target, right=True)  # [n, 1]
    # rounding may put the target at the block's very end: take its last token with mass
    last = (torch.arange(SAMPLE_BLOCK, device=probs.device) * (inside > 0)).amax(-1, keepdim=True)  # [n, 1]
    return (block * SAMPLE_BLOCK + torch.minimum(index, last)).squeeze(-1)
