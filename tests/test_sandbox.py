"""Security tests for the code sandbox: each attack scores 0 (or is reported) and the host is unharmed.

The attacks are exactly the issue's list. Tests that rely on namespaces and
the unprivileged uid (what we get as root with ``unshare``) are skipped
where the host does not allow them, since the limits-only fallback
documents that it does not give those protections.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from unittest import mock

import pytest

import lit_grpo
from lit_grpo.rewards import Program, Sandbox, code_unit_tests
from lit_grpo.rewards import sandbox as sandbox_module

TIMEOUT = 1.0
SANDBOX = Sandbox(timeout=TIMEOUT, max_workers=2)
requires_isolation = pytest.mark.skipif(
    SANDBOX.isolation != "namespaces" or not SANDBOX.drops_privileges,
    reason="needs Linux namespaces (unshare) and root to drop to an unprivileged uid",
)


def score(solution: str, tests: str = "assert True", sandbox: Sandbox = SANDBOX) -> float:
    completion = f"Here you go:\n```python\n{solution}\n```"
    return code_unit_tests(["p"], [completion], sandbox=sandbox, tests=[tests])[0]


def leftover_processes(marker: str = "main.py") -> list[int]:
    """Host pids still running sandbox code: by command line, and by the slot uids when dropped."""
    uids = range(SANDBOX.uid_base, SANDBOX.uid_base + SANDBOX.max_workers)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = (entry / "status").read_text()
        except OSError:
            continue  # exited while we looked
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if marker in cmdline and "-I -B" in cmdline or (SANDBOX.drops_privileges and uid in uids):
            found.append(int(entry.name))
    return found


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    assert score("while True:\n    pass") == 0.0
    assert time.monotonic() - start < TIMEOUT + 2
    assert leftover_processes() == []


@requires_isolation
def test_fork_bomb_is_capped_and_fully_killed():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert score(bomb) == 0.0
    assert leftover_processes() == []
    counter = (
        "import os, time\nforked = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        forked += 1\n    except OSError:\n"
        "        break\nprint(forked)"
    )
    assert int(SANDBOX.run(counter).stdout) < SANDBOX.max_processes  # RLIMIT_NPROC held
    assert leftover_processes() == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    assert score("x = 1", "assert x == 1") == 1.0  # the slot's process quota recovered


def test_memory_bomb_is_refused():
    bomb = "x = bytearray(20 * 10**9)"  # 20 GB
    assert score(bomb) == 0.0
    result = SANDBOX.run(bomb)
    assert "MemoryError" in result.stderr and not result.timed_out  # refused, never granted


@requires_isolation
def test_writes_outside_the_workdir_do_not_persist():
    name = f"sandbox_escape_{uuid.uuid4().hex}"
    targets = [
        Path(lit_grpo.__file__).parents[1],
        Path.home(),
        Path(tempfile.gettempdir()),
        Path("/var/tmp"),
        Path("/dev/shm"),
    ]
    paths = [str(t / name) for t in targets]
    solution = (
        f"WRITTEN = []\nfor path in {paths!r}:\n    try:\n        open(path, 'w').write('x')\n"
        "        WRITTEN.append(path)\n    except OSError:\n        pass"
    )
    assert score(solution, f"assert len(WRITTEN) == {len(paths)}") == 0.0  # project and $HOME refused
    assert [p for p in paths if os.path.exists(p)] == []  # scratch writes stayed in the sandbox


@requires_isolation
def test_parent_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    solution = (
        "import os\nSEEN = os.environ.get('SECRET_TOKEN', '')\n"
        f"try:\n    SEEN += open('/proc/{os.getpid()}/environ').read()\nexcept OSError:\n    pass"
    )
    assert score(solution, "assert 'hunter2' in SEEN") == 0.0
    result = SANDBOX.run("import os\nprint(sorted(os.environ))")
    assert "SECRET_TOKEN" not in result.stdout and result.ok


@requires_isolation
def test_network_to_the_host_is_unreachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        solution = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n    CONNECTED = True\n"
            "except OSError:\n    CONNECTED = False"
        )
        assert score(solution, "assert CONNECTED") == 0.0
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever arrived


@requires_isolation
def test_background_child_does_not_outlive_the_run():
    marker = f"{time.time_ns() % 10**6}.5"  # a unique `sleep` argument to find it by
    program = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['/bin/sleep', '{marker}'])\n    os._exit(0)\nprint('done')"
    )
    result = SANDBOX.run(program)
    assert result.ok and not result.timed_out  # the run did not wait for the child
    assert leftover_processes(marker) == []


def test_stdout_flood_is_truncated_without_hanging():
    sandbox = Sandbox(timeout=5.0, max_output_bytes=4096, max_workers=1)
    start = time.monotonic()
    result = sandbox.run("import sys\nsys.stdout.write('x' * 100_000_000)")  # 100 MB
    assert result.truncated and result.stdout == "x" * 4096
    assert not result.timed_out and time.monotonic() - start < 3
    assert leftover_processes() == []


@requires_isolation
def test_killing_the_parent_fails():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        solution = (
            f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGUSR1)\n    KILLED = True\n"
            "except OSError:\n    KILLED = False"
        )
        assert score(solution, "assert KILLED") == 0.0
        time.sleep(0.1)
        assert received == []
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_correct_solution_scores_one_and_wrong_zero():
    tests = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
    assert score("def add(a, b):\n    return a + b", tests) == 1.0
    assert score("def add(a, b):\n    return a - b", tests) == 0.0


# Mechanics the attacks rely on.


def test_workdir_is_deleted_afterwards(tmp_path, monkeypatch):
    tmp_path.chmod(0o755)  # the unprivileged uid must reach it in the limits-only mode
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = SANDBOX.run(
        Program("open('scratch.txt', 'w').write('x')\nprint(open('data.txt').read())", files={"data.txt": "given"})
    )
    assert result.stdout.strip() == "given"
    assert list(tmp_path.iterdir()) == []


def test_pool_runs_in_parallel_but_never_above_max_workers():
    program = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())"
    results = SANDBOX.run_many([program] * 6)
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlap == SANDBOX.max_workers  # 6 jobs, 2 slots: 2 at a time, never 3


def test_without_namespaces_it_warns_once_and_still_runs():
    which = sandbox_module.shutil.which
    hide_unshare = lambda name, path=None: None if name == "unshare" else which(name, path=path)  # noqa: E731
    with mock.patch.object(sandbox_module.shutil, "which", hide_unshare), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        isolation = sandbox_module._probe.__wrapped__(None)
    assert not isolation.namespaces
    assert [str(x.message) for x in w if "namespaces are not available" in str(x.message)]
    result = SANDBOX._run_in_slot(Program("print(6 * 7)"), SANDBOX.uid_base, isolation)
    assert result.stdout.strip() == "42"
