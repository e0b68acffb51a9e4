"""A process sandbox for untrusted, model-written Python.

Each program runs in a fresh subprocess with a fresh working directory and is
torn down completely afterwards. Layers, outermost first (each one is used
when the host allows it, see :attr:`Sandbox.isolation`):

* ``unshare`` puts the program in new network, PID and mount namespaces. The
  network namespace holds only a downed loopback, so no socket reaches the
  host or the internet. In the PID namespace the program is PID 1: the kernel
  kills every process left in the namespace when it exits, so a background
  child that calls ``setsid`` and double-forks still dies, and host PIDs
  (the trainer's included) cannot be signalled. The mount namespace gets a
  size-capped tmpfs on ``/tmp`` (holding a copy of the program's files; it is
  the working directory) and on the other world-writable directories, so
  scratch writes never reach the host disk.
* When we are root, ``setpriv`` drops to an unprivileged uid before the
  program starts: the project directory and ``$HOME`` become unwritable, and
  ``RLIMIT_NPROC`` (which root ignores) is enforced. Each worker slot has its
  own uid because that limit counts processes per user: a fork bomb in one
  slot cannot starve the programs in the others.
* ``prlimit`` sets CPU seconds, address space, process count, file size and
  open-file limits; the environment is empty; stdout/stderr are read up to a
  byte cap, after which the pipe is closed (the writer gets ``EPIPE``), so a
  flood neither hangs the trainer nor fills its memory.
* A wall-clock timeout SIGKILLs the whole process group (and with it the PID
  namespace).

Without namespaces (not permitted by the host), a warning says so once and
the network and PID isolation are absent. This is a process sandbox, not a
VM: it shares the host kernel, so a kernel exploit escapes it.
"""

from __future__ import annotations

import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from queue import Queue
from typing import NamedTuple

# Directories any user may write to; each gets its own tmpfs in the namespace.
_SHARED_WRITABLE_DIRS = ("/var/tmp", "/dev/shm", "/run/lock")
_MIB = 1024 * 1024
_MAX_STDIN_BYTES = 65536  # fits a pipe buffer, so writing it never blocks
_PROBE_LOCK = threading.Lock()


class Program(NamedTuple):
    """One program to run: its main source, extra files and standard input."""

    source: str
    files: Mapping[str, str] = {}
    stdin: str = ""


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced.

    Attributes:
        returncode: Exit status; negative for a signal; None if killed on timeout.
        stdout: Captured standard output, at most ``max_output_bytes``.
        stderr: Captured standard error, at most ``max_output_bytes``.
        timed_out: The wall-clock timeout killed the program.
        truncated: Some output went past the cap and was dropped.
        seconds: Wall-clock duration of the run.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    seconds: float

    @property
    def ok(self) -> bool:
        """The program exited normally with status 0."""
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class _Isolation:
    namespaces: bool
    drop_privileges: bool
    python: str
    tools: dict[str, str] = field(default_factory=dict)


class Sandbox:
    """Runs untrusted Python programs under limits, many in parallel.

    Args:
        timeout: Wall-clock seconds per program before its process group is killed.
        memory_mb: Address-space limit (``RLIMIT_AS``) in MiB.
        max_processes: Processes the program's user may own (``RLIMIT_NPROC``).
        max_file_mb: Largest file the program may write (``RLIMIT_FSIZE``), in MiB.
        max_open_files: Open file descriptors (``RLIMIT_NOFILE``).
        max_output_bytes: Bytes kept of each of stdout and stderr.
        scratch_mb: Size of the program's tmpfs working directory, in MiB.
        max_workers: Programs run at once; default: the number of CPUs.
        uid_base: First unprivileged uid for worker slots (used when root).
        python: Interpreter for the programs; default: this one if the
            unprivileged uid can execute it, else the system ``python3``.
    """

    def __init__(
        self,
        timeout: float = 5.0,
        memory_mb: int = 1024,
        max_processes: int = 32,
        max_file_mb: int = 16,
        max_open_files: int = 64,
        max_output_bytes: int = 64 * 1024,
        scratch_mb: int = 64,
        max_workers: int | None = None,
        uid_base: int = 61184,
        python: str | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"Sandbox timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.max_file_mb = max_file_mb
        self.max_open_files = max_open_files
        self.max_output_bytes = max_output_bytes
        self.scratch_mb = scratch_mb
        self.max_workers = max_workers or os.cpu_count() or 1
        self.uid_base = uid_base
        self.python = python
        self._slots: Queue[int] = Queue()
        for slot in range(self.max_workers):
            self._slots.put(slot)

    @property
    def isolation(self) -> str:
        """``"namespaces"`` when network/PID/mount isolation is active, else ``"limits-only"``."""
        return "namespaces" if _isolation(self.python).namespaces else "limits-only"

    @property
    def drops_privileges(self) -> bool:
        """Programs run as an unprivileged uid (true when the trainer is root)."""
        return _isolation(self.python).drop_privileges

    def run(self, program: Program | str) -> SandboxResult:
        """Runs one program, waiting for a free worker slot first."""
        program = Program(program) if isinstance(program, str) else program
        if len(program.stdin.encode()) > _MAX_STDIN_BYTES:
            raise ValueError(f"Sandbox stdin is limited to {_MAX_STDIN_BYTES} bytes")
        slot = self._slots.get()
        try:
            return self._run_in_slot(program, self.uid_base + slot)
        finally:
            self._slots.put(slot)

    def run_many(self, programs: Sequence[Program | str]) -> list[SandboxResult]:
        """Runs programs on at most ``max_workers`` at a time; results keep their order."""
        if not programs:
            return []
        with ThreadPoolExecutor(min(self.max_workers, len(programs))) as pool:
            return list(pool.map(self.run, programs))

    def _run_in_slot(self, program: Program, uid: int, iso: _Isolation | None = None) -> SandboxResult:
        iso = iso or _isolation(self.python)
        workdir = tempfile.mkdtemp(prefix="lit_grpo_sandbox_")
        try:
            _write_files(workdir, {"main.py": program.source, **program.files})
            if iso.drop_privileges and not iso.namespaces:
                os.chown(workdir, uid, uid)  # it is the program's working directory
            command = self._command(iso, workdir, uid)
            cwd = "/" if iso.namespaces else workdir
            return self._execute(command, program.stdin, cwd, iso, uid)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _limits(self) -> list[str]:
        cpu = math.ceil(self.timeout) + 1  # the wall clock normally fires first
        return [
            f"--cpu={cpu}",
            f"--as={self.memory_mb * _MIB}",
            f"--nproc={self.max_processes}",
            f"--fsize={self.max_file_mb * _MIB}",
            f"--nofile={self.max_open_files}",
        ]

    def _command(self, iso: _Isolation, workdir: str, uid: int) -> list[str]:
        t = iso.tools
        inner = [t["prlimit"], *self._limits()]
        if iso.drop_privileges:
            inner += [
                t["setpriv"],
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                "--no-new-privs",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--pdeathsig=SIGKILL",
            ]  # setuid clears the death signal; re-arm it
        inner += [t["env"], "-i", iso.python, "-I", "-B", "main.py"]
        if not iso.namespaces:
            return inner
        options = f"size={self.scratch_mb}m,mode=700"
        if iso.drop_privileges:
            options += f",uid={uid},gid={uid}"
        # The staging tmpfs is mounted on /var/tmp first because /tmp still
        # holds ``workdir``; after the copy it moves over /tmp.
        script = "\n".join(
            [
                "set -e",
                'workdir="$1"; shift',
                f"{t['mount']} -t tmpfs -o {options} sandbox /var/tmp",
                f'{t["cp"]} -R "$workdir"/. /var/tmp/',
                f"{t['mount']} --move /var/tmp /tmp",
                *(
                    f"{t['mount']} -t tmpfs -o size=1m,mode=1777 sandbox {d}"
                    for d in _SHARED_WRITABLE_DIRS
                    if os.path.isdir(d)
                ),
                "cd /tmp",
                'exec "$@"',
            ]
        )
        return [
            t["unshare"],
            "--net",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--mount-proc",
            "--propagation",
            "private",
            t["sh"],
            "-c",
            script,
            "sandbox",
            workdir,
            *inner,
        ]

    def _execute(self, command: list[str], stdin: str, cwd: str, iso: _Isolation, uid: int) -> SandboxResult:
        start = time.monotonic()
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            cwd=cwd,
            start_new_session=True,
        )
        try:
            _feed_stdin(proc, stdin)
            out, err, truncated, timed_out = _collect(proc, start + self.timeout, self.max_output_bytes)
        finally:
            _stop(proc, iso.namespaces)
            if iso.drop_privileges and not iso.namespaces:
                _kill_uid(iso, uid)  # catches children that left the group
        return SandboxResult(
            returncode=None if timed_out else proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out,
            truncated=truncated,
            seconds=time.monotonic() - start,
        )


def _write_files(workdir: str, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = os.path.join(workdir, name)
        if os.path.dirname(os.path.normpath(name)) or name.startswith("."):
            raise ValueError(f"Sandbox file names must be plain names, got {name!r}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o644)


def _feed_stdin(proc: subprocess.Popen, stdin: str) -> None:
    try:
        if stdin:
            proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Reads stdout/stderr up to ``cap`` bytes each until EOF or the deadline."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    streams = {out_fd: proc.stdout, err_fd: proc.stderr}
    truncated = timed_out = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(remaining):
                buf = buffers[key.fd]
                chunk = os.read(key.fd, 65536)
                buf += chunk
                if chunk and len(buf) <= cap:
                    continue
                if len(buf) > cap:
                    del buf[cap:]
                    truncated = True
                selector.unregister(key.fd)
                streams[key.fd].close()  # past the cap: the writer now gets EPIPE
    if not timed_out:
        try:
            proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
    for stream in streams.values():
        stream.close()
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), truncated, timed_out


def _stop(proc: subprocess.Popen, namespaces: bool) -> None:
    """Kills what is left of a run and reaps it."""
    # Killing ``unshare`` itself would orphan the namespace's init to the
    # host's init, leaving a zombie that counts against the slot uid's
    # process limit until reaped. So kill the init (the kernel then kills the
    # whole namespace) and let ``unshare`` reap it; the group kill is the backstop.
    deadline = time.monotonic() + 2.0
    while namespaces and proc.poll() is None and time.monotonic() < deadline:
        for child in _children(proc.pid):
            _kill(child)
        try:
            proc.wait(0.05)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid)
    proc.wait()


def _children(pid: int) -> list[int]:
    # /proc/PID/task/PID/children needs CONFIG_PROC_CHILDREN; scanning works everywhere.
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            children.append(int(entry))
    return children


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(iso: _Isolation, uid: int) -> None:
    # kill(-1) as the slot's uid reaches every process that uid owns.
    subprocess.run(
        [iso.tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", iso.tools["kill"], "-KILL", "-1"],
        env={},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def _isolation(python: str | None) -> _Isolation:
    with _PROBE_LOCK:  # worker threads start together; probe (and warn) once
        return _probe(python)


@functools.cache
def _probe(python: str | None) -> _Isolation:
    """Finds the strongest isolation this host allows (once per process)."""
    names = ("unshare", "setpriv", "prlimit", "mount", "cp", "env", "sh", "kill")
    tools = {n: p for n in names if (p := shutil.which(n, path="/usr/bin:/bin:/usr/sbin:/sbin"))}
    if "prlimit" not in tools or "env" not in tools:
        raise RuntimeError("The sandbox needs util-linux `prlimit` and coreutils `env` on the PATH")
    drop = os.geteuid() == 0 and "setpriv" in tools
    candidates = [python] if python else [sys.executable, "/usr/bin/python3"]
    sandbox = Sandbox(timeout=30.0, max_workers=1)
    last = None
    for namespaces in (True, False):
        if namespaces and not {"unshare", "mount", "cp", "sh"} <= tools.keys():
            continue
        for exe in candidates:
            iso = _Isolation(namespaces, drop, exe, tools)
            last = sandbox._run_in_slot(Program("print('ok')"), sandbox.uid_base, iso)
            if last.stdout.strip() == "ok":
                if not namespaces:
                    warnings.warn(
                        "Sandbox: Linux namespaces are not available (unshare failed), so "
                        "programs run WITHOUT network or PID isolation; only rlimits apply.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                return iso
    raise RuntimeError(f"The sandbox cannot start Python from {candidates}: {last}")
