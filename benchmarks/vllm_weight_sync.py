"""Two ways to give vLLM the policy after an optimizer step, timed and checked for exactness.

* ``merged reload`` (what :class:`lit_grpo.generation.vllm.VLLMEngine` does):
  fold the LoRA adapter into the weights and reload the adapted layers in
  place (``reload_weights(..., is_checkpoint_format=True)``), clear the prefix
  cache; requests then run on plain weights.
* ``LoRARequest``: an engine started with ``enable_lora``; after each step the
  adapter is saved to ``/dev/shm`` and served under a fresh ``lora_int_id``
  (reusing an id keeps serving the cached old adapter); requests run through
  vLLM's LoRA kernels.

For each: seconds to sync plus one greedy pass over the prompts (vLLM loads a
LoRARequest's adapter at its first use), sampling tokens/s after the sync, and whether fp32
greedy completions equal lit_grpo's native engine on the same weights, over
``--steps`` perturbations of the adapter (standing in for optimizer steps).

    python benchmarks/vllm_weight_sync.py --steps 3 --prompts 8 --group 8 --new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.prompts import chat_prompts
from lit_grpo.data.tasks import arithmetic
from lit_grpo.generation import GenerationSpec
from lit_grpo.generation.native import NativeEngine
from lit_grpo.generation.rollout import SamplingSpec, encode_prompts
from lit_grpo.model.policy import LoraSpec, PolicySpec
from lit_grpo.model.sources import embedded_model_dir


def perturb(module: GRPOModule, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.02)


def lora_request_engine(module: GRPOModule, rank: int):
    from vllm import LLM

    from lit_grpo.generation.vllm import _contained

    with _contained():
        return LLM(
            model=str(embedded_model_dir()),
            dtype="float32",
            enforce_eager=True,
            seed=0,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=2**30,
            max_model_len=512,
            enable_lora=True,
            max_lora_rank=rank,
            max_loras=1,
            disable_log_stats=True,
        )


def sample_lora(llm, module, ids, mask, sampling, greedy, lora):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=row[m.bool()].tolist()) for row, m in zip(ids, mask)]
    params = SamplingParams(
        n=1 if greedy else sampling.group_size,
        temperature=0.0 if greedy else sampling.temperature,
        max_tokens=sampling.max_new_tokens,
        seed=None if greedy else 0,
        detokenize=False,
        stop_token_ids=[module.tokenizer.eos_token_id],
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    seconds = time.perf_counter() - start
    rows = [list(s.token_ids) for o in outputs for s in o.outputs]
    return rows, sum(len(r) for r in rows) / seconds


def main() -> None:
    # Both engines in this process: a second engine started before the first would otherwise spawn
    # worker processes that outlive a killed run.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.lora.request import LoRARequest

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    module = GRPOModule(
        policy=PolicySpec(dtype="float32", lora=LoraSpec()), progress=False, generation=GenerationSpec(backend="vllm")
    )
    module.configure_model()
    native = NativeEngine(GenerationSpec(), module)
    sampling = SamplingSpec(group_size=args.group, max_new_tokens=args.new_tokens)
    texts = chat_prompts(
        module.tokenizer, [r["prompt"] for r in arithmetic(args.prompts, seed=3, ops="+")], None, "{prompt}"
    )
    ids, mask = encode_prompts(module.tokenizer, texts, None)
    lora_llm = lora_request_engine(module, module.spec.lora.r)
    figures = {
        "merged reload": {"sync": [], "rate": [], "exact": []},
        "LoRARequest": {"sync": [], "rate": [], "exact": []},
    }
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        for step in range(args.steps + 1):  # step 0 warms both engines up and is not counted
            perturb(module, step)
            expected = native.generate(ids, mask, sampling, greedy=True)
            expected_rows = [
                row[m.bool()].tolist() for row, m in zip(expected.completion_ids, expected.completion_mask)
            ]
            # merged reload
            start = time.perf_counter()
            module.engine.weights_changed()
            greedy = module.engine.generate(ids, mask, sampling, greedy=True)  # pushes the weights first
            sync = time.perf_counter() - start
            rows = [row[m.bool()].tolist() for row, m in zip(greedy.completion_ids, greedy.completion_mask)]
            torch.manual_seed(step)
            sampled = module.engine.generate(ids, mask, sampling)
            merged = figures["merged reload"]
            if step:
                merged["sync"].append(sync)
                merged["rate"].append(float(sampled.lengths.sum()) / sampled.seconds)
                merged["exact"].append(rows == expected_rows)
            # LoRARequest under a fresh id
            start = time.perf_counter()
            folder = f"{shm}/step{step}"
            module.policy.save_pretrained(folder)
            lora = LoRARequest(f"step{step}", step + 1, folder)
            lora_rows, _ = sample_lora(lora_llm, module, ids, mask, sampling, True, lora)  # loads the adapter
            sync = time.perf_counter() - start
            _, rate = sample_lora(lora_llm, module, ids, mask, sampling, False, lora)
            if step:
                through = figures["LoRARequest"]
                through["sync"].append(sync)
                through["rate"].append(rate)
                through["exact"].append([r[: len(e)] for r, e in zip(lora_rows, expected_rows)] == expected_rows)
    print(
        f"{args.prompts} prompts x {args.group} samples x {args.new_tokens} tokens, SmolLM2-135M fp32, "
        f"{args.steps} adapter updates"
    )
    print("| weight sync | sync + greedy pass s (median) | sampling tokens/s (median) | greedy equal to native, fp32 |")
    print("|---|---|---|---|")
    for name, values in figures.items():
        print(
            f"| {name} | {statistics.median(values['sync']):.2f} | {statistics.median(values['rate']):.0f} | "
            f"{sum(values['exact'])}/{len(values['exact'])} |"
        )


if __name__ == "__main__":
    main()
