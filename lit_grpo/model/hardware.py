"""What the device computes at: its peak matmul rate, and the dtype it trains fastest in.

Two questions are answered here, both by measurement where no table can:

* **The peak**, the denominator of ``perf/mfu``. On CUDA it is the GPU's
  dense bf16 tensor-core peak from :data:`CUDA_BF16_PEAK_TFLOPS` (a GPU not in
  the table is measured like a CPU). On a CPU it is measured: a short matmul
  probe (:func:`measure_matmul_flops`, about a second) in fp32 and in bf16 at
  the process's thread count, the faster of the two being the peak. The
  result is cached in ``<cache>/matmul_peak.json`` by CPU model, thread count
  and torch version, so later runs read it.
* **The read bandwidth**, the bound of a decode step (``perf/rollout_roofline``):
  repeated sums over a 256 MiB tensor (:func:`measure_bandwidth`), cached
  like the peak on a CPU.
* **The fastest dtype**, what ``policy.dtype: auto`` picks: bf16 on a GPU that
  supports it; on a CPU bf16 where the probe's bf16 matmul is at least
  :data:`BF16_MIN_SPEEDUP` times its fp32 one (CPUs with AMX or AVX-512 BF16
  units; without them bf16 matmuls are emulated and slower), else fp32.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
import warnings
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets;
# the first name that occurs in torch.cuda.get_device_name() wins, so longer names come first.
CUDA_BF16_PEAK_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "GH200": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.1,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 6000 Ada": 364.2,
    "A6000": 154.8,
    "RTX 4090": 165.2,
    "RTX 3090": 71.0,
}
BF16_MIN_SPEEDUP = 1.5
"""bf16 matmuls must beat fp32 ones by this factor on a CPU for ``auto`` to pick bf16."""

PROBE_SHAPE = (1024, 1024, 2048)
"""``[m, k] @ [k, n]`` of the CPU probe: as wide as a small model's layers, 4.3 GFLOP a product."""

BANDWIDTH_PROBE_BYTES = 256 * 2**20
"""What the bandwidth probe reads per pass: larger than any CPU's caches."""


def measure_matmul_flops(dtype: torch.dtype, device: torch.device | str = "cpu", seconds: float = 0.3) -> float:
    """FLOP/s of repeated ``[m, k] @ [k, n]`` products (:data:`PROBE_SHAPE`) on ``device`` in ``dtype``.

    One product warms up, then products run for at least ``seconds``; the
    best of three such rounds is returned (a shared machine slows some). A
    warm-up product that alone takes longer than ``seconds`` is the figure:
    where the CPU emulates the dtype one product takes seconds, and three more
    rounds would not change which dtype is faster.
    """
    m, k, n = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(device, dtype)
    b = torch.randn(k, n, generator=generator).to(device, dtype)
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    a @ b
    synchronize()
    elapsed = time.perf_counter() - start
    if elapsed >= seconds:
        return 2 * m * k * n / elapsed
    best = 0.0
    for _ in range(3):
        synchronize()
        start, count = time.perf_counter(), 0
        while True:
            a @ b
            count += 1
            synchronize()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        best = max(best, 2 * m * k * n * count / elapsed)
    return best


def measure_bandwidth(device: torch.device | str = "cpu", seconds: float = 0.3) -> float:
    """Bytes/s ``device`` reads from memory: repeated sums over a :data:`BANDWIDTH_PROBE_BYTES` fp32
    tensor (far larger than any cache, as a decode step's weights are), the best of three rounds of at
    least ``seconds``."""
    x = torch.ones(BANDWIDTH_PROBE_BYTES // 4, device=device)
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    x.sum()
    best = 0.0
    for _ in range(3):
        synchronize()
        start, count = time.perf_counter(), 0
        while True:
            x.sum()
            count += 1
            synchronize()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        best = max(best, BANDWIDTH_PROBE_BYTES * count / elapsed)
    del x
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # not held back from a colocated vLLM that sizes its memory next
    return best


def cpu_name() -> str:
    """The CPU as ``/proc/cpuinfo`` tells it apart: model name, family, model and bf16 units.

    Virtual machines often give different CPUs one model name ("AMD EPYC" for a
    Zen 3 without bf16 units and a Zen 5 with them), so the family, the model
    and the AMX / AVX-512 BF16 flags follow it, e.g. ``AMD EPYC (family 25,
    model 1, no bf16 units)``. It keys the probe's cache and names the CPU in
    benchmarks' output. Elsewhere, the platform's processor name.
    """
    try:
        fields = dict(
            line.split(":", 1)
            for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
            if ":" in line
        )
    except OSError:
        fields = {}
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    units = sorted(flag for flag in fields.get("flags", "").split() if flag in ("avx512_bf16", "amx_bf16"))
    return (
        f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}, "
        f"{' + '.join(units) or 'no bf16 units'})"
    )


def cpu_matmul_flops(cache_dir: str | None = None) -> dict[str, float]:
    """Measured fp32 and bf16 matmul FLOP/s of this CPU at this thread count, cached on disk.

    Returns:
        ``{"float32": flops, "bfloat16": flops}``.
    """
    return dict(_cpu_matmul_flops(str(_cache_file(cache_dir)), cpu_name(), torch.get_num_threads()))


@functools.cache
def _cpu_matmul_flops(path: str, cpu: str, threads: int) -> tuple[tuple[str, float], ...]:
    measured = _cached(
        Path(path),
        f"{cpu} | {threads} threads | torch {torch.__version__}",
        lambda: {
            name: measure_matmul_flops(dtype)
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
        },
    )
    return tuple(sorted(measured.items()))


def peak_bandwidth(device: torch.device | str, cache_dir: str | None = None) -> float:
    """The device's measured memory read bandwidth in bytes/s, the bound of a decode step
    (``perf/rollout_roofline``). On a CPU measured once per CPU model, thread count and torch version and
    cached beside the matmul peak; on a GPU measured once per process."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_bandwidth(device.index or 0)
    return _cpu_bandwidth(str(_cache_file(cache_dir)), cpu_name(), torch.get_num_threads())


@functools.cache
def _cpu_bandwidth(path: str, cpu: str, threads: int) -> float:
    key = f"{cpu} | {threads} threads | torch {torch.__version__} | read bytes/s"
    return _cached(Path(path), key, lambda: {"bytes_per_s": measure_bandwidth()})["bytes_per_s"]


def _cached(file: Path, key: str, measure) -> dict:
    """``file``'s entry under ``key``, or ``measure()`` stored there first (a probe runs once per machine)."""
    try:
        cached = json.loads(file.read_text()).get(key)
    except (OSError, ValueError):
        cached = None
    if not cached:
        cached = measure()
        _store(file, key, cached)
    return cached


@functools.cache
def _cuda_bandwidth(index: int) -> float:
    return measure_bandwidth(torch.device("cuda", index))


def _store(file: Path, key: str, value: dict) -> None:
    try:
        known = json.loads(file.read_text())
    except (OSError, ValueError):
        known = {}
    known[key] = value
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(file)  # atomic: concurrent ranks never read half a file


def _cache_file(cache_dir: str | None) -> Path:
    from lit_grpo.model.sources import cache_root

    return cache_root(cache_dir) / "matmul_peak.json"


def peak_flops(device: torch.device | str, cache_dir: str | None = None) -> float:
    """The device's peak matmul FLOP/s, the denominator of ``perf/mfu`` (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for known, tflops in CUDA_BF16_PEAK_TFLOPS.items():
            if known in name:
                return tflops * 1e12
        return _cuda_measured(device.index or 0)
    return max(cpu_matmul_flops(cache_dir).values())


@functools.cache
def _cuda_measured(index: int) -> float:
    return measure_matmul_flops(torch.bfloat16, torch.device("cuda", index))


def warn_if_bf16_slower(cache_dir: str | None = None) -> None:
    """Warn when bf16 was asked for on a CPU whose bf16 matmuls are slower than its fp32 ones.

    Such a CPU (no AMX, no AVX-512 BF16 units) emulates bf16, and the whole
    run slows with it, several times over; ``policy.dtype: auto`` would pick fp32.
    """
    flops = cpu_matmul_flops(cache_dir)
    if flops["bfloat16"] < flops["float32"]:
        warnings.warn(
            f"policy.dtype='bfloat16' on a CPU ({cpu_name()}) whose bf16 matmuls measure "
            f"{flops['bfloat16'] / 1e9:.0f} GFLOP/s against {flops['float32'] / 1e9:.0f} in fp32 (bf16 is "
            f"emulated here): this run will be slower than in float32. policy.dtype: auto picks float32 here.",
            stacklevel=3,
        )


def fastest_dtype(cache_dir: str | None = None) -> str:
    """The dtype ``policy.dtype: auto`` trains in here: ``"bfloat16"`` or ``"float32"`` (module docstring)."""
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    flops = cpu_matmul_flops(cache_dir)
    return "bfloat16" if flops["bfloat16"] >= BF16_MIN_SPEEDUP * flops["float32"] else "float32"
