"""Memory and seconds of one GRPO step at the sizes users train, and what a 24 GB GPU holds.

    python benchmarks/scale.py                                   # Qwen2.5-1.5B and 3B shapes
    python benchmarks/scale.py --shapes qwen2.5-1.5b --trl       # with TRL's GRPOTrainer beside it
    python benchmarks/scale.py --shapes qwen2.5-7b --configs qlora --checkpointing yes --sizes 4x32
    python benchmarks/scale.py --from-log OUT.txt --target 8x8x384 --batch-size 16   # another estimate
    python benchmarks/scale.py --from-log OUT.txt --shapes qwen2.5-7b --scale-from qwen2.5-3b   # unmeasured shape

The models are randomly initialised at the real shapes of Qwen2.5-1.5B, 3B
and 7B (``lit_grpo.model.random_models``; no download, the sizes are what
decides memory and time) and written once, in bf16, under ``--models-dir``.
Each row is one GRPO step in a fresh process (``benchmarks/memory.py``'s
length child): 1 prompt x G completions of exactly N new tokens, LoRA r=16 on
every linear layer, beta=0.04 (the reference, adapter disabled, is scored
too), AdamW, the whole group in one micro-batch. ``lora`` keeps the base in
bf16; ``qlora`` quantizes it to 4-bit NF4 (bitsandbytes) with bf16 compute.
Columns:

* peak: the process's peak RSS on a CPU (model loading included),
  ``torch.cuda.max_memory_allocated`` on a GPU;
* saved: the bytes autograd keeps from the micro-batch's forward for its
  backward, each storage once and no parameter (independent of the allocator,
  so it carries over to a GPU; under checkpointing, what the checkpoints keep);
* step s: from the start of the rollout to the end of the optimizer step.

TRL's rows (``--trl``) run its ``GRPOTrainer`` on the same model folder with
the same settings: LoRA in bf16 weights with its bf16 autocast, its gradient
checkpointing on as its users run it.

Then, per shape, configuration and checkpointing, an estimate of one GPU
at ``--target`` (prompts x G x new tokens; default 8x8x512, a micro-batch of
one group): the weights (counted), the LoRA weights with their gradients and
AdamW state (counted), the rollout's KV cache for every row at once
(counted), and the micro-batch's saved activations, extrapolated linearly in
tokens from the two measured sizes (with checkpointing, plus one layer's
recomputed activations). The rollout's cache is freed before the training
passes, so the peak is weights + LoRA state + the larger of the two; 90% of
the GPU is taken as usable. An extrapolation, not a measurement, until a GPU
runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lit_grpo.model.logprob_passes import CHECKPOINTED_PASS_TOKENS

HERE = Path(__file__).parent
CONFIGS = {"lora": [], "qlora": ["--load-in-4bit"]}
WEIGHTS = {"lora": "bf16", "qlora": "4-bit NF4"}


def model_folder(shape: str, models_dir: Path) -> Path:
    """The random model of ``shape`` (written on first use, in bf16)."""
    from lit_grpo.model.random_models import save_random_model

    folder = models_dir / shape
    if not (folder / "config.json").exists():
        print(f"writing a random {shape} to {folder} ...", flush=True)
    return save_random_model(shape, folder, torch.bfloat16)


def one_step(
    system: str, folder: Path, group: int, length: int, config: str, checkpointing: bool, cap_gib: float | None
) -> dict | None:
    """One GRPO step in a fresh process (memory.py's length child); its RESULT, or None on failure."""
    from memory import run_child

    command = [
        sys.executable,
        str(HERE / "memory.py"),
        "--length-child",
        system,
        "--lengths",
        str(length),
        "--steps",
        "1",
        "--model",
        str(folder),
        "--group-size",
        str(group),
        "--dtype",
        "bfloat16",
        *CONFIGS[config],
    ] + (["--checkpointing"] if checkpointing else [])
    return run_child(
        command, f"{folder.name} {system} {config} {group}x{length} (checkpointing={checkpointing})", cap_gib
    )


def counted(shape: str, config: str, rows: int, tokens: int) -> dict[str, float]:
    """MiB of what can be counted from the shape (weights, LoRA state, the rollout's KV cache), and its layers."""
    from transformers import AutoConfig

    from lit_grpo.model.random_models import SHAPES

    model_type, sizes = SHAPES[shape]
    c = AutoConfig.for_model(model_type, **sizes)
    head_dim = c.hidden_size // c.num_attention_heads
    attention = [
        (c.hidden_size, c.hidden_size),
        (c.hidden_size, c.num_key_value_heads * head_dim),
        (c.hidden_size, c.num_key_value_heads * head_dim),
        (c.hidden_size, c.hidden_size),
    ]
    mlp = [(c.hidden_size, c.intermediate_size)] * 2 + [(c.intermediate_size, c.hidden_size)]
    linears = (attention + mlp) * c.num_hidden_layers
    linear_params = sum(i * o for i, o in linears)
    other = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.hidden_size * (
        2 * c.num_hidden_layers + 1
    )
    # NF4: half a byte per weight, one fp8 absmax per 64 (double quantization), in the decoder's linears only;
    # peft's k-bit preparation (standard QLoRA, TRL's too) upcasts the rest (embedding, head, norms) to fp32.
    linear_bytes = linear_params * (0.5 + 1 / 64) if config == "qlora" else linear_params * 2
    other_bytes = other * (4 if config == "qlora" else 2)
    lora = sum(16 * (i + o) for i, o in linears)
    # Keys are rotated in the fp32 residual stream (lit_grpo.model.stream) and cached so; values are a bf16
    # matmul's output, except in 4-bit, where the fp32 embedding turns the stream's autocast off.
    kv = c.num_hidden_layers * c.num_key_value_heads * head_dim * (4 + (4 if config == "qlora" else 2)) * rows * tokens
    mib = 2**20
    return {
        "weights": (linear_bytes + other_bytes) / mib,
        "lora_state": lora * 16 / mib,  # fp32 weight, gradient and AdamW's two moments
        "kv_cache": kv / mib,
        "layers": c.num_hidden_layers,
    }


def main() -> None:
    from lit_grpo.model.hardware import cpu_name
    from lit_grpo.model.random_models import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["qwen2.5-1.5b", "qwen2.5-3b"])
    parser.add_argument("--sizes", nargs="+", default=["4x128", "8x256"], help="G x new tokens, 1 prompt each.")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--checkpointing", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    parser.add_argument("--trl", action="store_true", help="TRL's GRPOTrainer beside lit_grpo (LoRA, checkpointing).")
    parser.add_argument("--target", default="8x8x512", help="prompts x G x new tokens of the GPU estimate.")
    parser.add_argument("--gpu-gib", type=float, default=24.0, help="The GPU's memory for the estimate.")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="Prompt length of the GPU estimate.")
    parser.add_argument("--batch-size", type=int, help="Rows per micro-batch of the GPU estimate (default: G).")
    parser.add_argument("--from-log", type=Path, help="Take the steps from an earlier run's output; run none.")
    parser.add_argument(
        "--scale-from",
        choices=list(SHAPES),
        help="With --from-log: estimate the shapes not measured from this measured shape, scaled by layers x hidden.",
    )
    parser.add_argument("--models-dir", type=Path, default=Path.home() / ".cache" / "lit_grpo" / "random_models")
    parser.add_argument("--cap-gib", type=float, help="Address-space cap of each step's process (GiB), as memory.py's.")
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes]

    results = {}
    if args.from_log:  # the RESULT lines of earlier runs: the tables again, for another target
        for line in args.from_log.read_text().splitlines():
            if line.startswith("RESULT "):
                *key, result = json.loads(line[len("RESULT ") :])
                if key[0] in [*args.shapes, args.scale_from]:
                    results[tuple(key)] = result
    for shape in [] if args.from_log else args.shapes:
        folder = model_folder(shape, args.models_dir)
        for group, length in sizes:
            runs = [("lit_grpo", config, ckpt == "yes") for config in args.configs for ckpt in args.checkpointing]
            if args.trl:
                runs.append(("trl", "lora", True))
            for system, config, checkpointing in runs:
                result = one_step(system, folder, group, length, config, checkpointing, args.cap_gib)
                if result:
                    results[shape, group, length, system, config, checkpointing] = result
                    print(f"RESULT {json.dumps([shape, group, length, system, config, checkpointing, result])}")

    if not results:
        return
    gpu = next(iter(results.values()))["gpu"]
    print(f"\nOne GRPO step, 1 prompt x G x N new tokens, LoRA r=16, bf16; {cpu_name() if not gpu else 'GPU'}")
    print("| model | G x N | system | weights | grad ckpt | peak MiB | saved MiB | step s |")
    print("|---|---|---|---|---|---|---|---|")
    for (shape, group, length, system, config, checkpointing), r in results.items():
        saved = f"{r['saved_mib']:.0f}" if r.get("saved_mib") is not None else "-"
        label = "TRL" if system == "trl" else "lit_grpo"
        print(
            f"| {shape} | {group}x{length} | {label} | {WEIGHTS[config]} | {'yes' if checkpointing else 'no'} | "
            f"{r['peak_mib']:.0f} | {saved} | {r['step_s']:.1f} |"
        )

    prompts, group, length = (int(x) for x in args.target.split("x"))
    rows = args.batch_size or group
    print(
        f"\nEstimate for one {args.gpu_gib:g} GiB GPU at {args.target} (a micro-batch of {rows} rows, the rollout's "
        f"{prompts * group} rows at once, {args.prompt_tokens}-token prompts): an extrapolation until a GPU runs it"
    )
    print(
        "| model | weights | grad ckpt | weights GiB | LoRA + AdamW GiB | rollout KV cache GiB "
        "| training activations GiB | peak GiB | fits |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    # A training pass runs each distinct prompt once (its cache serves the group's rows) and every row's completion.
    prompts_in_batch = -(-rows // group)
    tokens = prompts_in_batch * args.prompt_tokens + rows * length
    # Checkpointed completion passes hold at most this many tokens (or one row): the layer recomputed in backward.
    recomputed = min(1.0, max(CHECKPOINTED_PASS_TOKENS, length) / (rows * length))
    printed = False
    for shape in args.shapes:
        for config in args.configs:
            source, ratio = shape, 1.0
            if args.scale_from and not any(key[0] == shape for key in results):
                # Saved activations grow with layers x hidden size (the checkpoints keep each layer's input):
                # another shape's measured bytes per token, scaled by that ratio.
                source, ratio = args.scale_from, _layers_x_hidden(shape) / _layers_x_hidden(args.scale_from)
            saved, borrowed = {}, ""
            for checkpointing in (False, True):
                value = _saved_at(results, source, config, checkpointing, tokens)
                if value is None and config == "qlora" and checkpointing:
                    # Under checkpointing both keep the same layer inputs of the fp32 stream (measured equal at
                    # every size both ran), so the slow 4-bit CPU steps need not run at both sizes.
                    value = _saved_at(results, source, "lora", True, tokens)
                    borrowed = " (LoRA's)" if value is not None else ""
                if value is not None:
                    saved[checkpointing] = value * ratio
            parts = counted(shape, config, prompts * group, args.prompt_tokens + length)
            for checkpointing, activations in saved.items():
                note = (f" (from {source})" if source != shape else "") + (borrowed if checkpointing else "")
                if checkpointing:  # the layer recomputed in backward, on top of the checkpoints
                    if False in saved:
                        activations += saved[False] / parts["layers"] * recomputed
                    else:
                        note += " (without the recomputed layer: no step without checkpointing)"
                # The rollout's cache is freed before the training passes: the larger of the two counts.
                peak = (parts["weights"] + parts["lora_state"] + max(parts["kv_cache"], activations)) / 1024
                printed = True
                print(
                    f"| {shape} | {WEIGHTS[config]} | {'yes' if checkpointing else 'no'} | "
                    f"{parts['weights'] / 1024:.1f} | {parts['lora_state'] / 1024:.2f} | "
                    f"{parts['kv_cache'] / 1024:.1f} | "
                    f"{activations / 1024:.1f}{note} | {peak:.1f} | {'yes' if peak < args.gpu_gib * 0.9 else 'no'} |"
                )
    if not printed:
        print(
            "(no row: an estimate needs lit_grpo steps of a shape and configuration at two sizes of different length)"
        )


def _saved_at(results: dict, shape: str, config: str, checkpointing: bool, tokens: int) -> float | None:
    """Saved activations (MiB) of a micro-batch of ``tokens``, linear through the fewest and most tokens measured.

    A measured micro-batch is one prompt and G completions of N tokens: ``prompt + G x N`` tokens.
    """
    points = sorted(
        {
            (r["prompt_tokens"] + g * n, r["saved_mib"])
            for (s, g, n, system, c, ckpt), r in results.items()
            if (s, system, c, ckpt) == (shape, "lit_grpo", config, checkpointing)
        }
    )
    if len(points) < 2 or points[0][0] == points[-1][0]:
        return None
    (t0, s0), (t1, s1) = points[0], points[-1]
    return s0 + (s1 - s0) / (t1 - t0) * (tokens - t0)


def _layers_x_hidden(shape: str) -> int:
    from lit_grpo.model.random_models import SHAPES

    sizes = SHAPES[shape][1]
    return sizes["num_hidden_layers"] * sizes["hidden_size"]


if __name__ == "__main__":
    main()
