"""The command line of ``lit-grpo``, checked and prepared around LightningCLI's parsing.

Before parsing: every YAML file it names is read, so a broken one is reported by
file and line (:func:`check_yaml_files`), and an option that replaces
``data.episodes.environment`` whole is made to parse (:func:`replaced_environments`).
Before the first rollout: every output folder is checked for writing
(:func:`check_writable`). A command line the parser refuses ends the command
with one ``lit-grpo:`` line (:func:`usage_error`).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningArgumentParser

from lit_grpo.data.sources import check_utf8


def usage_error(prog: str, message: str):
    """End the command with exit code 2 and one line: ``lit-grpo: <message> (<prog> --help lists every option)``."""
    sys.stderr.write(f"lit-grpo: {' '.join(message.split())} ({prog} --help lists every option)\n")
    sys.exit(2)


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one ``lit-grpo:`` line (jsonargparse's name the
    field on one line and the value and what was expected on the next, under a page of usage)."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # parsing inside a parse (a union's try): jsonargparse raises
            super().error(" ".join(message.split()), ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        usage_error(parser.prog.replace(" [options]", ""), message)


def replaced_environments(argv: list[str]) -> list[str]:
    """``argv`` with ``--data.episodes.environment=null`` before each option that gives ``data.episodes.environment``
    a whole new value or class (``--data.episodes.environment=JSON``, ``--data.episodes.environment.class_path=X``).

    ``data.episodes.environment`` is a dict-typed field, and jsonargparse crashes (``'dict' object has no
    attribute 'init_args'``) when such an option replaces the environment a config file set.
    Clearing it first gives the option's own value: a new class starts from its defaults, as
    jsonargparse treats a changed ``class_path``; ``--data.episodes.environment.init_args.NAME=VALUE``
    still overrides one argument of the config's environment.
    """
    out = []
    for token in argv:
        if token.split("=", 1)[0] in ("--data.episodes.environment", "--data.episodes.environment.class_path"):
            out.append("--data.episodes.environment=null")
        out.append(token)
    return out


# The groups OnPolicyDataModule's settings moved into: group -> {old key: its name in the group}.
GROUPS = {
    "episodes": {
        name: name
        for name in (
            "tools",
            "environment",
            "max_turns",
            "tool_timeout",
            "max_episode_tokens",
            "turn_prefix",
            "environment_reward_weight",
        )
    },
    "source": {"split": "split", "task_args": "task_args", "train_size": "train_size", "columns": "columns"},
    "held_out": {
        "val_split": "split",
        "val_size": "size",
        "val_slices": "slices",
        "val_reward": "reward",
        "val_batch_size": "batch_size",
    },
    "prompt": {
        "system_prompt": "system_prompt",
        "prompt_template": "template",
        "completion_prefix": "completion_prefix",
        "max_prompt_length": "max_length",
        "prompt_overflow": "overflow",
    },
    "advantage": {
        "advantage_estimator": "estimator",
        "advantage_scale": "scale",
        "multi_objective_aggregation": "multi_objective_aggregation",
    },
}
_LABELS = {"episodes": "episode", "held_out": "held-out"}  # a group as its message names it
# Keys of the data section that moved into a group: old -> (new, the group).
MOVED_KEYS = {
    f"data.{old}": (f"data.{group}.{new}", group) for group, names in GROUPS.items() for old, new in names.items()
}


def check_moved_keys(argv: list[str]) -> None:
    """Refuse an on-policy data key of the flat layout (:data:`MOVED_KEYS`, or ``data.source`` given
    a dataset name), on the command line or in a YAML file it names.

    Raises:
        ValueError: Naming the old key and the new one.
    """
    found = []  # (key, value or None)
    for i, token in enumerate(argv):
        if token.startswith("--"):
            key, _, value = token[2:].partition("=")
            found.append((key, value if "=" in token else (argv[i + 1] if i + 1 < len(argv) else None)))
        path = Path(token.split("=", 1)[1] if token.startswith("-") and "=" in token else token)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            config = yaml.safe_load(path.read_text(encoding="utf-8"))
            sections = [config, (config or {}).get("fit")] if isinstance(config, dict) else []
            for section in sections:
                data = section.get("data") if isinstance(section, dict) else None
                if isinstance(data, dict):
                    found += [(f"data.{key}", value) for key, value in data.items()]
    for key, value in found:
        if key == "data.source" and isinstance(value, str) and isinstance(_yaml_value(value), str):
            raise ValueError(
                f"data.source={value!r}: data.source is now a group (the dataset, its split, columns and "
                f"task options); write data.source.dataset={value!r}."
            )
        old = next((old for old in MOVED_KEYS if key == old or key.startswith(old + ".")), None)
        if old is not None:
            new, group = MOVED_KEYS[old]
            raise ValueError(
                f"{key} is now {new}{key[len(old) :]} (the {_LABELS.get(group, group)} settings are one "
                f"group, data.{group}); move it there."
            )


def _yaml_value(text: str):
    """``text`` as the parser reads a value (``null``, a mapping, a name), or ``text`` where it is no YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


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
        raise NotADirectoryError(f"{field}={str(path)!r} cannot be a folder: {existing} is a file; pick another path.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise PermissionError(
            f"{field}={str(path)!r} is not writable: no file can be created in {existing} "
            f"({error.strerror}); pick a folder you can write to."
        ) from error


def checkpoint_dir(trainer_config) -> Path:
    """Where the checkpoints go when the config names no ModelCheckpoint of its own."""
    return Path(trainer_config.get("default_root_dir") or Path.cwd()) / "checkpoints"


def default_last_checkpoint(trainer_config) -> str | None:
    """What ``--ckpt_path last`` resumes from when the checkpoints are the default ones:
    as Lightning picks it, the newest ``last*.ckpt`` in their folder (``None`` if none)."""
    callbacks = as_list(trainer_config.get("callbacks"))
    if trainer_config.get("enable_checkpointing") is False or any(
        "ModelCheckpoint" in str(getattr(c, "class_path", c)) for c in callbacks
    ):
        return None  # Lightning picks among the configured callbacks' files
    candidates = list(checkpoint_dir(trainer_config).glob("last*.ckpt"))
    return str(max(candidates, key=lambda p: p.stat().st_mtime)) if candidates else None


def is_checkpoint_file(path) -> bool:
    """Whether ``--ckpt_path`` names a local file (not ``last``/``best``/``hpc``, a URL,
    a model registry, or a sharded checkpoint's folder)."""
    return (
        bool(path)
        and path not in ("last", "best", "hpc")
        and not str(path).startswith("registry")
        and "://" not in str(path)
        and not Path(path).is_dir()
    )


def as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]
