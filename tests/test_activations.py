"""Fewer saved activations (lit_grpo.model.activations): the same forward, the same or bf16-close gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny_model
from transformers import AutoTokenizer

from lit_grpo.model.activations import recompute_swiglu, share_adapter_input_casts
from lit_grpo.model.stream import keep_stream_fp32


def _saved_bytes(fn) -> tuple[int, object]:
    """Bytes of the distinct storages autograd keeps for the backward of ``fn()``, parameters left out."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    return AutoTokenizer.from_pretrained(embedded_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_swiglu_is_bitwise_the_default_and_keeps_less(tokenizer, dtype):
    plain = keep_stream_fp32(build_tiny_model(tokenizer).to(dtype))
    recomputed = copy.deepcopy(plain)
    assert recompute_swiglu(recomputed) == 2  # both layers' MLPs
    assert recompute_swiglu(recomputed) == 0  # idempotent
    ids = torch.randint(0, len(tokenizer), (3, 17), generator=torch.Generator().manual_seed(0))
    kept_plain, loss_plain = _saved_bytes(lambda: _loss(plain, ids))
    kept_recomputed, loss_recomputed = _saved_bytes(lambda: _loss(recomputed, ids))
    loss_plain.backward()
    loss_recomputed.backward()
    assert torch.equal(loss_plain, loss_recomputed)
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad), name
    # one [rows, tokens, intermediate] tensor per MLP fewer
    assert kept_plain - kept_recomputed == 2 * ids.numel() * 64 * torch.finfo(dtype).bits // 8


def test_shared_adapter_casts_keep_the_forward_and_keep_less(tokenizer):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = keep_stream_fp32(build_tiny_model(tokenizer).to(torch.bfloat16))
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    plain = get_peft_model(base, config)
    shared = copy.deepcopy(plain)
    assert share_adapter_input_casts(shared) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    ids = torch.randint(0, len(tokenizer), (3, 17), generator=torch.Generator().manual_seed(1))
    kept_plain, loss_plain = _saved_bytes(lambda: _loss(plain, ids))
    kept_shared, loss_shared = _saved_bytes(lambda: _loss(shared, ids))
    assert torch.equal(loss_plain, loss_shared)
    # q/k/v share one cast of the attention's input, gate/up one of the MLP's: 3 bf16 copies fewer per layer
    assert kept_plain - kept_shared == 2 * 3 * ids.numel() * 32 * 2
    loss_plain.backward()
    loss_shared.backward()
    pairs = [(n, a, b) for (n, a), b in zip(plain.named_parameters(), shared.parameters()) if a.requires_grad]
    assert pairs
    for name, a, b in pairs:
        # the adapters' input gradient is summed in bf16 before it joins the base layers' in fp32
        torch.testing.assert_close(b.grad, a.grad, rtol=2e-2, atol=1e-4, msg=name)


def test_shared_adapter_casts_pass_fp32_without_autocast_through(tokenizer):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    plain = get_peft_model(
        build_tiny_model(tokenizer), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    shared = copy.deepcopy(plain)
    share_adapter_input_casts(shared)
    ids = torch.randint(0, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(2))
    _loss(plain, ids).backward()
    _loss(shared, ids).backward()
    for a, b in zip(plain.parameters(), shared.parameters()):
        if a.requires_grad:
            assert torch.equal(a.grad, b.grad)


def test_shared_casts_keep_nothing_alive_and_copy_empty(tokenizer):
    from peft import LoraConfig, get_peft_model

    from lit_grpo.model.activations import _CastOnce

    policy = get_peft_model(
        keep_stream_fp32(build_tiny_model(tokenizer).to(torch.bfloat16)), LoraConfig(r=4, target_modules="all-linear")
    )
    share_adapter_input_casts(policy)
    caches = {id(h): h for m in policy.modules() for h in m._forward_pre_hooks.values() if isinstance(h, _CastOnce)}
    assert len(caches) == 2  # one per decoder layer
    ids = torch.randint(0, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(3))
    logits = policy(input_ids=ids).logits  # the graph keeps the casts, the caches only point at them
    assert all(c.cast() is not None for c in caches.values())
    copied = copy.deepcopy(policy)
    assert all(
        h.cast() is None for m in copied.modules() for h in m._forward_pre_hooks.values() if isinstance(h, _CastOnce)
    )
    torch.testing.assert_close(copied(input_ids=ids).logits, logits, rtol=0, atol=0)
    del logits
    assert all(c.cast() is None and c.source() is None for c in caches.values())
