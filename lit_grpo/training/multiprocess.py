"""Multi-process runs end; they never sit idle.

Three guards for ``lit-grpo fit`` with several ranks:

* A collective timeout suited to rollouts (:func:`set_collective_timeout`).
  Ranks meet in collectives after every rollout, and one rank may wait there
  while another finishes a longer rollout, but not for Lightning's default of
  30 minutes: on CPUs (gloo) the default here is 5 minutes, on GPUs 30.
* A one-line account of a failed collective (:func:`describe_collective_failure`):
  which rank, which Lightning hook, and where in the code it waited, so a
  mismatch between ranks is found without attaching a debugger.
* Signals that end every rank (:func:`exit_on_signal`). On SIGTERM/SIGINT a
  run saves a checkpoint at its next safe point and exits
  (:mod:`lit_grpo.training.preemption`). A rank blocked inside a collective
  runs no Python code and reaches no safe point; a watcher thread, woken by
  the signal itself, ends the process and its child ranks once the grace
  period (``--preemption_grace``) is over.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import lightning
import torch

GRACE_S = 25.0  # below the 30 s SLURM (KillWait) and Kubernetes give by default
_grace = [GRACE_S]
CPU_TIMEOUT_S = 300.0
GPU_TIMEOUT_S = 1800.0
_LIGHTNING_DEFAULT = timedelta(minutes=30)  # lightning.fabric's default_pg_timeout


def set_collective_timeout(strategy, seconds: float | None) -> float | None:
    """Set how long a rank waits in one collective before the run fails.

    ``seconds=None`` applies the default (:data:`CPU_TIMEOUT_S` on CPUs,
    :data:`GPU_TIMEOUT_S` on GPUs) unless the strategy was given a timeout of
    its own. Call it before ``fit`` (the process group is created then).
    Returns the timeout in force, or ``None`` for a single-process strategy.

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if seconds is not None and seconds <= 0:
        raise ValueError(f"collective_timeout={seconds}; expected a positive number of seconds (or null).")
    if not hasattr(strategy, "_timeout"):  # one process: no collectives to wait in
        return None
    if seconds is None:
        if strategy._timeout != _LIGHTNING_DEFAULT:
            return strategy._timeout.total_seconds()
        seconds = GPU_TIMEOUT_S if strategy.root_device.type == "cuda" else CPU_TIMEOUT_S
    strategy._timeout = timedelta(seconds=seconds)
    return seconds


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` came out of a collective (timed out, or a peer rank went away)."""
    if isinstance(error, torch.distributed.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")
    )


def describe_collective_failure(error: BaseException, rank: int) -> str:
    """One line naming the rank, the Lightning hook and the code that waited in the failed collective."""
    hook, site = _failure_site(error.__traceback__)
    where = f"in {hook}" if hook else "outside any Lightning hook"
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return (
        f"rank {rank}: a collective failed {where} ({site}): {first_line}. The ranks stopped "
        "meeting in the same collectives: one rank timed out waiting (see --collective_timeout) "
        "or another rank ended; the first rank to report names the hook where they diverged."
    )


def _failure_site(tb) -> tuple[str | None, str]:
    """The innermost Lightning hook on the traceback, and the innermost frame outside torch and Lightning."""
    hook, site = None, "unknown location"
    libraries = (str(Path(torch.__file__).parent), str(Path(lightning.__file__).parent))
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_locals.get("hook_name") if frame.f_code.co_filename.endswith("call.py") else None
        if isinstance(name, str):
            owner = frame.f_locals.get("callback") or frame.f_locals.get("pl_module")
            hook = f"{type(owner).__name__}.{name}" if owner is not None else name
        if not frame.f_code.co_filename.startswith(libraries):
            site = f"{frame.f_code.co_filename}:{tb.tb_lineno} {frame.f_code.co_name}"
        tb = tb.tb_next
    return hook, site


def set_signal_grace(seconds: float) -> None:
    """Set how long after SIGTERM/SIGINT the watcher of :func:`exit_on_signal` waits.

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if not seconds > 0:
        raise ValueError(f"preemption_grace={seconds}; expected a positive number of seconds.")
    _grace[0] = float(seconds)


def exit_on_signal() -> bool:
    """End this process (and its child ranks) once the grace period after SIGINT/SIGTERM is over.

    The signal first goes its usual way (a checkpoint at the next safe point,
    :mod:`lit_grpo.training.preemption`); the watcher only steps in when that
    did not end the process in time, e.g. because it is blocked in a
    collective. The period is :data:`GRACE_S` or :func:`set_signal_grace`'s. Checkpoints
    are written atomically, so ending mid-write loses nothing saved before.
    Needs the main thread and a free signal wake-up fd (an asyncio loop, as
    in a notebook, holds it: then nothing is installed). Returns whether the
    watcher was installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    if signal.set_wakeup_fd(write_fd) != -1:  # someone else's: give it back
        signal.set_wakeup_fd(-1)
        os.close(read_fd), os.close(write_fd)
        return False
    threading.Thread(target=_watch, args=(read_fd,), name="lit-grpo-signal-watch", daemon=True).start()
    return True


def _watch(read_fd: int) -> None:
    while True:
        signum = os.read(read_fd, 1)[0]
        if signum in (signal.SIGINT, signal.SIGTERM):
            break
    grace_s = _grace[0]
    time.sleep(grace_s)
    sys.stderr.write(
        f"\nlit-grpo: still running {grace_s:g} s after {signal.Signals(signum).name}: no safe point "
        "to save at was reached in time (a rollout under several processes, a validation pass, or a "
        "rank blocked in a collective); ending this process and its child ranks. The newest "
        "last.ckpt resumes; raise --preemption_grace if the scheduler allows.\n"
    )
    sys.stderr.flush()
    end_child_processes()
    os._exit(128 + signum)


def end_child_processes() -> None:
    """SIGKILL this process's children (the ranks Lightning launched from rank 0, if any).

    Lightning ends them itself only after ``KeyboardInterrupt``; after any
    other failure of rank 0 they would wait in their next collective.
    """
    for children in Path("/proc/self/task").glob("*/children"):  # Linux; elsewhere nothing is found
        for pid in children.read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def print_failure(error: BaseException, rank: int) -> None:
    """The traceback, then the one-line account as the last line the user reads."""
    traceback.print_exception(error)
    sys.stderr.write(f"lit-grpo: {describe_collective_failure(error, rank)}\n")
