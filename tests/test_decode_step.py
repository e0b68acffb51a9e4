"""The lean Llama decode step against the model's own forward, step by step."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lit_grpo.generation.decode_step import LlamaStep, Matmul, ModelStep, can_pack, llama_step_applies
from lit_grpo.generation.merged import LowRankLinear, MergedPolicy, low_rank_layers
from lit_grpo.model.kv_cache import with_cache

SIZES = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build(config_class, model_class, **extra):
    torch.manual_seed(0)
    return model_class(config_class(**SIZES, **extra)).eval()


def prefill(model, ids, mask):
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(cache)).logits[:, -1]
    return cache, positions[:, -1] + 1, logits


def left_padded(rows=3, width=6):
    ids = torch.randint(1, 97, (rows, width), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[1, :2] = 0  # shorter prompts, padded on the left
    mask[2, :4] = 0
    return ids, mask


@pytest.mark.parametrize(
    "family",
    [
        (LlamaConfig, LlamaForCausalLM, {}),
        (LlamaConfig, LlamaForCausalLM, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        (Qwen2Config, Qwen2ForCausalLM, {}),  # biased q/k/v projections
        (MistralConfig, MistralForCausalLM, {"sliding_window": 64}),  # a window wider than the sequence
    ],
    ids=["llama", "llama-rope-scaling", "qwen2", "mistral"],
)
def test_llama_step_gives_the_models_logits_at_every_step(family):
    model = build(*family[:2], **family[2])
    ids, mask = left_padded()
    assert llama_step_applies(model, ids.shape[1] + 5)
    ours_cache, position, _ = prefill(model, ids, mask)
    their_cache, _, _ = prefill(model, ids, mask)
    ours, theirs = LlamaStep(model, ours_cache, mask, new_tokens=5), ModelStep(model, their_cache, mask)
    tokens = torch.tensor([5, 6, 7])
    with torch.no_grad():
        for step in range(5):
            if step == 2:  # row 1 finished: it leaves both batches
                keep = torch.tensor([0, 2])
                ours.select(keep)
                theirs.select(keep)
                tokens, position = tokens[keep], position[keep]
            expected = theirs(tokens, position)
            got = ours(tokens, position)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            tokens, position = expected.argmax(-1), position + 1


def test_llama_step_applies_only_where_it_is_exact():
    llama = build(LlamaConfig, LlamaForCausalLM)
    assert llama_step_applies(llama, 100)
    assert not llama_step_applies(get_peft_model(llama, LoraConfig(r=2, target_modules="all-linear")), 100)
    mistral = build(MistralConfig, MistralForCausalLM, sliding_window=16)
    assert llama_step_applies(mistral, 16) and not llama_step_applies(mistral, 17)  # the window would cut in
    assert not llama_step_applies(build(Qwen3Config, Qwen3ForCausalLM, head_dim=8), 100)  # q/k norms


def test_the_merged_skeleton_takes_the_llama_step():
    policy = get_peft_model(build(LlamaConfig, LlamaForCausalLM), LoraConfig(r=2, target_modules="all-linear"))
    with MergedPolicy(policy)(policy) as plain:
        assert llama_step_applies(plain, 100)


def bf16_lora(update: float):
    """A bf16 Llama with an fp32 LoRA adapter whose update is ``update``-sized (a bf16 policy)."""
    policy = get_peft_model(
        build(LlamaConfig, LlamaForCausalLM).to(torch.bfloat16), LoraConfig(r=2, target_modules="all-linear")
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
            if "lora_B" in name:
                p.normal_(0, update, generator=generator)
    return policy


def test_a_bf16_copy_keeps_the_adapter_update_apart_instead_of_rounding_it_away():
    policy = bf16_lora(1e-3)
    assert len(low_rank_layers(policy, None)) == 14  # 7 projections x 2 layers: bf16 weights, fp32 adapter
    fp32 = get_peft_model(build(LlamaConfig, LlamaForCausalLM), LoraConfig(r=2, target_modules="all-linear"))
    assert low_rank_layers(fp32, None) == {}  # fp32 weights take the update exactly: merged as before
    assert len(low_rank_layers(fp32, torch.bfloat16)) == 14  # a bf16 decoding copy of an fp32 policy
    ids, mask = left_padded()
    with torch.no_grad():
        expected = policy(input_ids=ids, attention_mask=mask).logits.float()
        with policy.disable_adapter():
            base = policy(input_ids=ids, attention_mask=mask).logits.float()
        folded = copy.deepcopy(policy).merge_and_unload()  # W + delta rounded to bf16
        folded_error = (folded(input_ids=ids, attention_mask=mask).logits.float() - expected).abs().max()
        with MergedPolicy(policy)(policy) as plain:
            assert sum(isinstance(m, LowRankLinear) for m in plain.modules()) == 14
            # the lean step takes the copy wherever this CPU packs bf16 weights (not on a Zen 3)
            assert llama_step_applies(plain, 100) == can_pack(torch.device("cpu"), torch.bfloat16)
            error = (plain(input_ids=ids, attention_mask=mask).logits.float() - expected).abs().max()
    assert (expected - base).abs().max() > 0 and folded_error > 0
    assert error <= folded_error / 10  # peft's own arithmetic: bf16 base output + fp32 update, rounded once


def test_an_fp32_decoding_copy_of_a_bf16_policy_merges_the_whole_update():
    # generation.dtype: float32 on a bf16 policy: W + delta is rounded once, to fp32, not first to bf16.
    policy = bf16_lora(1e-3)
    exact = copy.deepcopy(policy)
    for p in exact.parameters():
        p.data = p.data.float()
    ids, mask = left_padded()
    with torch.no_grad():
        expected = exact.merge_and_unload()(input_ids=ids, attention_mask=mask).logits
        with MergedPolicy(policy, torch.float32)(policy) as plain:
            assert not any(isinstance(m, LowRankLinear) for m in plain.modules())
            got = plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_under_bf16_autocast_an_fp32_policy_decodes_with_its_update_apart_too():
    # precision="bf16-mixed": fp32 weights, but every matmul rounds them to bf16, so W + delta merged
    # in fp32 would lose the update the same way (validation decodes under autocast).
    policy = bf16_lora(1e-3)
    for name, p in policy.named_parameters():
        p.data = p.data.float()
    merged = MergedPolicy(policy)
    ids, mask = left_padded()
    with torch.no_grad():
        with merged(policy) as plain:
            assert not any(isinstance(m, LowRankLinear) for m in plain.modules())  # fp32 decoding: merged
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = policy(input_ids=ids, attention_mask=mask).logits.float()
            folded = copy.deepcopy(policy).merge_and_unload()
            folded_error = (folded(input_ids=ids, attention_mask=mask).logits.float() - expected).abs().max()
            with merged(policy) as plain:
                assert sum(isinstance(m, LowRankLinear) for m in plain.modules()) == 14
                error = (plain(input_ids=ids, attention_mask=mask).logits.float() - expected).abs().max()
    assert folded_error > 0 and error <= folded_error / 4


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="this CPU cannot pack bf16 weights")
def test_matmul_adds_a_low_rank_update_too_small_for_the_bf16_weights():
    torch.manual_seed(0)
    layers = []
    for out in (40, 8):
        linear = torch.nn.Linear(24, out, bias=False).to(torch.bfloat16)
        layer = LowRankLinear(linear, 2, torch.float32)
        layer.down = torch.nn.Parameter(torch.randn(2, 24), requires_grad=False)
        layer.up = torch.nn.Parameter(torch.randn(out, 2) * 1e-4, requires_grad=False)  # a few ulps of W at most
        layers.append(layer)
    layers.append(torch.nn.Linear(24, 16, bias=True).to(torch.bfloat16))  # a plain layer in the same group
    x = torch.randn(8, 24).to(torch.bfloat16)
    with torch.no_grad():
        expected = torch.cat([m(x) for m in layers], -1).float()
        plain = torch.cat([torch.nn.functional.linear(x, m.weight, m.bias) for m in layers], -1).float()
        got = Matmul(*layers)(x).float()
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < (plain - expected).abs().max() / 4  # the update is there
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)


def test_matmul_fuses_and_packs_linear_layers():
    assert can_pack(torch.device("cpu"), torch.float32)  # oneDNN ships with every x86 CPU build of torch
    assert not can_pack(torch.device("meta"), torch.float32)
    assert not can_pack(torch.device("cpu"), torch.float64)  # oneDNN has no float64 matmul
    torch.manual_seed(0)
    q, k = torch.nn.Linear(24, 40), torch.nn.Linear(24, 8, bias=False)
    for shape in ((1, 24), (8, 24), (3, 5, 24)):
        x = torch.randn(shape)
        expected = torch.cat([q(x), k(x)], -1).detach()  # the missing bias counts as zeros
        torch.testing.assert_close(Matmul(q, k)(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(Matmul(k)(x), k(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="this CPU cannot pack bf16 weights")
def test_under_bf16_autocast_the_step_packs_in_bf16_and_follows_the_model():
    # precision="bf16-mixed" runs greedy validation under CPU autocast: the prefill's cache comes out
    # in bf16 and the step must multiply in bf16 too (fp32 packed weights got bf16 inputs and oneDNN
    # refused: "could not create a primitive descriptor for the inner product").
    model = build(LlamaConfig, LlamaForCausalLM)
    ids, mask = left_padded()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert llama_step_applies(model, ids.shape[1] + 4)
        ours_cache, position, _ = prefill(model, ids, mask)
        their_cache, _, _ = prefill(model, ids, mask)
        ours, theirs = LlamaStep(model, ours_cache, mask, new_tokens=4), ModelStep(model, their_cache, mask)
        assert all(m.dtype == torch.bfloat16 for m in ours.qkv + [ours.head])
        tokens = torch.tensor([5, 6, 7])
        for _ in range(4):
            expected, got = theirs(tokens, position), ours(tokens, position)
            assert got.dtype == expected.dtype == torch.bfloat16
            # bf16 keeps 8 bits of mantissa; the two sum in other orders
            torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=3e-2)
            tokens, position = expected.argmax(-1), position + 1
    step = LlamaStep(model, prefill(model, ids, mask)[0], mask, new_tokens=1)  # autocast off: the weights' dtype
    assert step.head.dtype == torch.float32


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="this CPU cannot pack bf16 weights")
def test_the_step_follows_a_bf16_model_with_an_fp32_residual_stream():
    # A bf16 policy keeps its residual stream in fp32 (lit_grpo.model.stream): its prefill caches fp32
    # keys (rotated in fp32) beside bf16 values, which the step must hold in one dtype.
    from lit_grpo.model.stream import keep_stream_fp32

    model = keep_stream_fp32(build(LlamaConfig, LlamaForCausalLM).to(torch.bfloat16))
    ids, mask = left_padded()
    assert llama_step_applies(model, ids.shape[1] + 4)
    ours_cache, position, _ = prefill(model, ids, mask)
    their_cache, _, _ = prefill(model, ids, mask)
    assert {ours_cache.layers[0].keys.dtype, ours_cache.layers[0].values.dtype} == {torch.float32, torch.bfloat16}
    ours, theirs = LlamaStep(model, ours_cache, mask, new_tokens=4), ModelStep(model, their_cache, mask)
    tokens = torch.tensor([5, 6, 7])
    with torch.no_grad():
        for _ in range(4):
            expected, got = theirs(tokens, position), ours(tokens, position)
            torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=3e-2)
            tokens, position = expected.argmax(-1), position + 1
