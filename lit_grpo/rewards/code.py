"""Code reward: run the completion's last Python block against the row's unit tests.

Each row becomes one sandboxed program (:mod:`lit_grpo.rewards.sandbox`):
a fixed harness executes ``solution.py`` (the extracted code), then the
row's ``tests`` source one top-level statement at a time. Top-level
``assert`` statements are the test cases; other statements (imports,
helpers, a ``check(candidate)`` call) are setup, and when a test source has
no top-level assert the whole of it is one case.

Rewards must not be forgeable by the code under test, so the harness
compiles the tests before the solution runs (a solution that replaces
``exec`` or ``compile`` cannot skip them), silences the solution's stdout
and stderr, and reports on a saved descriptor with a line that starts with
a per-run secret read from stdin: exiting early (``sys.exit``,
``os._exit``) or printing a fake result gives 0. A solution that walks the
harness's stack frames to read the secret, or returns objects whose
``__eq__`` is always true, can still fool it; that is beyond a process sandbox.
"""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any

from lit_grpo.rewards.base import Reward
from lit_grpo.rewards.sandbox import Program, Sandbox, SandboxResult

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

HARNESS = r"""
import ast, os, sys


def _main(exec=exec, compile=compile):
    secret = sys.stdin.readline().strip()
    report = os.dup(1)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    with open("tests.py") as f:
        statements = ast.parse(f.read()).body
    if any(isinstance(s, ast.Assert) for s in statements):
        steps = [(isinstance(s, ast.Assert), compile(ast.Module([s], []), "tests.py", "exec"))
                 for s in statements]
    else:
        steps = [(True, compile(ast.Module(statements, []), "tests.py", "exec"))]
    total = sum(is_case for is_case, _ in steps)
    namespace = {"__name__": "solution"}
    passed, broken = 0, False
    try:
        with open("solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
    except BaseException:
        broken = True
    for is_case, code in steps:
        if broken:
            break
        try:
            exec(code, namespace)
            passed += is_case
        except BaseException:
            broken = not is_case  # failed setup: the remaining cases cannot run
    os.write(report, f"\n{secret} {passed} {total}\n".encode())


_main()
"""


def extract_code(completion: str) -> str | None:
    """The body of the completion's last fenced code block (python or unlabelled)."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else None


def _tally(result: SandboxResult, secret: str) -> tuple[int, int]:
    """(passed, total) from the harness's report; (0, 1) when there is none."""
    for line in reversed(result.stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == secret and 0 <= int(parts[1]) <= int(parts[2]) > 0:
            return int(parts[1]), int(parts[2])
    return 0, 1


def code_unit_tests(
    prompts: list[str],
    completions: list[str],
    sandbox: Sandbox | None = None,
    fraction: bool = False,
    **columns: Any,
) -> list[float | None]:
    """Runs each completion's last Python block with the row's ``tests`` in the sandbox.

    Args:
        prompts: The prompts (unused).
        completions: Completions containing a fenced Python block.
        sandbox: Where to run; default: a shared :class:`Sandbox` with default limits.
        fraction: Score the fraction of test cases passed instead of all-or-nothing.
        **columns: Must include ``tests`` (unit-test source per row; None = not applicable).

    Returns:
        Per row 1.0 when every case passes, else 0.0 (or the fraction); 0.0 without a code block.
    """
    if "tests" not in columns:
        raise ValueError(f"Reward 'code_unit_tests' needs the dataset column 'tests'; got {sorted(columns)}")
    sandbox = sandbox or _default_sandbox()
    scores: list[float | None] = [None if t is None else 0.0 for t in columns["tests"]]
    jobs = {}  # row -> (program, secret)
    for i, (completion, tests) in enumerate(zip(completions, columns["tests"])):
        code = extract_code(completion)
        if tests is not None and code is not None:
            secret = secrets.token_hex(16)
            files = {"solution.py": code, "tests.py": tests}
            jobs[i] = (Program(HARNESS, files, secret + "\n"), secret)
    results = sandbox.run_many([program for program, _ in jobs.values()])
    for (i, (_, secret)), result in zip(jobs.items(), results):
        passed, total = _tally(result, secret)
        scores[i] = passed / total if fraction else float(passed == total > 0)
    return scores


@functools.cache
def _default_sandbox() -> Sandbox:
    return Sandbox()


class CodeUnitTests(Reward):
    """:func:`code_unit_tests` with its own sandbox limits.

    Args:
        timeout: Wall-clock seconds per program.
        fraction: Score the fraction of test cases passed instead of all-or-nothing.
        weight: Multiplier of this reward in the total.
        memory_mb: Address-space limit per program, in MiB.
        max_processes: Processes per program.
        max_workers: Programs run at once; default: the number of CPUs.
        name: Key in logs.
    """

    default_name = "code_unit_tests"
    required_columns = ("tests",)

    def __init__(
        self,
        timeout: float = 5.0,
        fraction: bool = False,
        weight: float = 1.0,
        memory_mb: int = 1024,
        max_processes: int = 32,
        max_workers: int | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(weight, name)
        self.fraction = fraction
        self.sandbox = Sandbox(
            timeout=timeout, memory_mb=memory_mb, max_processes=max_processes, max_workers=max_workers
        )

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return code_unit_tests(prompts, completions, sandbox=self.sandbox, fraction=self.fraction, **columns)
