"""The CUDA paths: bf16 under bf16-mixed, decoding, QLoRA, FSDP2 on one GPU, and the FSDP1 refusal.

Marked ``gpu``: skipped without CUDA (``tests/conftest.py``), run by
``scripts/gpu_check.sh`` on a GPU. That machine has no model hub and no
embedded SmolLM2 (its package is too big to carry), so the tiny model here
uses the byte-level tokenizer of :mod:`lit_grpo.model.random_models` instead of
``tiny_model_dir``. The tests that set up a process group (FSDP1, FSDP2) come
last: the group outlives them. Lightning is imported inside the tests, so
collecting them where they skip costs nothing (the dry run of the check
collects them on every CI run).
"""

from __future__ import annotations

import pytest
import torch

from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation.decode_step import llama_step_applies
from lit_grpo.generation.rollout import SamplingSpec, encode_prompts, generate
from lit_grpo.model.policy import LoraSpec, PolicySpec, load_tokenizer
from lit_grpo.model.random_models import save_random_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(save_random_model("tiny", tmp_path_factory.mktemp("gpu") / "tiny", dtype=torch.float32))


def distinct_characters(prompts, completions, **columns):
    """Differs between the samples of a group, so advantages are not all zero."""
    return [float(len(set(c))) for c in completions]


def grpo(model_dir: str, **policy):
    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.data.grpo import OnPolicyDataModule

    module = GRPOModule(
        policy=PolicySpec(name_or_path=model_dir, dtype="bfloat16", lora=LoraSpec(r=4, alpha=8), **policy),
        progress=False,
        log_samples=0,
        validate_before_training=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    data = OnPolicyDataModule(
        prompts_per_epoch=2,
        batch_size=4,
        held_out=HeldOutSpec(size=2),
        source=SourceSpec(train_size=20),
        sampling=SamplingSpec(group_size=4, max_new_tokens=6, ignore_eos=True),
        rewards=[distinct_characters],
    )
    return module, data


def trainer(**kwargs):
    import lightning as L

    return L.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_epochs=1,
        reload_dataloaders_every_n_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def train_one_epoch(module, data, fit) -> tuple[dict, dict]:
    """Train one epoch; return the policy's parameters before (on the CPU) and after."""
    module.configure_model()
    before = {n: p.detach().cpu().clone() for n, p in module.policy.named_parameters()}
    fit.fit(module, data)
    assert torch.isfinite(fit.callback_metrics["train/loss"])
    return before, dict(module.policy.named_parameters())


def test_bf16_policy_trains_a_grpo_step_under_bf16_mixed(model_dir):
    module, data = grpo(model_dir)
    before, after = train_one_epoch(module, data, trainer())
    assert {p.device.type for p in after.values()} == {"cuda"}
    assert {p.dtype for n, p in after.items() if "lora_" not in n} == {torch.bfloat16}
    lora = [n for n in before if "lora_" in n]
    assert lora and any(not torch.equal(before[n], after[n].cpu()) for n in lora)
    assert all(torch.equal(before[n], after[n].cpu()) for n in before if "lora_" not in n)
    assert data.last_stats["completion/length_mean"] == 6  # ignore_eos: every completion runs to the end


def test_decode_loop_on_cuda_matches_hf_greedy_generate(model_dir):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(PolicySpec(name_or_path=model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir).cuda().eval()
    assert not llama_step_applies(model, 64)  # oneDNN packing is CPU-only: CUDA decodes through model(...)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        for prompt in ("What is 3 + 4?", "Reach 24 with 2, 3 and 4, each used once.")
    ]  # unequal lengths
    ids, mask = encode_prompts(tokenizer, texts, max_prompt_length=None)
    ours = generate(model, tokenizer, ids, mask, SamplingSpec(max_new_tokens=8), greedy=True)
    with torch.no_grad():
        theirs = model.generate(
            input_ids=ids.cuda(),
            attention_mask=mask.cuda(),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )[:, ids.shape[1] :].cpu()  # [B, <=8]
    width = theirs.shape[1]
    real = ours.completion_mask[:, :width].cpu()
    assert torch.equal(ours.completion_ids[:, :width].cpu() * real, theirs * real)


def test_qlora_nf4_base_computes_in_bfloat16_and_trains_the_adapter(model_dir):
    bnb = pytest.importorskip("bitsandbytes")
    module, data = grpo(model_dir, load_in_4bit=True)
    before, after = train_one_epoch(module, data, trainer())
    quantized = [m for m in module.policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and all(m.compute_dtype == torch.bfloat16 for m in quantized)
    assert {m.weight.quant_state.quant_type for m in quantized} == {"nf4"}
    assert {m.weight.device.type for m in quantized} == {"cuda"}
    lora = [n for n in before if "lora_" in n]
    assert lora and any(not torch.equal(before[n], after[n].detach().cpu()) for n in lora)


def test_fsdp1_strategy_fails_at_setup_in_one_line(model_dir):
    module, data = grpo(model_dir)
    with pytest.raises(ValueError, match=r"^trainer\.strategy=FSDPStrategy is not supported: .*ModelParallelStrategy"):
        trainer(strategy="fsdp").fit(module, data)
    assert module.policy is None  # refused before any weights were loaded


def test_model_parallel_strategy_trains_a_step_on_one_gpu(model_dir):
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    module, data = grpo(model_dir)
    fit = trainer(strategy=ModelParallelStrategy())
    fit.fit(module, data)
    assert torch.isfinite(fit.callback_metrics["train/loss"])
    assert all(isinstance(p, DTensor) for p in module.policy.parameters())  # every layer is an FSDP2 shard
