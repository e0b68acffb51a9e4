"""How far one GRPO-style gradient in bf16 is from the fp32 one, on the embedded SmolLM2-135M.

A LoRA adapter (r16, all linear layers, ``lora_B`` drawn small as after a few
steps) on the embedded model; 8 random 48-token sequences, each with a random
advantage; the loss ``-mean(advantage * log p(token))`` over every position.
Its LoRA gradient and per-token log-probs are computed in fp32 and in three
bf16 variants, and each variant prints the cosine of its gradient with the
fp32 one, the ratio of their norms and the mean absolute log-prob gap:

* bf16 weights with a bf16 residual stream (what ``policy.dtype: bfloat16``
  ran until :mod:`lit_grpo.model.stream`), fp32 adapter;
* fp32 weights under bf16 autocast (``trainer.precision: bf16-mixed``: bf16
  matmuls, fp32 residual stream);
* bf16 weights under autocast with the embedding's output cast to fp32 (bf16
  weights, fp32 residual stream: what ``policy.dtype: bfloat16`` runs now).

    python benchmarks/bf16_gradients.py
"""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lit_grpo.model.sources import embedded_model_dir


def gradient(
    model, ids: torch.Tensor, advantages: torch.Tensor, autocast: bool = False, fp32_stream: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flattened LoRA gradient and the per-token log-probs of one loss."""
    model.zero_grad()
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, out: out.float()) if fp32_stream else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-(logprobs * advantages).mean()).backward()
    if hook is not None:
        hook.remove()
    grads = [p.grad.flatten().float() for p in model.parameters() if p.requires_grad]
    return torch.cat(grads), logprobs.detach()


def main() -> None:
    generator = torch.Generator().manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32)
    policy = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 2e-3, generator=generator)
    ids = torch.randint(100, 5000, (8, 48), generator=generator)
    advantages = torch.randn(8, 1, generator=generator)
    reference, reference_logprobs = gradient(policy, ids, advantages)
    half = copy.deepcopy(policy)
    for name, p in half.named_parameters():
        if "lora_" not in name:
            p.data = p.data.bfloat16()
    variants = {
        "bf16 weights": (half, False, False),
        "fp32 weights, bf16 autocast": (policy, True, False),
        "bf16 weights, autocast, fp32 residual stream": (half, True, True),
    }
    print("| variant | gradient cosine with fp32 | norm / fp32 norm | mean abs log-prob gap |")
    print("|---|---|---|---|")
    for label, (m, autocast, stream) in variants.items():
        grad, logprobs = gradient(m, ids, advantages, autocast, stream)
        cosine = torch.nn.functional.cosine_similarity(grad.double(), reference.double(), dim=0)
        print(
            f"| {label} | {cosine:.4f} | {grad.norm() / reference.norm():.3f} "
            f"| {(logprobs - reference_logprobs).abs().mean():.4f} |"
        )


if __name__ == "__main__":
    main()
