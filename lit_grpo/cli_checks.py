"""The command line of ``lit-grpo``, checked and prepared around LightningCLI's parsing.

Before parsing: every YAML file it names is read, so a broken one is reported by
file and line (:func:`check_yaml_files`), and an option that replaces
``data.environment`` whole is made to parse (:func:`replaced_environments`).
Before the first rollout: every output folder is checked for writing
(:func:`check_writable`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml

from lit_grpo.data.sources import check_utf8


def replaced_environments(argv: list[str]) -> list[str]:
    """``argv`` with ``--data.environment=null`` before each option that gives ``data.environment``
    a whole new value or class (``--data.environment=JSON``, ``--data.environment.class_path=X``).

    ``data.environment`` is a dict-typed field, and jsonargparse crashes (``'dict' object has no
    attribute 'init_args'``) when such an option replaces the environment a config file set.
    Clearing it first gives the option's own value: a new class starts from its defaults, as
    jsonargparse treats a changed ``class_path``; ``--data.environment.init_args.NAME=VALUE``
    still overrides one argument of the config's environment.
    """
    out = []
    for token in argv:
        if token.split("=", 1)[0] in ("--data.environment", "--data.environment.class_path"):
            out.append("--data.environment=null")
        out.append(token)
    return out


def check_yaml_files(argv: list[str]) -> None:
    """Read every YAML file named on the command line, so that a broken one is reported by
    file and line (jsonargparse names neither: its message says ``"<unicode string>"``).

    Raises:
        ValueError: A file that is not UTF-8 or not YAML.
    """
    for token in argv:
        value = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        path = Path(value)
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            continue
        check_utf8(path, f"config file {value!r}")
        try:
            list(yaml.compose_all(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader))  # syntax only
        except yaml.MarkedYAMLError as error:
            mark, context = error.problem_mark, error.context_mark
            began = f" ({error.context} at line {context.line + 1})" if error.context and context else ""
            raise ValueError(
                f"config file {value!r}, line {mark.line + 1}, column {mark.column + 1}: {error.problem}{began}; "
                "fix that line (YAML nests by indenting with spaces; quote values holding ': ' or ' #')."
            ) from None


def check_writable(field: str, path) -> None:
    """Refuse, naming ``field``, a folder that cannot be created or written in.

    Nothing is created: a file is made and removed in the nearest folder that
    exists. Remote locations (``s3://...``) are left to their own clients.

    Raises:
        NotADirectoryError: A file is where the folder (or one above it) would be.
        PermissionError: No file can be created there.
    """
    if path is None or "://" in str(path):
        return
    path = Path(path).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(
            f"{field}={str(path)!r} cannot be a folder: {existing} is a file; pick another path."
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise PermissionError(
            f"{field}={str(path)!r} is not writable: no file can be created in {existing} "
            f"({error.strerror}); pick a folder you can write to."
        ) from error
