"""Generation speed: lit_grpo's decode loop vs Hugging Face ``generate``, fp32 vs bf16.

Runs each variant alternately (so machine drift hits all of them) on the
embedded SmolLM2-135M-Instruct and prints median tokens/s.

    python benchmarks/generation.py --batch 32 --new-tokens 24 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lit_grpo.policy import PolicySpec, build_policy, load_tokenizer
from lit_grpo.rollout import SamplingSpec, encode_prompts, eos_ids, generate
from lit_grpo.tasks import arithmetic


def hf_generate(model, tokenizer, ids, mask, sampling):
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=sampling.temperature,
                         top_k=None, top_p=None, max_new_tokens=sampling.max_new_tokens,
                         eos_token_id=eos_ids(tokenizer, model), pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    completion = out[:, ids.shape[1]:]
    tokens = int((completion != tokenizer.pad_token_id).sum()) + int((completion == tokenizer.pad_token_id).any(-1).sum())
    return tokens, seconds


def ours(model, tokenizer, ids, mask, sampling):
    rollout = generate(model, tokenizer, ids, mask, sampling, repeat=1)
    return int(rollout.lengths.sum()), rollout.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sampling = SamplingSpec(group_size=2, temperature=0.8, max_new_tokens=args.new_tokens)
    variants = {}
    for dtype in ("float32", "bfloat16"):
        spec = PolicySpec(dtype=dtype)
        tokenizer = load_tokenizer(spec)
        model, _ = build_policy(spec, need_reference=False)
        model.eval()
        rows = arithmetic(args.batch, seed=1, ops="+")
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                               add_generation_prompt=True) for r in rows]
        ids, mask = encode_prompts(tokenizer, texts, None)
        variants[f"hf generate {dtype}"] = (hf_generate, model, tokenizer, ids, mask)
        variants[f"lit_grpo {dtype}"] = (ours, model, tokenizer, ids, mask)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (fn, model, tokenizer, ids, mask) in variants.items():
            torch.manual_seed(0)
            tokens, seconds = fn(model, tokenizer, ids, mask, sampling)
            rates[name].append(tokens / seconds)
    print(f"batch={args.batch} new_tokens={args.new_tokens} threads={torch.get_num_threads()}")
    base = statistics.median(rates["hf generate float32"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:24s} {median:8.1f} tok/s   x{median / base:.2f} vs hf fp32")


if __name__ == "__main__":
    main()
