"""Gradient checkpointing composes with the shared-prompt log-prob passes.

Rows that share a prompt run it once and read its key/value cache; a
checkpointed layer reruns in backward. The recomputation must read the cache
its first run read (not one it appended to), and the shared path must still
be the one taken. Tolerance: fp32 throughout, log-probs within 1e-5 and LoRA
gradients within rtol 1e-4 / atol 1e-5 of the reference (what differs is
only the order of float sums: shared prompt vs one pass per row; measured
max differences 1e-6 and 3e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_grpo.generation.rollout import encode_prompts
from lit_grpo.model import logprob_passes
from lit_grpo.model.attention import prefix_causal_attention, use_sdpa_gqa
from lit_grpo.model.logprob_passes import _full_logits, completion_logprobs
from lit_grpo.objectives import token_logprobs

G = 4
LENGTHS = [9, 5, 2, 7, 1, 9, 4, 6]  # two prompts x G rows, completions that ended early: several length buckets
PASS_TOKENS = 12  # checkpointed passes of one row 7-9 wide, two rows 4-6 wide


@pytest.fixture(autouse=True)
def small_passes(monkeypatch):
    monkeypatch.setattr(logprob_passes, "CHECKPOINTED_PASS_TOKENS", PASS_TOKENS)


@pytest.fixture()
def rows(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    ids, mask = encode_prompts(
        tokenizer, ["What is 3 + 4?", "Reach 24 with 2, 3 and 4, each used once."], max_prompt_length=None
    )  # unequal lengths: left padding
    generator = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, len(tokenizer), (len(LENGTHS), max(LENGTHS)), generator=generator)
    completion_mask = (torch.arange(max(LENGTHS)) < torch.tensor(LENGTHS)[:, None]).long()  # [N, C]
    weights = torch.randn(completion_ids.shape, generator=generator)  # [N, C], a loss with per-token signs
    return ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), completion_ids, completion_mask, weights


def policy(tiny_model_dir, dropout: float = 0.0, checkpointing: bool = False, reentrant: bool = False):
    """A LoRA policy in training mode whose adapter is not zero (as after some training)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False)
    ).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def logprobs_and_grads(model, rows, shared: bool = True, seed: int = 0):
    prompt_ids, prompt_mask, completion_ids, completion_mask, weights = rows
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout masks in both runs
    if shared:
        logprobs, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7)
    else:  # one full pass per row, the reference
        logits = _full_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        logprobs = token_logprobs(logits, completion_ids, temperature=0.7)
    (logprobs * completion_mask * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logprobs.detach(), grads


def assert_same(got, expected, real: torch.Tensor):
    torch.testing.assert_close(got[0][real], expected[0][real], rtol=0, atol=1e-5)
    assert got[1].keys() == expected[1].keys() and any("lora_A" in name for name in got[1])
    for name, grad in expected[1].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_shared_prompts_match_one_full_pass_per_row(tiny_model_dir, rows, reentrant):
    """Log-probs and LoRA gradients, whichever checkpoint function the model was given."""
    expected = logprobs_and_grads(policy(tiny_model_dir), rows, shared=False)
    got = logprobs_and_grads(policy(tiny_model_dir, checkpointing=True, reentrant=reentrant), rows)
    assert_same(got, expected, rows[3].bool())


def test_recomputation_replays_the_adapters_dropout(tiny_model_dir, rows, monkeypatch):
    monkeypatch.setattr(logprob_passes, "CHECKPOINTED_PASS_TOKENS", 10**6)  # the same passes, the same masks
    expected = logprobs_and_grads(policy(tiny_model_dir, dropout=0.3), rows)
    got = logprobs_and_grads(policy(tiny_model_dir, dropout=0.3, checkpointing=True), rows)
    assert_same(got, expected, rows[3].bool())


def test_checkpointing_keeps_the_shared_prompt_path(tiny_model_dir, rows):
    """The prompt runs once per distinct prompt, every pass reruns once in backward, and the model's
    own checkpointing is back afterwards."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = rows
    model = policy(tiny_model_dir, checkpointing=True)
    layers = model.get_base_model().model.layers
    calls = []  # (rows, width) of every run of the first decoder layer, recomputations included
    layers[0].input_layernorm.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape[:2])))
    logprobs, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0)
    forward = list(calls)
    # the 2 distinct prompts once, then the completion tokens in passes of at most PASS_TOKENS (or one row);
    # one pass per row would be a single call of (8, P + C)
    assert forward[0] == (2, prompt_ids.shape[1])
    assert all(n * width <= PASS_TOKENS or n == 1 for n, width in forward[1:])
    assert sum(n for n, _ in forward[1:]) >= sum(length > 1 for length in LENGTHS)  # every row past its first token
    logprobs.sum().backward()
    assert sorted(calls[len(forward) :]) == sorted(forward)  # each pass recomputed once, the prompt's too
    assert all(layer.gradient_checkpointing for layer in layers)
    assert all("forward" not in vars(layer) for layer in layers)


@pytest.mark.parametrize(
    "length, autocast", [(9, False), (9, True), (800, False)], ids=["fp32", "bf16 autocast", "800 queries"]
)
def test_prefix_causal_attention_matches_one_masked_call(length, autocast):
    """The prompt's keys and the causal ones apart, merged: one masked SDPA call's output and gradients
    (under bf16 autocast from an fp32 stream's fp32 queries and keys and bf16 values, as SDPA there;
    800 queries run the kernels' several blocks, the skipped ones above the diagonal among them)."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, prompt, dim = 3, 6, 2, 5, 8
    query = torch.randn(batch, heads, length, dim, generator=generator, requires_grad=True)
    key, value = (torch.randn(batch, kv_heads, prompt + length, dim, generator=generator) for _ in range(2))
    key.requires_grad_(), value.requires_grad_()
    prefix_mask = torch.ones(batch, prompt, dtype=torch.bool)
    prefix_mask[0, :2] = prefix_mask[2, :4] = False  # left padding
    prefix_mask[1] = False  # no prompt token at all: only its own keys count
    mask = torch.cat(
        [prefix_mask[:, None].expand(-1, length, -1), torch.ones(length, length).tril().bool().expand(batch, -1, -1)],
        -1,
    )
    weights = torch.randn(batch, heads, length, dim, generator=generator)
    stored = value.detach().to(torch.bfloat16).requires_grad_() if autocast else value
    results = []
    for run in (
        lambda: F.scaled_dot_product_attention(query, key, stored, attn_mask=mask[:, None], enable_gqa=True),
        lambda: prefix_causal_attention(query, key, stored, prefix_mask, dim**-0.5),
    ):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = run()
        grads = torch.autograd.grad((out.float() * weights).sum(), (query, key, stored))
        results.append((out, *grads))
    for got, expected in zip(results[1], results[0]):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0.02 if autocast else 1e-5)


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "whole buckets"])
def test_long_passes_attend_through_the_split_and_match_one_full_pass_per_row(
    tiny_model_dir, rows, monkeypatch, checkpointing
):
    """Every completion pass at least SPLIT_FROM_TOKENS wide splits its attention, no narrower one does,
    and the log-probs and LoRA gradients are those of one full pass per row."""
    monkeypatch.setattr(logprob_passes, "SPLIT_FROM_TOKENS", 4)
    expected = logprobs_and_grads(policy(tiny_model_dir), rows, shared=False)
    model = policy(tiny_model_dir, checkpointing=checkpointing)
    assert use_sdpa_gqa(model.get_base_model())
    passes = []  # (width, split) of each pass through the first layer; the prompt pass first
    first = model.get_base_model().model.layers[0]
    first.register_forward_pre_hook(
        lambda layer, args, kwargs: passes.append((args[0].shape[1], "prefix_mask" in kwargs)), with_kwargs=True
    )
    got = logprobs_and_grads(model, rows)
    assert_same(got, expected, rows[3].bool())
    assert not passes[0][1] and any(split for _, split in passes)
    assert all(split == (width >= 4) for width, split in passes[1:])
