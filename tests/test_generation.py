"""The engine interface with the native engine (runs everywhere; vLLM is in test_vllm.py).

The sampler's log-probs travel with the rollout; the training step compares
them with the trainer's (``sampler/*``) and, with a cap, weighs the loss by
the truncated importance ratio.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_module import make, trainer

from lit_grpo.data.prompts import chat_prompts
from lit_grpo.generation import GenerationSpec
from lit_grpo.generation.native import NativeEngine
from lit_grpo.generation.rollout import SamplingSpec, encode_prompts
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.objectives import grpo_loss
from lit_grpo.objectives.grpo import sampler_gap


def _prompts(module):
    texts = chat_prompts(module.tokenizer, ["What is 12 + 35?", "Name a colour."], None, "{prompt}")
    return encode_prompts(module.tokenizer, texts, None)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_native_sampler_logprobs_are_those_of_the_distribution_sampled(tiny_model_dir, top_p):
    module, data = make(tiny_model_dir)
    module.configure_model()
    ids, mask = _prompts(module)
    sampling = SamplingSpec(group_size=4, max_new_tokens=8, temperature=0.7, top_p=top_p)
    torch.manual_seed(0)
    rollout = module.engine.generate(ids, mask, sampling)
    assert isinstance(module.engine, NativeEngine)
    trainer_logprobs, _ = completion_logprobs(
        module.policy,
        rollout.prompt_ids,
        rollout.prompt_mask,
        rollout.completion_ids,
        rollout.completion_mask,
        temperature=0.7,
    )
    real = rollout.completion_mask.bool()
    assert torch.all(rollout.logprobs[~real] == 0)
    gap = (trainer_logprobs.detach() - rollout.logprobs)[real]
    if top_p == 1.0:  # the full distribution at the temperature: what the objective computes
        assert gap.abs().max() < 1e-5
    else:  # renormalised over the nucleus: never below the full distribution's log-prob
        assert gap.max() < 1e-5 and gap.min() < -1e-3


def test_greedy_rollout_carries_no_logprobs(tiny_model_dir):
    module, data = make(tiny_model_dir)
    module.configure_model()
    ids, mask = _prompts(module)
    assert module.engine.generate(ids, mask, SamplingSpec(max_new_tokens=4), greedy=True).logprobs is None


def test_sampler_gap_is_logged_and_grows_with_a_bf16_sampler(tmp_path, tiny_model_dir):
    gaps = {}
    for dtype in (None, "bfloat16"):
        module, data = make(tiny_model_dir)
        module.generation = GenerationSpec(dtype=dtype)
        fit = trainer(tmp_path / str(dtype), epochs=1)
        fit.fit(module, data)
        gaps[dtype] = {k: float(fit.callback_metrics[k]) for k in ("sampler/kl", "sampler/logprob_abs_diff")}
    assert gaps[None]["sampler/logprob_abs_diff"] < 1e-5 and gaps[None]["sampler/kl"] < 1e-8
    assert gaps["bfloat16"]["sampler/logprob_abs_diff"] > max(1e-4, 1e2 * gaps[None]["sampler/logprob_abs_diff"])
    assert gaps["bfloat16"]["sampler/kl"] > 1e2 * max(gaps[None]["sampler/kl"], 1e-12)


def test_truncated_importance_weights_from_the_training_step():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    sampler = torch.tensor([[-1.0, -3.0, -0.4], [-0.2, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights, metrics = sampler_gap(old, sampler, mask, cap=2.0)
    delta = torch.tensor([0.0, 1.0, -0.1, 0.1, -2.0])  # log pi_old - log pi_sampler on the real tokens
    expected = torch.tensor(
        [
            [1.0, min(torch.e, 2.0), float(torch.exp(torch.tensor(-0.1)))],
            [float(torch.exp(torch.tensor(0.1))), float(torch.exp(torch.tensor(-2.0))), 1.0],
        ]
    )
    assert torch.allclose(weights, expected)
    assert torch.isclose(metrics["sampler/logprob_abs_diff"], delta.abs().mean())
    assert torch.isclose(metrics["sampler/kl"], (delta.exp() - 1 - delta).mean())
    assert metrics["sampler/is_capped_fraction"] == 1 / 5  # e > 2 on one of the 5 real tokens
    assert sampler_gap(old, sampler, mask)[0] is None  # off unless a cap is set
    assert sampler_gap(old, sampler, mask)[1]["sampler/is_capped_fraction"] == 0


def test_grpo_loss_importance_weights_scale_the_surrogate_not_the_kl():
    torch.manual_seed(0)
    logprobs = torch.randn(3, 4, requires_grad=True)
    ref = torch.randn(3, 4)
    advantages = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.ones(3, 4)
    common = dict(ref_logprobs=ref, beta=0.1, loss_type="bnpo")
    base = grpo_loss(logprobs, logprobs.detach(), advantages, mask, **common)
    ones = grpo_loss(logprobs, logprobs.detach(), advantages, mask, importance_weights=torch.ones(3, 4), **common)
    doubled = grpo_loss(
        logprobs, logprobs.detach(), advantages, mask, importance_weights=torch.full((3, 4), 2.0), **common
    )
    no_kl = grpo_loss(logprobs, logprobs.detach(), advantages, mask, ref_logprobs=ref, beta=0.0, loss_type="bnpo")
    assert torch.equal(base.loss, ones.loss)
    # ratio 1, so the surrogate is -mean(A) per token; doubling it leaves the KL term as it was
    assert torch.isclose(doubled.loss - base.loss, no_kl.loss)
    with pytest.raises(ValueError, match=r"importance_weights shape \(3, 2\) does not match logprobs shape \(3, 4\)"):
        grpo_loss(logprobs, logprobs.detach(), advantages, mask, importance_weights=torch.ones(3, 2), **common)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_backend_without_vllm_names_the_extra():
    with pytest.raises(ImportError, match=r"model.generation.backend='vllm' needs vLLM.*pip install -e \"\.\[vllm\]\""):
        GenerationSpec(backend="vllm")


def test_vllm_backend_refuses_4bit_policy_at_construction(tiny_model_dir):
    from lit_grpo.generation.vllm import check_policy
    from lit_grpo.model.policy import LoraSpec, PolicySpec

    with pytest.raises(ValueError, match=r"backend='vllm' with model.policy.load_in_4bit=true is not supported"):
        check_policy(PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(), load_in_4bit=True))
