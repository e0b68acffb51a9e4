"""Crash-safe checkpoint files: a kill while saving leaves the previous checkpoint loadable.

What Lightning 2.6 does for a local path (``TorchCheckpointIO`` ->
``lightning.fabric.utilities.cloud_io._atomic_save``): it serialises the whole
checkpoint into memory, then writes it through an fsspec transaction. For the
local filesystem that transaction writes a temporary file made by
``tempfile.mkstemp()`` in the *system* temp folder and commits with
``shutil.move``. When the temp folder is on another filesystem than the
checkpoint (a tmpfs ``/tmp``, a mounted volume) the move is a copy into the
final name, so a kill during the copy leaves a truncated ``last.ckpt``; a kill
before the commit leaves the temp file behind; nothing is fsynced, so after a
power loss the renamed file can be empty.

:class:`AtomicCheckpointIO` writes beside the target (same filesystem, so the
rename is atomic), fsyncs the file, ``os.replace``s it over the target and
fsyncs the folder. Remote URLs keep Lightning's behaviour. ``lit-grpo`` uses it
by default; in Python pass ``Trainer(plugins=[AtomicCheckpointIO()])``.

``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` as a full file through
this plugin, so it is atomic too. ``save_last="link"`` is not: Lightning
deletes the old link before creating the new one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are write-temp, fsync, rename."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, Path(path))


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` so that ``path`` holds either the old or the new file, never a part.

    The temporary name is fixed per target (one writer per checkpoint path), so
    a file left by a killed save is simply overwritten by the next one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename lives in the folder's metadata: without this a power loss may undo it.
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
