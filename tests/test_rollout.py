"""Decoding and scoring: our KV-cache loop against HF ``generate``, prompts shared
by a group computed once (in decoding and in the log-prob passes), and the
merged policy that decodes without the adapter's extra work."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from lit_grpo.generation.merged import MergedPolicy, can_merge
from lit_grpo.generation.rollout import SAMPLE_BLOCK, SamplingSpec, encode_prompts, generate, sample
from lit_grpo.model.kv_cache import with_cache
from lit_grpo.model.logprob_passes import _full_logits, _fusable_head, completion_logprobs, length_buckets
from lit_grpo.objectives import token_entropy, token_logprobs


@pytest.fixture()
def tiny(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, tokenizer


def lora(model, seed=0):
    """A LoRA policy whose adapter is not zero (as after some training)."""
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def prompts(tokenizer):
    texts = ["What is 3 + 4?", "Reach 24 with 2, 3 and 4, each used once, please."]  # unequal lengths
    return encode_prompts(tokenizer, texts, max_prompt_length=None)


def test_greedy_decoding_matches_hf_generate_and_each_prompt_is_prefilled_once(tiny):
    model, tokenizer = tiny
    ids, mask = prompts(tokenizer)
    sampling = SamplingSpec(max_new_tokens=7)
    ours = generate(model, tokenizer, ids, mask, sampling, greedy=True)
    with torch.no_grad():
        theirs = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )[:, ids.shape[1] :]  # [B, <=7]
    width = theirs.shape[1]
    assert torch.equal(
        ours.completion_ids[:, :width] * ours.completion_mask[:, :width], theirs * ours.completion_mask[:, :width]
    )
    repeated = generate(model, tokenizer, ids, mask, sampling, greedy=True, repeat=3)  # one prefill per prompt
    assert torch.equal(repeated.completion_ids, ours.completion_ids.repeat_interleave(3, 0))
    assert torch.equal(repeated.prompt_ids, ids.repeat_interleave(3, 0))


def test_ignore_eos_samples_every_completion_to_full_length(tiny):
    model, tokenizer = tiny
    ids, mask = prompts(tokenizer)
    free = generate(model, tokenizer, ids, mask, SamplingSpec(max_new_tokens=6), greedy=True)
    assert free.lengths.tolist() == [6, 6]  # the random model never says EOS on its own
    model.generation_config.eos_token_id = int(free.completion_ids[0, 0])  # row 0's first token now ends it
    assert generate(model, tokenizer, ids, mask, SamplingSpec(max_new_tokens=6), greedy=True).lengths[0] == 1
    full = generate(model, tokenizer, ids, mask, SamplingSpec(max_new_tokens=6, ignore_eos=True), greedy=True)
    assert full.lengths.tolist() == [6, 6] and bool(full.truncated.all())
    assert torch.equal(full.completion_ids, free.completion_ids)  # the same tokens, EOS among them or not
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingSpec(ignore_eos=True, mask_truncated=True)


def test_the_model_fills_the_cache_it_is_handed(tiny):
    """Under the argument name its transformers version reads (an unread name fails silently)."""
    model, tokenizer = tiny
    ids, mask = prompts(tokenizer)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **with_cache(cache), use_cache=True)
    assert cache.get_seq_length() == ids.shape[1]


def test_shared_prompt_logprobs_and_gradients_equal_one_pass_per_row(tiny):
    model, tokenizer = tiny
    policy = lora(model)
    ids, mask = prompts(tokenizer)
    G = 3
    rollout = generate(
        policy,
        tokenizer,
        ids,
        mask,
        SamplingSpec(group_size=G, max_new_tokens=6),
        generator=torch.Generator().manual_seed(0),
    )
    completion_ids, completion_mask = rollout.completion_ids.clone(), rollout.completion_mask.clone()
    for row, length in enumerate([6, 3, 1, 6, 2, 5]):  # completions that ended early: padding, length buckets
        completion_mask[row, length:] = 0
    assert len(length_buckets(completion_mask.sum(-1))) > 1
    rows = (rollout.prompt_ids, rollout.prompt_mask, completion_ids, completion_mask)

    def run(shared: bool):
        policy.zero_grad()
        if shared:
            logprobs, entropy = completion_logprobs(policy, *rows, temperature=0.7, with_entropy=True)
        else:
            logits = _full_logits(policy, *rows)
            logprobs = token_logprobs(logits, completion_ids, temperature=0.7)
            entropy = token_entropy(logits.detach(), temperature=0.7)
        (logprobs * completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        return logprobs.detach(), entropy, grads

    shared, full = run(True), run(False)
    real = completion_mask.bool()
    torch.testing.assert_close(shared[0][real], full[0][real], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1][real], full[1][real], rtol=0, atol=1e-5)
    assert shared[2].keys() == full[2].keys()
    for name, grad in full[2].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-4, atol=1e-5)


def test_merged_policy_decodes_like_the_adapter_and_frees_its_weights(tiny):
    model, tokenizer = tiny
    policy = lora(model)
    assert can_merge(policy)
    merged = MergedPolicy(policy)
    ids, mask = prompts(tokenizer)
    for _ in range(2):  # the second round sees the adapter's update: nothing is cached between rollouts
        with torch.no_grad():
            expected = policy(input_ids=ids, attention_mask=mask).logits
            with merged(policy) as plain:
                got = plain(input_ids=ids, attention_mask=mask).logits
                embedding = policy.get_base_model().model.embed_tokens.weight
                assert plain.model.embed_tokens.weight.data_ptr() == embedding.data_ptr()  # shared, not copied
                assert plain.lm_head.weight.data_ptr() == embedding.data_ptr()  # still tied
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert all(p.is_meta for p in merged.copies[None].model.parameters())  # freed after the rollout
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.add_(0.05)

    sampled = generate(policy, tokenizer, ids, mask, SamplingSpec(max_new_tokens=6), greedy=True)
    with merged(policy) as plain:
        assert generate(plain, tokenizer, ids, mask, SamplingSpec(max_new_tokens=6), greedy=True).texts == sampled.texts
    with MergedPolicy(policy, torch.bfloat16)(policy) as half:
        factors = {name for name in dict(half.named_parameters()) if name.endswith((".down", ".up"))}
        assert factors  # the adapter's update stays apart in its fp32 factors (too small to fold into bf16)
        assert {p.dtype for name, p in half.named_parameters() if name not in factors} == {torch.bfloat16}
        assert half(input_ids=ids, attention_mask=mask).logits.isfinite().all()


def test_fused_head_gradients_reach_a_trained_tied_head(tiny):
    model, tokenizer = tiny  # full fine-tuning: the head (tied to the embedding) trains too
    assert _fusable_head(model) is model.lm_head
    ids, mask = prompts(tokenizer)
    rollout = generate(model, tokenizer, ids, mask, SamplingSpec(group_size=2, max_new_tokens=5))
    rows = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    grads = []
    for fused in (True, False):
        model.zero_grad()
        if fused:
            logprobs, _ = completion_logprobs(model, *rows, temperature=0.9)
        else:
            logprobs = token_logprobs(_full_logits(model, *rows), rollout.completion_ids, temperature=0.9)
        (logprobs * rollout.completion_mask).sum().backward()
        grads.append(model.lm_head.weight.grad.clone())
    assert grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head is back after the pass


def test_soft_capped_logits_keep_the_models_own_head(tiny):
    model, _ = tiny
    model.config.final_logit_softcapping = 30.0  # logits != head(hidden): no fusing
    assert _fusable_head(model) is None


def test_inverse_cdf_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0]).expand(40000, 5)
    draws = sample(probs, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=5).double() / len(draws)
    assert frequencies[1] == 0 and frequencies[4] == 0  # zero mass (e.g. cut by top-p) is never drawn
    torch.testing.assert_close(frequencies, probs[0].double(), rtol=0, atol=0.01)


def test_sampling_crosses_blocks_and_skips_zero_mass_at_block_edges():
    vocab = 3 * SAMPLE_BLOCK + 7  # a last, partial block
    probs = torch.zeros(vocab)
    chosen = [0, SAMPLE_BLOCK - 2, SAMPLE_BLOCK + 5, 3 * SAMPLE_BLOCK + 6]  # the last one in the partial block
    probs[chosen] = torch.tensor([0.1, 0.4, 0.2, 0.3])  # entries at the blocks' ends have no mass
    draws = sample(probs.expand(40000, vocab), torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=vocab).double() / len(draws)
    assert frequencies.sum() == 1 and (frequencies[probs == 0] == 0).all()
    torch.testing.assert_close(frequencies[chosen], probs[chosen].double(), rtol=0, atol=0.01)
    assert sample(torch.eye(vocab)[[SAMPLE_BLOCK - 1, vocab - 1]]).tolist() == [SAMPLE_BLOCK - 1, vocab - 1]


def test_sdpa_gqa_matches_transformers_sdpa_and_saves_no_repeated_keys(tiny_model_dir):
    from lit_grpo.model.attention import use_sdpa_gqa

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    models = [AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa") for _ in range(2)]
    assert use_sdpa_gqa(models[1]) and models[1].config._attn_implementation == "sdpa_gqa"
    ids, mask = prompts(tokenizer)  # left padding: a masked pass, where transformers repeats K/V
    saved_shapes, outputs = [], []
    for model in models:
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(tuple(x.shape)) or x, lambda x: x):
            outputs.append(model(input_ids=ids, attention_mask=mask).logits)
        saved_shapes.append(shapes)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-5)
    heads, kv_heads = models[0].config.num_attention_heads, models[0].config.num_key_value_heads
    repeated = (ids.shape[0], heads, ids.shape[1], models[0].config.head_dim)
    assert (
        kv_heads < heads
        and repeated in saved_shapes[0]
        and saved_shapes[0].count(repeated) > saved_shapes[1].count(repeated)
    )


def test_length_buckets_cover_every_row_once_and_cut_padding():
    lengths = torch.tensor([40, 12, 64, 64, 18, 25, 52, 30])
    buckets = length_buckets(lengths)
    assert sorted(torch.cat(buckets).tolist()) == list(range(8))
    padded = sum(len(rows) * int(lengths[rows].max()) for rows in buckets)
    assert 1 < len(buckets) <= 4 and padded < 0.8 * 8 * 64
    assert [int(lengths[rows].max()) for rows in buckets] == sorted(int(lengths[rows].max()) for rows in buckets)
    assert len(length_buckets(torch.full((32,), 24))) == 1  # equal lengths: one pass
