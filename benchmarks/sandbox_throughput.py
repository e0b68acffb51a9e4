"""How long 64 trivial programs take to score through the sandbox's worker pool.

Run: ``python benchmarks/sandbox_throughput.py [--programs 64] [--workers N]``.
Prints a figure; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import time

from lit_grpo.rewards import Sandbox, code_unit_tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    sandbox = Sandbox(max_workers=args.workers)
    completions = ["```python\ndef add(a, b):\n    return a + b\n```"] * args.programs
    tests = ["assert add(1, 2) == 3"] * args.programs
    code_unit_tests(["p"], completions[:1], sandbox=sandbox, tests=tests[:1])  # probe isolation once
    start = time.perf_counter()
    scores = code_unit_tests(["p"] * args.programs, completions, sandbox=sandbox, tests=tests)
    seconds = time.perf_counter() - start
    print(
        f"{args.programs} programs, {args.workers} workers, isolation={sandbox.isolation}: "
        f"{seconds:.2f} s ({args.programs / seconds:.1f} programs/s, {sum(scores):.0f} passed)"
    )


if __name__ == "__main__":
    main()
