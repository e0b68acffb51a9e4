"""QLoRA on CPU: a 4-bit NF4 base with a LoRA adapter trains, and its reference
is the same 4-bit base with the adapter disabled.

bitsandbytes >= 0.45 runs 4-bit on CPU (a slow path); where it cannot, the
tests skip.
"""

from __future__ import annotations

import pytest
import torch

from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.model.policy import LoraSpec, PolicySpec, build_policy, keep_trainable_4bit_layout, load_base_model
from lit_grpo.objectives import grpo_loss


def _bitsandbytes_4bit_works() -> bool:
    try:
        import bitsandbytes.functional as F

        F.quantize_4bit(torch.randn(64, 64), quant_type="nf4")
        return True
    except Exception:  # missing package, or no CPU backend in this build
        return False


pytestmark = pytest.mark.skipif(not _bitsandbytes_4bit_works(), reason="bitsandbytes 4-bit does not run here")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny test Llama, twice as wide: bitsandbytes' CPU 4-bit kernels pack
    64x32 quantization blocks, so every linear layer needs 64 | inputs, 32 | outputs."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size, config.head_dim, config.num_key_value_heads = 64, 128, 16, 4
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama-64")
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return str(folder)


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, 200, (4, 5), generator=generator)  # [N, P]
    completion_ids = torch.randint(10, 200, (4, 6), generator=generator)  # [N, C]
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": torch.ones_like(completion_ids),
    }


def _logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return completion_logprobs(model, **batch, temperature=1.0)[0]


def test_qlora_step_trains_the_adapter_and_the_reference_is_the_4bit_base(model_dir):
    spec = PolicySpec(name_or_path=model_dir, load_in_4bit=True, lora=LoraSpec(r=4, alpha=8))
    policy, reference = build_policy(spec)
    assert reference is None  # the reference is the adapter-disabled policy, no copy
    adapter = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    assert adapter and all("lora_" in n for n in adapter)

    quantized = {n: p.detach().clone() for n, p in policy.named_parameters() if p.dtype == torch.uint8}
    assert quantized  # the base linear layers really are packed 4-bit weights
    batch = _batch()
    logprobs = completion_logprobs(policy, **batch, temperature=1.0)[0]  # [N, C]
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])  # [N]
    loss = grpo_loss(logprobs, logprobs.detach(), advantages, batch["completion_mask"], beta=0.0).loss
    loss.backward()
    torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2).step()

    after = dict(policy.named_parameters())
    assert any(not torch.equal(after[n], adapter[n]) for n in adapter)
    for name, packed in quantized.items():
        assert torch.equal(after[name], packed), name

    base = load_base_model(spec)  # a fresh 4-bit base, no adapter at all
    keep_trainable_4bit_layout(base)  # on the kernels a policy runs (build_policy's)
    policy.eval()  # as PolicyModule.reference_model scores it
    with policy.disable_adapter():
        reference_logprobs = _logprobs(policy, batch)
    torch.testing.assert_close(reference_logprobs, _logprobs(base, batch), rtol=0, atol=0)
    # ...while the trained adapter does change the policy.
    assert not torch.allclose(_logprobs(policy, batch), reference_logprobs)


def test_a_4bit_reward_model_exports_adapter_and_head_only_and_says_so(model_dir, tmp_path):
    # The sequence-classification folder would need unquantized weights; the adapter + head is
    # what RewardModel(shared_base=true) loads on the same 4-bit base.
    from lit_grpo.algorithms.reward_model import RewardModelModule
    from lit_grpo.rewards.reward_model import ADAPTER_DIR, HEAD_FILE

    module = RewardModelModule(
        policy=PolicySpec(name_or_path=model_dir, load_in_4bit=True, lora=LoraSpec(r=4, alpha=8))
    )
    module.configure_model()
    with pytest.warns(UserWarning, match=r"needs unquantized weights \(these are 4-bit\), so only adapter/ is written"):
        module.export_adapter(tmp_path / "rm")
    assert sorted(p.name for p in (tmp_path / "rm").iterdir()) == [ADAPTER_DIR]
    assert (tmp_path / "rm" / ADAPTER_DIR / HEAD_FILE).is_file()


def test_a_rollout_leaves_the_4bit_training_path_as_it_was(tmp_path, monkeypatch):
    # A Qwen2-shaped model: its q/k/v projections have biases. A rollout runs the policy in eval mode
    # without grad; on a CPU with AVX-512 BF16, bitsandbytes then repacked the 4-bit weights for its
    # inference kernel, which training went on to use: no gradient through the base layers (the lower
    # adapters' gradients came out wrong) and, with a bias, an in-place error.
    import bitsandbytes.nn.modules

    from lit_grpo.model.random_models import save_random_model

    # As on a CPU with AVX-512 BF16 units (this project's machine has them), so the test bites on any host.
    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)
    folder = save_random_model("tiny-qwen2", tmp_path / "tiny-qwen2", torch.float32)
    policy, _ = build_policy(PolicySpec(name_or_path=str(folder), load_in_4bit=True, lora=LoraSpec(r=4)))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)  # a trained adapter: gradients reach lora_A through the base path
    assert policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer.bias is not None
    layers = [m for m in policy.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert layers and not any(layer.support_avx512bf16_for_cpu for layer in layers)

    def gradients(batch) -> dict[str, torch.Tensor]:
        policy.train()
        policy.zero_grad()
        completion_logprobs(policy, **batch, temperature=1.0)[0].sum().backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}

    batch = _batch()
    before = gradients(batch)
    policy.eval()
    _logprobs(policy, batch)  # as a rollout runs it
    after = gradients(batch)
    assert not any(getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in layers)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
