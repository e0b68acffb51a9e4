"""Give freed host memory back to the OS at once, so a CPU step's peak RSS is what it holds.

glibc's malloc serves blocks smaller than its mmap threshold from its heaps,
where a freed block stays mapped for reuse. The threshold starts at 128 KiB
and rises, up to 32 MiB, every time a larger mmapped block is freed, so after
the first few tensors of a training pass nearly every activation lives on a
heap, and those heaps fragment: freed space is only partly reused and almost
never returned. Measured on the embedded model (fp32, LoRA, gradient
checkpointing, 2 rows x 1024 completion tokens): a forward + backward of the
log-prob pass peaks at 3.3 GB of RSS and stays there, while autograd holds
0.25 GB; with the threshold fixed at 64 KiB the same pass peaks at 1.3 GB and
RSS falls back to 1.1 GB after it.

:func:`return_freed_memory` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``,
which also stops glibc raising it): every block above it is mapped on its own
and unmapped when freed. PyTorch has no caching allocator for CPU tensors, so
nothing else holds on to them. The price is a page fault for every page of
every large tensor (half as much time again on the VM it was measured on,
docs/scale.md), so it is a switch, the :class:`ReleaseHostMemory` callback,
for runs that are bound by memory (long completions on a CPU), not a default.
It is process-wide; it leaves alone a process whose threshold the user set
(``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``) and one whose malloc is not
glibc's (another C library, or a preloaded jemalloc, tcmalloc or mimalloc).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import lightning as L

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 64 * 1024


@functools.cache
def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` for this process (once).

    Returns:
        Whether the setting was applied: ``False`` off glibc, where the
        threshold was set (``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``), where
        ``LD_PRELOAD`` names jemalloc, tcmalloc or mimalloc, or if ``mallopt`` refused.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    preloaded = os.environ.get("LD_PRELOAD", "")
    if (
        "MALLOC_MMAP_THRESHOLD_" in os.environ
        or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")
        or any(name in preloaded for name in ("jemalloc", "tcmalloc", "mimalloc"))
    ):
        return False  # the user chose the threshold, or another allocator serves malloc
    return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


class ReleaseHostMemory(L.Callback):
    """Hand freed host memory back to the OS at once when the run trains on a CPU.

    Trades speed for peak memory (see the module docstring; figures in docs/scale.md).
    In YAML: ``trainer.callbacks: [{class_path: lit_grpo.training.host_memory.ReleaseHostMemory}]``.
    """

    def __init__(self) -> None:
        self.applied = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.strategy.root_device.type == "cpu":
            self.applied = return_freed_memory()
