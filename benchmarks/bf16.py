"""fp32 against bf16, lit_grpo against TRL: seconds per GRPO step, peak memory and MFU, side by side.

    pip install -e .[bench]
    python benchmarks/bf16.py                            # 4x8x24, 1x8x256, 8x8x256; 3 steps per run
    python benchmarks/bf16.py --shapes 1x8x256 --steps 2 --systems lit_grpo   # lit_grpo only
    python benchmarks/bf16.py --shapes 8x8x256 --systems trl --dtypes bfloat16  # one cell

For each shape (prompts x G x new tokens) four runs, each in a fresh
subprocess through ``benchmarks/vs_trl.py``'s child runner (the same model,
prompts, reward and settings it documents, TRL's defaults set equal to ours):

* lit_grpo with ``policy.dtype: float32`` and with ``policy.dtype: bfloat16``
  (frozen base weights, matmuls and the decode step in bf16; the LoRA weights,
  optimizer state, log-softmax, loss and KL in fp32);
* TRL 1.16's ``GRPOTrainer`` in fp32 and with ``bf16=True`` (CPU autocast).

Every completion is exactly the shape's token count (lit_grpo:
``SamplingSpec(ignore_eos=True)``; TRL: ``min_new_tokens``), so each step
trains the same ``prompts x G x tokens`` completion tokens on both sides. A
step runs from its rollout's start to the end of its optimizer step; the
figure is the median over the steps after the first (its warm-up), or the one
step when ``--steps 1``. Peak memory is the child's peak RSS (model loading
included). Rollouts of more than 32 rows (8x8x256) train in micro-batches of
16 rows on both sides, accumulated into the step's one optimizer step (one
pass over 64 rows of 256 tokens outgrows a 24 GiB machine in fp32). MFU is
lit_grpo's ``perf/mfu``: the model FLOPs of its training passes (policy
forward and backward, reference pass) over their seconds and over this
CPU's measured matmul peak (the faster of fp32 and bf16,
:mod:`lit_grpo.model.hardware`); TRL does not time its passes apart, so it
has none. Run it alone on the machine: the systems run one after another, and
a second job on the cores would slow whichever runs beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl import Settings, run_child  # noqa: E402

SHAPES = ("4x8x24", "1x8x256", "8x8x256")
MAX_MICRO_BATCH = 32
"""Rollouts of more rows train in micro-batches of half that, accumulated into one optimizer step (both systems)."""
RUNS = (("lit_grpo", "float32"), ("lit_grpo", "bfloat16"), ("trl", "float32"), ("trl", "bfloat16"))


def settings_for(shape: str, steps: int, system: str, dtype: str) -> Settings:
    prompts, group_size, tokens = (int(x) for x in shape.split("x"))
    base = Settings(
        recipe=shape, prompts=prompts, group_size=group_size, max_new_tokens=tokens, steps=steps, fixed_length=True
    )
    if prompts * group_size > MAX_MICRO_BATCH:  # one pass over 64 rows of 256 tokens outgrows 24 GiB in fp32
        base = replace(base, micro_batch=MAX_MICRO_BATCH // 2)
    return replace(base, lit_dtype=dtype) if system == "lit_grpo" else replace(base, trl_bf16=dtype == "bfloat16")


def measure(shape: str, steps: int, system: str, dtype: str) -> dict:
    result = run_child(system, settings_for(shape, steps, system, dtype))
    warm = result["steps"][1:] or result["steps"]
    row = {
        "step_s": statistics.median(s["seconds"] for s in warm),
        "peak_rss_mib": result["peak_rss_mib"],
        "version": result["version"],
    }
    if system == "lit_grpo":
        row["mfu"] = statistics.median(s["perf"]["perf/mfu"] for s in warm)
        row["phases"] = {
            name: statistics.median(s["phases"].get(name, 0.0) for s in warm)
            for name in sorted({n for s in warm for n in s["phases"]})
        }
    steps_text = ", ".join(f"{s['seconds']:.1f}" for s in result["steps"])
    print(
        f"  {shape:<8} {system:<8} {dtype:<8} steps [{steps_text}] s, peak RSS {row['peak_rss_mib']:.0f} MiB"
        + (f", MFU {row['mfu']:.3f}" if "mfu" in row else ""),
        flush=True,
    )
    return row


def report(results: dict[tuple[str, str, str], dict]) -> None:
    print("\n| shape | system | dtype | s/step | peak RSS MiB | MFU (training passes) |")
    print("|---|---|---|---|---|---|")
    for (shape, system, dtype), row in results.items():
        mfu = f"{row['mfu']:.3f}" if "mfu" in row else "-"
        print(
            f"| {shape} | {system} {row['version']} | {dtype} | {row['step_s']:.2f} | {row['peak_rss_mib']:.0f} "
            f"| {mfu} |"
        )
    print(
        "\n| shape | lit bf16 / lit fp32 | lit fp32 / TRL fp32 | lit bf16 / TRL bf16 | lit bf16 / TRL fp32 "
        "| RSS lit bf16 / TRL bf16 |"
    )
    print("|---|---|---|---|---|---|")
    for shape in dict.fromkeys(key[0] for key in results):
        get = {(system, dtype): row for (s, system, dtype), row in results.items() if s == shape}

        def ratio(a, b, field="step_s"):
            return f"{get[a][field] / get[b][field]:.2f}" if a in get and b in get else "-"

        lit32, lit16, trl32, trl16 = (
            ("lit_grpo", "float32"),
            ("lit_grpo", "bfloat16"),
            ("trl", "float32"),
            ("trl", "bfloat16"),
        )
        print(
            f"| {shape} | {ratio(lit16, lit32)} | {ratio(lit32, trl32)} | {ratio(lit16, trl16)} "
            f"| {ratio(lit16, trl32)} | {ratio(lit16, trl16, 'peak_rss_mib')} |"
        )
    for (shape, system, dtype), row in results.items():
        if "phases" in row:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in row["phases"].items())
            print(f"lit_grpo {dtype} {shape} phases (median s): {phases}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="prompts x G x new tokens, e.g. 1x8x256.")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per run (the first is warm-up).")
    parser.add_argument("--systems", nargs="+", choices=["lit_grpo", "trl"], default=["lit_grpo", "trl"])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    args = parser.parse_args()
    import torch

    from lit_grpo.model.hardware import cpu_matmul_flops, cpu_name

    peaks = cpu_matmul_flops()
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads; measured matmul peak: "
        + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items()),
        flush=True,
    )
    results = {}
    for shape in args.shapes:
        for system, dtype in RUNS:
            if system in args.systems and dtype in args.dtypes:
                results[(shape, system, dtype)] = measure(shape, args.steps, system, dtype)
    report(results)


if __name__ == "__main__":
    main()
