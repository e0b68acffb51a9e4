"""Where prompts come from: a built-in task, a local file, a hub dataset, or rows handed over in Python.

Every source ends as a list of row dicts with at least ``prompt`` (and
usually ``answer``), after the user's column map renamed the dataset's own
column names. Problems are reported before any compute is spent.
"""

from __future__ import annotations

import codecs
import warnings
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path
from typing import NamedTuple

from lit_grpo.data.tasks import TASKS

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_TEXT_FORMATS = {".json", ".jsonl", ".csv"}


class SourceFields(NamedTuple):
    """How a DataModule's messages name its source settings: ``data.task_args`` for the SFT,
    preference and reward DataModules, ``data.source.task_args`` for the on-policy one."""

    dataset: str = "data.source"
    split: str = "data.split"
    task_args: str = "data.task_args"
    train_size: str = "data.train_size"
    columns: str = "data.columns"
    val_size: str = "data.val_size"


FLAT = SourceFields()
GROUPED = SourceFields(  # OnPolicyDataModule's groups (lit_grpo.data.specs)
    "data.source.dataset",
    "data.source.split",
    "data.source.task_args",
    "data.source.train_size",
    "data.source.columns",
    "data.held_out.size",
)


class InMemory:
    """Rows handed to the on-policy DataModule in Python as ``data.source.dataset`` (TRL's
    ``train_dataset``): a list of row dicts, a ``datasets.Dataset``, or a ``datasets.DatasetDict``
    (read by split).

    Args:
        data: The rows.

    Raises:
        ValueError: ``data`` is none of those, or an empty list.
    """

    def __init__(self, data) -> None:
        self.data = data
        kind = type(data).__name__
        if isinstance(data, list):
            if not data or not all(isinstance(row, dict) for row in data):
                raise ValueError(
                    f"{GROUPED.dataset} is a list of {len(data)} items; expected a non-empty list of row "
                    "dicts, e.g. [{'prompt': ..., 'answer': ...}]."
                )
            self.name = f"<a list of {len(data)} rows>"
        elif kind == "DatasetDict":
            self.name = f"<a DatasetDict of splits {sorted(data)}>"
        elif kind == "Dataset":
            self.name = f"<a Dataset of {len(data)} rows>"
        else:
            raise ValueError(
                f"{GROUPED.dataset} is a {kind}; expected a source name or path (str), a list of row "
                "dicts, or a datasets.Dataset / DatasetDict."
            )

    def rows(self, split: str) -> list[dict]:
        """The rows (of ``split`` for a DatasetDict).

        Raises:
            ValueError: A DatasetDict without ``split``.
        """
        if isinstance(self.data, list):
            return [dict(row) for row in self.data]
        if type(self.data).__name__ == "DatasetDict":
            if split not in self.data:
                raise ValueError(
                    f"{GROUPED.split}={split!r}: {GROUPED.dataset} {self.name} has no such split; expected one "
                    f"of {sorted(self.data)}."
                )
            return self.data[split].to_list()
        return self.data.to_list()

    def __repr__(self) -> str:
        return self.name


def in_memory(source):
    """``source`` as :class:`InMemory` when it holds rows rather than naming them, else unchanged."""
    return source if isinstance(source, str) else InMemory(source)


def load_rows(
    source: str | InMemory,
    split: str,
    task_args: dict | list[dict] | None,
    seed: int,
    size: int | None,
    fields: SourceFields = FLAT,
) -> list[dict]:
    """Load raw rows (dataset column names) from ``source``.

    Args:
        source: A built-in task name (``arithmetic``, ``countdown``,
            ``word_problems``), a local ``.json/.jsonl/.parquet/.csv`` file,
            a hub dataset name, or rows handed over in Python (:class:`InMemory`).
        split: The dataset split (hub and local sources).
        task_args: Keyword arguments for a built-in task, or a list of them
            (a mix: :func:`mixed_task`); ignored, with a warning, for other
            sources.
        seed: Seed of a built-in task's generator.
        size: Rows to generate for a built-in task.
        fields: How messages name the settings.
    """
    if isinstance(source, InMemory):
        return source.rows(split)
    if source in TASKS:
        if isinstance(task_args, list):
            return mixed_task(source, task_args, seed, size, fields)
        return TASKS[source](n=size, seed=seed, **(task_args or {}))
    if task_args:
        # A config written for a built-in task (the quickstart's) pointed at one's own
        # data: the options cannot mean anything else, so the file is read without them.
        warnings.warn(
            f"{fields.task_args}={task_args!r} ignored: they configure the built-in tasks {sorted(TASKS)}, "
            f"and {fields.dataset}={source!r} is not one of them.",
            stacklevel=2,
        )
    path = Path(source)
    if path.suffix in _LOCAL_FORMATS:
        dataset = _load_file(source, path, fields)
    elif path.suffix:
        raise ValueError(
            f"{fields.dataset}={source!r} has an unknown file type {path.suffix!r}; expected one of "
            f"{sorted(_LOCAL_FORMATS)}, a built-in task {sorted(TASKS)}, or a hub dataset name."
        )
    else:
        dataset = _load_hub_dataset(source, split, fields)
    return dataset.to_list()


def split_rows(
    load: Callable[[str, int], list[dict]],
    source: str,
    split: str,
    val_split: str | None,
    train_size: int,
    val_size: int,
    fields: SourceFields = FLAT,
) -> tuple[list[dict], list[dict]]:
    """The training rows and the held-out rows of a DataModule (SFT, preferences, on-policy prompts).

    Args:
        load: ``(split, size) -> rows``: the DataModule's own loader (source, column map, checks);
            ``size`` is how many rows a built-in task generates.
        source: The dataset, named in the error.
        split: The training split.
        val_split: The held-out split, whose first ``val_size`` rows are held out; ``None``
            holds out the first ``val_size`` rows of ``split`` instead (never trained on).
        train_size: Rows a built-in task generates for training.
        val_size: Held-out rows.
        fields: How messages name the settings.

    Raises:
        ValueError: Without ``val_split``, ``split`` has no row left to train on.
    """
    if val_split is not None:
        return load(split, train_size), load(val_split, val_size)[:val_size]
    rows = load(split, train_size + val_size)
    if len(rows) <= val_size:
        raise ValueError(
            f"{fields.dataset}={source!r} has {len(rows)} rows, not enough to hold out "
            f"{fields.val_size}={val_size} for validation and still train."
        )
    return rows[val_size:], rows[:val_size]


def mixed_task(source: str, mix: list[dict], seed: int, size: int, fields: SourceFields = FLAT) -> list[dict]:
    """``size`` rows of a built-in task drawn evenly from several option sets, interleaved.

    Option set ``i`` generates its share with seed ``seed + i`` (the first set
    alone gives the rows the unmixed task gives); the rows alternate between
    the sets, so the validation rows held out from the front mix them too. A
    question two sets both generate is kept once.

    Raises:
        ValueError: ``mix`` is empty or holds something other than option dicts.
    """
    if not mix or not all(isinstance(options, dict) for options in mix):
        raise ValueError(
            f"{fields.task_args}={mix!r}; expected the task's options, or a non-empty list of them "
            "(a mix), e.g. [{'digits': 2}, {'digits': [2, 3]}]."
        )
    shares = [size // len(mix) + (i < size % len(mix)) for i in range(len(mix))]
    parts = [TASKS[source](n=n, seed=seed + i, **options) for i, (n, options) in enumerate(zip(shares, mix))]
    rows = {}
    for group in zip_longest(*parts):
        for row in group:
            if row is not None:
                rows.setdefault(row["prompt"], row)
    return list(rows.values())


def check_slices(source: str, slices: dict[str, dict]) -> None:
    """Refuse a malformed ``data.held_out.slices``; warn that a source other than a built-in task ignores them.

    A config copied from the quickstart keeps working on one's own file, as
    with ``task_args``: slices are questions a built-in task generates.
    """
    if slices and source not in TASKS:
        warnings.warn(
            f"data.held_out.slices={slices!r} ignored: they are held-out questions of the built-in tasks "
            f"{sorted(TASKS)}, and data.source.dataset={source!r} is not one of them; hold out rows of your "
            "data with data.held_out.split (or data.held_out.size).",
            stacklevel=3,
        )
    for name, options in slices.items():
        if not name or "/" in name or not isinstance(options, dict):
            raise ValueError(
                f"data.held_out.slices[{name!r}]={options!r}; expected a name without '/' mapped "
                "to task options, e.g. {'3+2': {'digits': [3, 2]}}."
            )


def held_out_slices(
    source: str,
    slices: dict[str, dict],
    task_args: dict | list[dict] | None,
    columns: dict[str, str],
    seed: int,
    size: int,
    taken: list[dict],
) -> dict[str, list[dict]]:
    """Rows of ``data.held_out.slices``: ``size`` per slice, none of whose prompts is one of ``taken``'s.

    Args:
        source: The built-in task.
        slices: Slice name -> task options overriding ``data.source.task_args`` (the
            first option set of a mix).
        task_args: The training task's options (or a mix of them).
        columns: The column map.
        seed: The data seed; slice ``i`` is generated with ``seed + 1 + i``.
        size: Rows per slice.
        taken: The training and validation rows.

    Returns:
        Slice name -> rows; nothing for a source that is not a built-in task.

    Raises:
        ValueError: All of a slice's questions are training prompts.
    """
    if source not in TASKS:
        return {}  # ignored, with a warning (check_slices)
    # Read only here: a built-in task's prompts are strings, a file's may be message lists (unhashable).
    taken = {row["prompt"] for row in taken}
    held_out = {}
    base = task_args[0] if isinstance(task_args, list) else task_args or {}
    for i, (name, options) in enumerate(slices.items()):
        for n in (4 * size, size):  # spare rows for the ones training also drew; a small task may lack them
            try:
                raw = load_rows(source, "train", {**base, **options}, seed + 1 + i, n, GROUPED)
                break
            except ValueError as error:
                if n == size:
                    raise ValueError(
                        f"data.held_out.slices[{name!r}]={options!r}: {error} (data.held_out.size={size})"
                    ) from None
        rows = [row for row in rename_columns(raw, columns, source, fields=GROUPED) if row["prompt"] not in taken]
        if not rows:
            raise ValueError(
                f"data.held_out.slices[{name!r}]={options!r}: every question it generates is also a "
                "training prompt; a slice holds out questions of another form."
            )
        held_out[name] = rows[:size]
    return held_out


def _load_file(source: str, path: Path, fields: SourceFields):
    """A local json/jsonl/parquet/csv file as a ``datasets.Dataset``, checked before the reader runs."""
    import datasets

    if not path.is_file():
        raise FileNotFoundError(f"{fields.dataset}={source!r}: no such file.")
    if path.stat().st_size == 0:  # the readers' own error for this is an empty message
        raise ValueError(f"{fields.dataset}={source!r} is an empty file; expected a non-empty dataset.")
    if path.suffix in _TEXT_FORMATS:
        # The readers report bad bytes by their offset in some internal block, or
        # accept them and fail later when the rows are converted.
        check_utf8(path, f"{fields.dataset}={source!r}")
    try:
        return datasets.load_dataset(_LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    except Exception as error:  # noqa: BLE001 - the reader's own error is appended
        raise ValueError(
            f"{fields.dataset}={source!r} could not be read as {_LOCAL_FORMATS[path.suffix]}: {error}"
        ) from error


def _load_hub_dataset(source: str, split: str, fields: SourceFields):
    """A hub dataset (``name`` or ``name:config``), from the local cache when the hub does not answer."""
    import datasets

    from lit_grpo.model.sources import hub_offline

    offline = hub_offline()
    name, _, config = source.partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split)
    except Exception as error:  # noqa: BLE001 - the hub's own error is appended
        if offline and isinstance(error, ConnectionError):
            raise ValueError(
                f"{fields.dataset}={source!r} is not a local file, the dataset hub is not reachable (offline) "
                "and the dataset is not in the local cache; save it as a .jsonl/.parquet file where there "
                f"is network and pass the file, or use a built-in task {sorted(TASKS)}."
            ) from error
        raise ValueError(f"{fields.dataset}={source!r} could not be loaded from the dataset hub: {error}") from error


def check_utf8(path: Path, name: str) -> None:
    """Raise, naming the byte offset and the line, if ``path`` is not UTF-8 text.

    Args:
        path: The file.
        name: How the message names the file (``data.source='d.jsonl'``).

    Raises:
        ValueError: A byte sequence that is not UTF-8.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0  # bytes and newlines before the current block
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 20)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                pending = len(error.object) - len(block)  # bytes of a sequence begun in the previous block
                bad = offset - pending + error.start
                line = lines + block[: max(bad - offset, 0)].count(b"\n") + 1
                raise ValueError(
                    f"{name} is not UTF-8 text: byte {bad} (line {line}) is 0x{error.object[error.start]:02x} "
                    f"({error.reason}); save the file as UTF-8 (e.g. with iconv -f latin1 -t utf-8)."
                ) from None
            if not block:
                return
            offset, lines = offset + len(block), lines + block.count(b"\n")


def rename_columns(
    rows: list[dict], columns: dict[str, str], source: str, require_prompt: bool = True, fields: SourceFields = FLAT
) -> list[dict]:
    """Apply the column map (``our name -> dataset column``) and check it.

    Raises:
        ValueError: The dataset is empty, a mapped column is missing, or (with
            ``require_prompt``) there is no ``prompt`` column.
    """
    if not rows:
        raise ValueError(f"{fields.dataset}={source!r} has no rows; expected a non-empty dataset.")
    available = set(rows[0])
    for ours, theirs in columns.items():
        if theirs not in available:
            raise ValueError(
                f"{fields.columns} maps {ours!r} to column {theirs!r}, which {source!r} does not have; "
                f"available columns: {sorted(available)}."
            )
    inverse = {theirs: ours for ours, theirs in columns.items()}
    renamed = [{inverse.get(k, k): v for k, v in row.items()} for row in rows]
    if require_prompt and "prompt" not in renamed[0]:
        raise ValueError(
            f"{fields.dataset}={source!r} has no 'prompt' column; map one with {fields.columns}, e.g. "
            f"{{'prompt': 'question'}}. Available columns: {sorted(available)}."
        )
    return renamed
