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

Under ``ModelParallelStrategy`` (FSDP2) a checkpoint is a folder of shards that
Lightning writes in place, outside any ``CheckpointIO``;
:func:`atomic_sharded_saves` makes those saves replace the folder whole.

Reading is checked too: a missing, damaged or truncated file fails with a
message naming it and the checkpoints beside it (torch's own error for a
damaged file is advice about ``weights_only``), and :func:`check_checkpoint`
refuses a checkpoint whose trainable weights were saved for another policy
(another base model, LoRA rank or target modules).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_grpo.model.policy import PolicySpec

# The settings that decide what the trainable weights are: a checkpoint saved
# under other values does not fit (or silently means something else).
_POLICY_FIELDS = ("name_or_path", "gguf_file", "load_in_4bit", "init_adapter")
_LORA_FIELDS = ("r", "alpha", "target_modules")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are write-temp, fsync, rename, and whose
    local loads name the file when it is missing or cannot be read."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, Path(path))

    def load_checkpoint(self, path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``TorchCheckpointIO.load_checkpoint``; a local file that is missing, a folder or
        unreadable raises an error naming it and the other checkpoints in its folder.

        Raises:
            FileNotFoundError: No such file.
            ValueError: A folder (a sharded checkpoint), or a file that is damaged,
                truncated or not written by ``torch.save``.
        """
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, *args, **kwargs)
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"ckpt_path={str(path)!r}: no such file; {_other_checkpoints(path)}.")
        if path.is_dir():
            raise ValueError(
                f"ckpt_path={str(path)!r} is a folder, a sharded checkpoint; resume it with the strategy "
                "that wrote it (ModelParallelStrategy) on as many processes."
            )
        try:
            return super().load_checkpoint(path, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - every reader failure means the same to the user
            raise ValueError(
                f"ckpt_path={str(path)!r} cannot be read: {_unreadable_because(error)}; {_other_checkpoints(path)}."
            ) from error


def _unreadable_because(error: Exception) -> str:
    """Why torch.load failed, in a few words (its own text is mostly advice about ``weights_only``)."""
    text = str(error)
    detail = text.split("WeightsUnpickler error:", 1)[-1].strip()
    detail = (detail.splitlines() or ["no detail"])[0].split(". ")[0][:120]
    if detail.startswith("Unsupported global"):
        return f"it holds a Python object a weights-only load refuses ({detail}), so it was not written by lit-grpo fit"
    return f"the file is damaged or truncated, or was not written by torch.save ({type(error).__name__}: {detail})"


def _other_checkpoints(path: Path, shown: int = 5) -> str:
    """The checkpoints beside ``path``, newest first, to pick from instead."""
    folder = path.parent
    others = [p for p in folder.glob("*.ckpt") if p != path] if folder.is_dir() else []
    if not others:
        return f"there is no other checkpoint in {folder}"
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    more = f" and {len(others) - shown} older" if len(others) > shown else ""
    return f"other checkpoints in {folder}, newest first: {', '.join(p.name for p in others[:shown])}{more}"


def check_lightning_checkpoint(checkpoint: Any, path: str | Path) -> None:
    """Refuse a loaded file that is not a Lightning checkpoint (a bare state dict, say).

    Raises:
        ValueError: ``checkpoint`` has no ``pytorch-lightning_version`` entry.
    """
    if not isinstance(checkpoint, Mapping) or "pytorch-lightning_version" not in checkpoint:
        raise ValueError(
            f"ckpt_path={str(path)!r} is not a Lightning checkpoint (it has no 'pytorch-lightning_version' "
            f"entry); pass a checkpoint written by lit-grpo fit or Trainer.fit; {_other_checkpoints(Path(path))}."
        )


def check_checkpoint(checkpoint: Mapping[str, Any], module) -> None:
    """Refuse a checkpoint whose trainable weights were saved for another policy than ``module``'s.

    Call it when the checkpoint is loaded, after the policy is built
    (``PolicyModule.on_load_checkpoint``). The module loads checkpoints
    non-strictly (they hold only the trainable weights), so without this a
    checkpoint of another LoRA rank fails with a list of shape errors and one
    of other target modules loads nothing at all. A sharded checkpoint
    (FSDP2) has loaded its weights already and carries no ``state_dict``:
    only its policy settings are compared.

    Args:
        checkpoint: The loaded checkpoint.
        module: The :class:`~lit_grpo.algorithms.base.PolicyModule` resuming from it.

    Raises:
        ValueError: Policy settings that differ, or trainable weights that are
            missing from the checkpoint or have other shapes there.
    """
    where = "the checkpoint"
    with contextlib.suppress(RuntimeError):  # no Trainer attached: a checkpoint loaded by hand
        if module.trainer.ckpt_path:
            where = f"ckpt_path={str(module.trainer.ckpt_path)!r}"
    hparams = checkpoint.get("hyper_parameters") or {}
    if "policy" in hparams:
        check_policy(hparams["policy"], module.spec, where)
    if isinstance(checkpoint.get("state_dict"), Mapping):
        problem = _weights_problem(checkpoint["state_dict"], module.state_dict())
        if problem:
            raise ValueError(
                f"{where} does not fit this model: {problem}. Resume with the policy settings "
                "it was trained with, or start without --ckpt_path."
            )


def check_policy(saved: Any, current: Any, where: str) -> None:
    """Refuse a checkpoint saved for another policy: the settings that decide the trainable weights differ.

    Args:
        saved: The policy in the checkpoint's hyper-parameters: a
            :class:`~lit_grpo.model.policy.PolicySpec`, its dict, or ``None`` (the default).
        current: The policy of this run, in the same forms.
        where: How the message names the checkpoint (``ckpt_path='...'``).

    Raises:
        ValueError: Naming each differing ``model.policy`` field with both values.
    """
    saved, current = _as_dict(saved), _as_dict(current)
    pairs = [(name, saved.get(name), current.get(name)) for name in _POLICY_FIELDS]
    saved_lora, current_lora = saved.get("lora"), current.get("lora")
    if saved_lora is None or current_lora is None:
        pairs.append(("lora", saved_lora, current_lora))
    else:
        pairs += [(f"lora.{name}", saved_lora.get(name), current_lora.get(name)) for name in _LORA_FIELDS]
    differences = [
        f"model.policy.{name}={old!r} in the checkpoint, {new!r} in this run"
        for name, old, new in pairs
        if not _same(name, old, new)
    ]
    if differences:
        raise ValueError(
            f"{where} was saved for another policy: {'; '.join(differences)}. Resume with the checkpoint's "
            "settings, or start a new run without --ckpt_path (in another trainer.default_root_dir)."
        )


def _as_dict(policy: Any) -> dict:
    if policy is None:
        policy = PolicySpec()
    if dataclasses.is_dataclass(policy):
        return dataclasses.asdict(policy)
    return {k: (_as_dict(v) if k == "lora" and v is not None else v) for k, v in dict(policy).items()}


def _same(name: str, old: Any, new: Any) -> bool:
    if name == "name_or_path" and isinstance(old, str) and isinstance(new, str) and old != new:
        return os.path.exists(old) and os.path.realpath(old) == os.path.realpath(new)  # one folder, two spellings
    if name == "lora.target_modules" and isinstance(old, list) and isinstance(new, list):
        return sorted(old) == sorted(new)
    return old == new


def _weights_problem(saved: Mapping[str, Any], expected: Mapping[str, Any]) -> str | None:
    """What keeps ``saved`` (a checkpoint's state dict) from loading into weights ``expected``."""
    missing = [k for k in expected if k not in saved]
    reshaped = [k for k in expected if k in saved and tuple(saved[k].shape) != tuple(expected[k].shape)]
    if reshaped:
        k = reshaped[0]
        return (
            f"{len(reshaped)} of the {len(expected)} trainable weights have another shape in it, e.g. {k}: "
            f"{tuple(saved[k].shape)} saved, {tuple(expected[k].shape)} here "
            "(another base model or LoRA rank?)"
        )
    if missing:
        return (
            f"{len(missing)} of the {len(expected)} trainable weights are not in it, e.g. {missing[0]} "
            "(other LoRA target modules, or a checkpoint of another model?)"
        )
    return None


def _disk_full(error: BaseException | None) -> OSError | None:
    """The out-of-space ``OSError`` behind ``error``, if any: torch's zip writer reports a
    failed write as a ``RuntimeError`` raised while handling the ``OSError``."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return error
        error = error.__cause__ or error.__context__
    return None


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
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        full = _disk_full(error)
        if full is not None:
            kept = f"the previous {path.name} is intact" if path.exists() else "nothing was overwritten"
            raise OSError(
                f"the disk is full: writing the checkpoint {path} failed ({full.strerror}); {kept}. "
                "Free space there, or point trainer.default_root_dir to a disk with room."
            ) from error
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make a rename inside ``folder`` durable: it lives in the folder's metadata, and
    without this a power loss may undo it."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """A folder to fill that replaces ``path`` once the block ends without error.

    The block writes into ``.<name>.tmp`` beside ``path``; its files are fsynced and the
    folder put in place by :func:`put_in_place`. A process killed at any moment leaves
    ``path`` whole, the previous folder or the new one, never half-written; what a killed
    write left beside it is removed the next time.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    for stale in (tmp, path.with_name(f".{path.name}.old")):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    put_in_place(tmp, path)


def put_in_place(tmp: Path, path: Path) -> None:
    """Make the finished folder ``tmp`` be ``path`` (and remove the folder it replaces).

    Its files are fsynced first. Where the OS swaps two folders in one step (Linux's
    ``renameat2(RENAME_EXCHANGE)``) ``path`` is never absent; elsewhere the previous
    folder is renamed to ``.<name>.old`` first, so a kill between the two renames leaves
    ``path`` absent and the previous folder there.
    """
    for file in tmp.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    previous = tmp
    if not path.exists():
        os.replace(tmp, path)
    elif not _exchange(tmp, path):
        previous = path.with_name(f".{path.name}.old")
        _remove(previous)
        os.replace(path, previous)
        os.replace(tmp, path)
    _fsync_folder(path.parent)  # the swap is durable before the previous folder goes
    _remove(previous)


def _remove(path: Path) -> None:
    """Delete a folder or a file (a sharded checkpoint may replace a single-file one), if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


@functools.cache
def _renameat2():
    """libc's ``renameat2`` (glibc 2.28+, Linux), or ``None``."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; ``False`` where the OS or the filesystem cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a kernel or filesystem without it
        return False
    raise OSError(error, os.strerror(error), str(a), None, str(b))


def atomic_sharded_saves(strategy) -> None:
    """Make a ``ModelParallelStrategy``'s sharded checkpoints replace their folder whole.

    Lightning writes a sharded checkpoint into the folder it replaces: every rank's
    ``.distcp`` shard, then rank 0's ``meta.pt`` with the loops' state. A run killed
    during that save leaves the new weights beside the old ``meta.pt`` (a resume that
    silently trains steps again on weights that already took them) or a mix of old and
    new shards. Here every rank writes into ``.<name>.tmp`` beside the folder and, once
    all have, rank 0 puts it in place (:func:`put_in_place`). ``GRPOModule`` and the
    other modules apply this in ``setup``; other strategies, full-state saves and remote
    paths are left as they are.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(strategy, ModelParallelStrategy) or getattr(strategy, "_atomic_sharded_saves", False):
        return
    save = strategy.save_checkpoint

    def save_whole(checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        path = strategy.broadcast(filepath)  # rank 0's path, as Lightning's save does
        sharded = getattr(strategy, "_save_distributed_checkpoint", True)  # False: one full-state file
        if storage_options is not None or not sharded or not _is_local_file_protocol(path):
            save(checkpoint, path, storage_options)
            return
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        if strategy.global_rank == 0:
            _remove(tmp)  # left by a killed save
        strategy.barrier("sharded_save_begins")
        save(checkpoint, tmp)
        strategy.barrier("sharded_save_written")  # every shard and meta.pt are on disk
        if strategy.global_rank == 0:
            put_in_place(tmp, path)
        strategy.barrier("sharded_save_in_place")

    strategy.save_checkpoint = save_whole
    strategy._atomic_sharded_saves = True
