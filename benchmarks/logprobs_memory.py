"""Peak extra memory and time of chunked ``token_logprobs`` vs naive log_softmax + gather.

Run: ``python benchmarks/logprobs_memory.py`` (CPU; about a minute and ~8 GB RAM).

What "extra memory" means here: every measurement runs in a fresh Python
subprocess. It allocates and fills the logits and tokens, runs a tiny warm-up
call (so lazy library initialisation is not billed), reads the process's
resident-set high-water mark (``getrusage(RUSAGE_SELF).ru_maxrss``), runs the
measured call once, and reads the high-water mark again. The difference is the
peak resident memory the call needed beyond its inputs, including its output
and, for forward+backward, the ``[N, T, V]`` gradient of the logits -- which
every method must return, so the table also shows the peak beyond that
gradient. glibc hands large blocks back to the OS on free, so RSS follows
torch's CPU allocations closely; the figures are accurate to a few MB.
Time is the median of several calls made afterwards in the same subprocess.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# Runnable from a plain checkout (no `pip install -e .`): put the repo root first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_grpo.objectives import token_logprobs  # noqa: E402
from lit_grpo.objectives.logprobs import DEFAULT_CHUNK_SIZE  # noqa: E402

MB = 2**20


def naive_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """The baseline: one full-vocabulary fp32 log-softmax, then gather."""
    scaled = logits if temperature == 1.0 else logits / temperature
    logp = torch.log_softmax(scaled, dim=-1, dtype=torch.float32)  # [N, T, V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N, T]


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _call(method: str, backward: bool, logits, tokens, temperature: float, chunk_size: int):
    logits.grad = None
    if method == "naive":
        out = naive_logprobs(logits, tokens, temperature)
    else:
        out = token_logprobs(logits, tokens, temperature, chunk_size=chunk_size)
    if backward:
        out.sum().backward()
    return out


def measure(args: argparse.Namespace) -> dict:
    """Runs inside the subprocess: one method, one mode, one dtype."""
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    logits = torch.empty(args.n, args.t, args.v, dtype=dtype).normal_()  # filled in place
    logits.requires_grad_(args.backward)
    tokens = torch.randint(args.v, (args.n, args.t))
    tiny = torch.randn(2, 3, 5, dtype=dtype, requires_grad=args.backward)
    _call(args.method, args.backward, tiny, torch.zeros(2, 3, dtype=torch.long), 1.0, 4)
    before = _max_rss_bytes()
    _call(args.method, args.backward, logits, tokens, args.temperature, args.chunk_size)
    peak_extra = _max_rss_bytes() - before
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        _call(args.method, args.backward, logits, tokens, args.temperature, args.chunk_size)
        times.append(time.perf_counter() - start)
    grad_bytes = logits.numel() * logits.element_size() if args.backward else 0
    return {"peak_extra": peak_extra, "grad_bytes": grad_bytes, "time": statistics.median(times)}


def run_one(args: argparse.Namespace, method: str, backward: bool, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--method", method, "--dtype", dtype]
    cmd += ["--n", str(args.n), "--t", str(args.t), "--v", str(args.v)]
    cmd += ["--temperature", str(args.temperature), "--chunk-size", str(args.chunk_size)]
    cmd += ["--repeats", str(args.repeats)] + (["--backward"] if backward else [])
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> None:
    print(
        f"N={args.n} T={args.t} V={args.v} temperature={args.temperature} "
        f"chunk_size={args.chunk_size} threads={torch.get_num_threads()} "
        f"(logits: {args.n * args.t * args.v * 4 / MB:.0f} MB fp32)"
    )
    header = (
        f"{'dtype':8} {'pass':8} {'naive MB':>9} {'chunk MB':>9} {'mem %':>6} "
        f"{'beyond grad %':>13} {'naive s':>8} {'chunk s':>8} {'time x':>7}"
    )
    print(header + "\n" + "-" * len(header))
    for dtype in args.dtypes:
        for backward in (False, True):
            naive = run_one(args, "naive", backward, dtype)
            chunked = run_one(args, "chunked", backward, dtype)
            beyond_grad = (chunked["peak_extra"] - chunked["grad_bytes"]) / (naive["peak_extra"] - naive["grad_bytes"])
            print(
                f"{dtype:8} {'fwd+bwd' if backward else 'fwd':8} "
                f"{naive['peak_extra'] / MB:9.0f} {chunked['peak_extra'] / MB:9.0f} "
                f"{100 * chunked['peak_extra'] / naive['peak_extra']:6.1f} "
                f"{f'{100 * beyond_grad:.1f}' if backward else '-':>13} "
                f"{naive['time']:8.3f} {chunked['time']:8.3f} {chunked['time'] / naive['time']:7.2f}"
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--t", type=int, default=1024)
    parser.add_argument("--v", type=int, default=49152)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    cli_args = parse_args()
    if cli_args.child:
        print(json.dumps(measure(cli_args)))
    else:
        main(cli_args)
