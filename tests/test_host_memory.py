"""return_freed_memory: tensors freed on a CPU give their memory back to the OS (glibc)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# A 32 MiB tensor freed first makes glibc raise its mmap threshold to 32 MiB; then each 8 MiB
# tensor comes from the heap, a small tensor is allocated after it, and freeing the 8 MiB
# leaves a hole under the heap's top that glibc keeps mapped. Prints the MiB still resident.
PATTERN = """
import sys, torch
from lit_grpo.host_memory import return_freed_memory
if sys.argv[1] == "fixed":
    assert return_freed_memory()
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
del_first = torch.ones(8 * 2**20)
del del_first
start, pins = rss_mib(), []
for _ in range(10):
    block = torch.ones(2 * 2**20)  # 8 MiB, every page touched
    pins.append(torch.ones(16))
    del block
print(rss_mib() - start)
"""


def retained_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_leave_the_process_with_the_threshold_fixed():
    # Default glibc keeps the ten 8 MiB holes (80 MiB); fixed, each block is unmapped when freed.
    assert retained_mib("default") > 40
    assert retained_mib("fixed") < 8


def test_a_threshold_the_user_set_is_left_alone(monkeypatch):
    from lit_grpo import host_memory

    host_memory.return_freed_memory.cache_clear()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    try:
        assert host_memory.return_freed_memory() is False
    finally:
        host_memory.return_freed_memory.cache_clear()
