"""Precision: Lightning's settings around GRPOModule on a CPU, the bf16 policy, the objectives in bf16."""

from __future__ import annotations

import copy
import inspect

import lightning as L
import pytest
import torch
from test_module import make, trainer

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.model.policy import PolicySpec, build_policy
from lit_grpo.objectives import bradley_terry_loss, dpo_loss, ppo_loss, sft_loss


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_plain_trainer_trains_and_validates_at_bf16(tmp_path, tiny_model_dir, precision):
    # bf16-mixed used to die in the first greedy validation: the lean decode step's fp32 packed
    # weights got bf16 activations under autocast.
    module, data = make(tiny_model_dir)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if "lora_" in n}
    fit = trainer(tmp_path, epochs=2, precision=precision, check_val_every_n_epoch=1)
    fit.fit(module, data)
    metrics = fit.callback_metrics
    for key in ("train/loss", "val/accuracy", "train/kl"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    after = dict(module.policy.named_parameters())
    assert any(not torch.equal(before[n].to(after[n].dtype), after[n]) for n in before)  # it trained
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(after[n].dtype == expected for n in before)


def _bf16_module(tiny_model_dir):
    _, data = make(tiny_model_dir)
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, dtype="bfloat16"),
        beta=0.04,
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    return module, data


def test_a_bf16_policy_keeps_its_adapter_optimizer_state_and_log_probs_in_fp32(tmp_path, tiny_model_dir):
    module, data = _bf16_module(tiny_model_dir)
    fit = trainer(tmp_path, epochs=1)
    fit.fit(module, data)
    params = dict(module.policy.named_parameters())
    assert {p.dtype for n, p in params.items() if "lora_" not in n} == {torch.bfloat16}  # the frozen base
    assert {p.dtype for n, p in params.items() if "lora_" in n} == {torch.float32}
    state = fit.optimizers[0].state
    assert state and {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    ids = torch.randint(0, 100, (2, 5))
    logprobs, entropy = completion_logprobs(
        module.policy, ids, torch.ones_like(ids), ids, torch.ones_like(ids), temperature=1.0, with_entropy=True
    )
    assert logprobs.dtype == entropy.dtype == torch.float32


def test_bf16_runs_of_one_seed_train_to_the_same_adapter_bitwise(tmp_path, tiny_model_dir):
    adapters = []
    for run in range(2):
        L.seed_everything(0)
        module, data = _bf16_module(tiny_model_dir)
        trainer(tmp_path / str(run), epochs=2).fit(module, data)
        adapters.append({n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad})
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])


def _fp32_and_bf16_policies(folder, lora=True):
    """The same policy with fp32 base weights and with bf16 ones (with LoRA: a young adapter, shared)."""
    spec = {"name_or_path": folder} if lora else {"name_or_path": folder, "lora": None}
    full, _ = build_policy(PolicySpec(dtype="float32", **spec), need_reference=False)
    with torch.no_grad():
        for name, p in full.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    half, _ = build_policy(PolicySpec(dtype="bfloat16", **spec), need_reference=False)
    half.load_state_dict({n: v for n, v in full.state_dict().items() if "lora_" in n}, strict=False)
    return full, half


@pytest.mark.parametrize(
    "lora, temperature", [(True, 1.0), (True, 0.7), (False, 1.0)], ids=["lora", "lora-T0.7", "full"]
)
def test_a_bf16_policy_runs_bf16_mixed_arithmetic_on_its_bf16_weights(tiny_model_dir, lora, temperature):
    # bf16 weights used to mean a bf16 residual stream too, which learnt below fp32; bf16-mixed's
    # arithmetic (fp32 stream, bf16 matmuls) learnt within it. The bf16 policy must now compute
    # exactly what bf16-mixed computes on the same (rounded) weights, in every scoring path.
    full, half = _fp32_and_bf16_policies(tiny_model_dir, lora)
    rounded = copy.deepcopy(full)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if "lora_" not in name:
                p.copy_(p.bfloat16().float())
    layer_inputs = []
    inner = half.get_base_model() if lora else half
    inner.model.layers[1].register_forward_pre_hook(lambda m, args: layer_inputs.append(args[0].dtype))
    generator = torch.Generator().manual_seed(0)
    prompts, completions = (
        torch.randint(0, 300, (4, 6), generator=generator),
        torch.randint(0, 300, (4, 9), generator=generator),
    )
    for prompt_ids in (prompts, prompts[:2].repeat(2, 1)):  # one full pass; rows sharing a prompt
        args = (prompt_ids, torch.ones_like(prompt_ids), completions, torch.ones_like(completions))
        ours, _ = completion_logprobs(half, *args, temperature=temperature)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed, _ = completion_logprobs(rounded, *args, temperature=temperature)
        assert torch.equal(ours, mixed)
        assert not torch.equal(ours, completion_logprobs(full, *args, temperature=temperature)[0])  # bf16 arithmetic
        assert not torch.is_autocast_enabled("cpu")  # the policy's autocast ends with its forward
    assert set(layer_inputs) == {torch.float32}  # the residual stream
    assert inner.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    if not lora:  # full fine-tuning trains the bf16 weights themselves
        ours, _ = completion_logprobs(half, *args, temperature=1.0)
        ours.sum().backward()
        assert inner.model.layers[0].mlp.down_proj.weight.grad.dtype == torch.bfloat16


def test_a_bf16_forward_that_is_interrupted_leaves_autocast_off(tiny_model_dir):
    _, half = _fp32_and_bf16_policies(tiny_model_dir)

    def interrupt(*args):
        raise KeyboardInterrupt  # Ctrl-C in a notebook: forward hooks marked always_call do not see it

    handle = half.get_base_model().model.layers[0].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        half(input_ids=torch.tensor([[1, 2]]))
    handle.remove()
    assert not torch.is_autocast_enabled("cpu")


def test_a_deep_copy_of_a_bf16_policy_runs_its_own_weights(tiny_model_dir):
    # The decode skeleton and full fine-tuning's reference are deep copies: each must run itself.
    _, half = _fp32_and_bf16_policies(tiny_model_dir, lora=False)
    twin = copy.deepcopy(half)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        twin.model.layers[0].mlp.down_proj.weight.mul_(3)
        assert not torch.equal(twin(input_ids=ids).logits, half(input_ids=ids).logits)
        assert "input_ids" in inspect.signature(twin.forward).parameters  # what transformers inspects


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


LOSSES = {  # each loss on bf16 inputs, and the same values as fp32 tensors
    "ppo_loss": lambda cast: ppo_loss(
        *(cast(_bf16(3, 4, seed=i) - 1) for i in range(3)),
        torch.ones(3, 4),
        *(cast(_bf16(3, 4, seed=i)) for i in range(3, 6)),
    ),
    "dpo_loss": lambda cast: dpo_loss(*(cast(_bf16(4, seed=i) * 20 - 60) for i in range(4)), beta=0.1),
    "sft_loss": lambda cast: sft_loss(cast(_bf16(3, 4) - 2), torch.ones(3, 4)),
    "bradley_terry_loss": lambda cast: bradley_terry_loss(cast(_bf16(4) * 8), cast(_bf16(4, seed=1) * 8)),
}


@pytest.mark.parametrize("name", LOSSES)
def test_each_loss_computes_in_fp32_on_bf16_inputs(name):
    in_bf16, in_fp32 = LOSSES[name](lambda t: t), LOSSES[name](lambda t: t.float())
    assert in_bf16.loss.dtype == torch.float32
    assert torch.equal(in_bf16.loss, in_fp32.loss)
    for key, value in in_fp32.metrics.items():
        assert torch.equal(in_bf16.metrics[key], value), key
