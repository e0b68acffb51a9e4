"""The shared-prompt passes' cache gather: advanced indexing against index_select, backward included.

``logprob_passes._cache_rows`` gathers each distinct prompt's keys/values out to
the rows of its group once per layer. ``keys[rows]`` (what the cache's own
``batch_select_indices`` does) adds a prompt's rows in backward with atomic
float adds when more than one thread runs, so its result changes run to run;
``index_select`` adds them in index order. This prints both: the time of one
gather's forward + backward per layer over all layers, and whether repeated
backward passes give the same bits.

    python benchmarks/cache_gather.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt_tokens", type=int, default=60)
    parser.add_argument("--layers", type=int, default=30, help="SmolLM2-135M: 30 layers, 3 KV heads of 64")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    keys = torch.randn(args.prompts, 3, args.prompt_tokens, 64, requires_grad=True)  # [U, K, P, d]
    rows = torch.arange(args.prompts).repeat_interleave(args.rows // args.prompts)[torch.randperm(args.rows)]
    grad = torch.randn(len(rows), 3, args.prompt_tokens, 64)  # [n, K, P, d]
    gathers = {"keys[rows]": lambda: keys[rows], "keys.index_select(0, rows)": lambda: keys.index_select(0, rows)}
    seconds = dict.fromkeys(gathers, 0.0)
    grads: dict[str, set[bytes]] = {name: set() for name in gathers}
    for _ in range(args.repeats):  # interleaved, so a noisy machine weighs on both alike
        for name, gather in gathers.items():
            start = time.perf_counter()
            for _ in range(args.layers):
                keys.grad = None
                gather().backward(grad)
            seconds[name] += time.perf_counter() - start
            grads[name].add(keys.grad.numpy().tobytes())
    print(
        f"{args.threads} thread(s), {len(rows)} rows of {args.prompts} prompts x {args.prompt_tokens} tokens, "
        f"{args.layers} layers"
    )
    for name in gathers:
        print(
            f"  {name:28s} {seconds[name] / args.repeats * 1e3:8.2f} ms per pass   "
            f"distinct gradients over {args.repeats} repeats: {len(grads[name])}"
        )


if __name__ == "__main__":
    main()
