"""How an error ends a ``lit-grpo`` command: the last line on stderr is ``lit-grpo: <message>``.

A mistake the user can fix (a config, data, checkpoint or output path refused
by lit_grpo's checks, also when a library wrapped the check's error; a file
the operating system refuses) exits with code 2 and shows no traceback unless
``LIT_GRPO_DEBUG=1``; a user's own reward, tool or environment that raised
shows its traceback; anything else is a bug somewhere and keeps its traceback
above that line (exit code 1).
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from pathlib import Path

import lit_grpo

USER_ERROR_EXIT = 2  # the same code as a command-line parse error
_PACKAGE = Path(lit_grpo.__file__).parent
# The operating system refusing a file: the user's to fix, whoever asked for the file.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def report_failure(error: Exception) -> int:
    """Print how ``error`` ended the run, with ``lit-grpo: <message>`` as the last line; return the exit code."""
    message = _message_for_user(error)
    if message is None or os.environ.get("LIT_GRPO_DEBUG"):
        traceback.print_exception(error)
    elif _raised_outside(error.__cause__):  # the user's own code failed (a reward, an environment): show where
        traceback.print_exception(error.__cause__)
    if message is None:
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        sys.stderr.write(
            f"lit-grpo: unexpected {type(error).__name__}{where}: {first_line} (the traceback "
            "above has the rest; if your config and data look right, please report it)\n"
        )
        return 1
    sys.stderr.write(f"lit-grpo: {' '.join(message.split())}\n")
    return USER_ERROR_EXIT


def _raised_outside(error: BaseException | None) -> bool:
    """Whether ``error`` was raised in code that is neither lit_grpo's nor a library's (a user's reward, tool
    or environment)."""
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    return (
        bool(frames)
        and not Path(frames[-1].filename).is_relative_to(_PACKAGE)
        and "site-packages" not in frames[-1].filename
    )


def _message_for_user(error: BaseException | None) -> str | None:
    """The message in ``error``, or in the error it wraps, that was written for the user, if any.

    Written for the user: raised by a ``raise`` statement of lit_grpo (an
    exception raised there implicitly is a bug), or the operating system
    refusing a file. Libraries wrap such errors (jsonargparse around a
    constructor's check), so the causes are searched too.
    """
    while error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        raised_at = frames[-1] if frames else None
        ours = raised_at is not None and Path(raised_at.filename).is_relative_to(_PACKAGE)
        if ours and (raised_at.line or "").startswith("raise"):
            return str(error)
        if isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS:
            return f"{error.strerror}: {error.filename}" if error.filename else str(error)
        error = error.__cause__
    return None
