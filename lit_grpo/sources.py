"""Where prompts come from: a built-in task, a local file, or a hub dataset.

Every source ends as a list of row dicts with at least ``prompt`` (and
usually ``answer``), after the user's column map renamed the dataset's own
column names. Problems are reported before any compute is spent.
"""

from __future__ import annotations

from pathlib import Path

from lit_grpo.tasks import TASKS

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(source: str, split: str, task_args: dict | None, seed: int, size: int | None) -> list[dict]:
    """Load raw rows (dataset column names) from ``source``.

    Args:
        source: A built-in task name (``arithmetic``, ``countdown``), a local
            ``.json/.jsonl/.parquet/.csv`` file, or a hub dataset name.
        split: The dataset split (hub and local sources).
        task_args: Keyword arguments for a built-in task.
        seed: Seed of a built-in task's generator.
        size: Rows to generate for a built-in task.
    """
    if source in TASKS:
        return TASKS[source](n=size, seed=seed, **(task_args or {}))
    if task_args:
        raise ValueError(f"data.task_args={task_args!r} only apply to built-in tasks {sorted(TASKS)}.")
    import datasets

    path = Path(source)
    if path.suffix in _LOCAL_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"data.source={source!r}: no such file.")
        if path.stat().st_size == 0:  # the readers' own error for this is an empty message
            raise ValueError(f"data.source={source!r} is an empty file; expected a non-empty dataset.")
        try:
            dataset = datasets.load_dataset(_LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        except Exception as error:  # noqa: BLE001 - the reader's own error is appended
            raise ValueError(
                f"data.source={source!r} could not be read as {_LOCAL_FORMATS[path.suffix]}: {error}"
            ) from error
    elif path.suffix:
        raise ValueError(
            f"data.source={source!r} has an unknown file type {path.suffix!r}; expected one of "
            f"{sorted(_LOCAL_FORMATS)}, a built-in task {sorted(TASKS)}, or a hub dataset name."
        )
    else:
        name, _, config = source.partition(":")
        dataset = datasets.load_dataset(name, config or None, split=split)
    return dataset.to_list()


def rename_columns(rows: list[dict], columns: dict[str, str], source: str) -> list[dict]:
    """Apply the column map (``our name -> dataset column``) and check it.

    Raises:
        ValueError: The dataset is empty, or a mapped column is missing.
    """
    if not rows:
        raise ValueError(f"data.source={source!r} has no rows; expected a non-empty dataset.")
    available = set(rows[0])
    for ours, theirs in columns.items():
        if theirs not in available:
            raise ValueError(
                f"data.columns maps {ours!r} to column {theirs!r}, which {source!r} does not have; "
                f"available columns: {sorted(available)}."
            )
    inverse = {theirs: ours for ours, theirs in columns.items()}
    renamed = [{inverse.get(k, k): v for k, v in row.items()} for row in rows]
    if "prompt" not in renamed[0]:
        raise ValueError(
            f"data.source={source!r} has no 'prompt' column; map one with data.columns, e.g. "
            f"{{'prompt': 'question'}}. Available columns: {sorted(available)}."
        )
    return renamed
