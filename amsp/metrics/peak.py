"""The peak FLOP/s that MFU is measured against.

On CUDA the peak is a datasheet number (dense, no sparsity) for the compute dtype: from an
explicit override (`logging.peak_tflops`, or the cluster config once it carries one), else from a
small table keyed by the device name. On CPU there is no trustworthy datasheet number, so the peak
is measured: the best rate of a few square matrix products in the compute dtype with this
process's thread count, cached on disk keyed by CPU model, threads and dtype so that a run pays
the measurement once per machine type.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import platform
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Dense bf16/fp16 tensor-core peaks in TFLOP/s (vendor datasheets, SXM parts unless named).
_CUDA_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H800": 989.0,
    "A800": 312.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "V100": 125.0,  # fp16 tensor cores (no bf16 ones)
}


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s per device
    source: str  # where the number came from, logged once at startup


def cuda_table_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """Datasheet peak for a CUDA device name, or None when the table does not know it."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None  # fp32/TF32 peaks depend on TF32 settings; ask for an explicit override
    for key in sorted(_CUDA_BF16_TFLOPS, key=len, reverse=True):  # most specific name first
        if key in device_name:
            return _CUDA_BF16_TFLOPS[key] * 1e12
    return None


def cpu_model_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("AMSP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "amsp")
    return pathlib.Path(base)


def measure_matmul_flops(dtype: torch.dtype = torch.float32, sizes: tuple[int, ...] = (512, 1024, 2048),
                         min_time_s: float = 0.2) -> float:
    """Best observed FLOP/s of an n^3 matrix product on CPU over the given sizes."""
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warm-up: first call pays allocation and kernel selection
        reps, elapsed = 0, 0.0
        while elapsed < min_time_s:
            t0 = time.perf_counter()
            torch.mm(a, b)
            dt = time.perf_counter() - t0
            elapsed += dt
            reps += 1
            best = max(best, 2.0 * n ** 3 / dt)
    return best


def cpu_measured_peak(dtype: torch.dtype = torch.float32, cache_dir: pathlib.Path | None = None) -> Peak:
    threads = torch.get_num_threads()
    key = f"{cpu_model_name()}|threads={threads}|{str(dtype).removeprefix('torch.')}"
    path = (cache_dir or default_cache_dir()) / "cpu_matmul_peak.json"
    cache: dict[str, float] = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("ignoring unreadable peak cache %s; measuring again", path)
    if key in cache:
        return Peak(float(cache[key]), f"measured matmul peak (cached in {path}, key {key!r})")
    flops = measure_matmul_flops(dtype)
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores + 1:
        # Other processes took cycles from the measurement: use it for this run, but do not make
        # every later run inherit a low peak (and so an inflated MFU).
        log.warning("load average %.1f on %d cores: the measured peak %.1f GFLOP/s is likely low; not caching it",
                    load, cores, flops / 1e9)
        return Peak(flops, f"measured matmul peak ({key!r}) on a busy machine, not cached")
    cache[key] = flops
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic, so concurrent runs never read half a file
    except OSError as e:
        log.warning("could not cache the measured peak in %s: %s", path, e)
    return Peak(flops, f"measured matmul peak ({key!r}, now cached in {path})")


def resolve_peak(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None,
                 cluster_tflops: float | None = None, cache_dir: pathlib.Path | None = None) -> Peak | None:
    """The per-device peak for MFU, or None (MFU not reported) for an unknown GPU without override.

    Precedence: logging.peak_tflops, then the cluster config's peak_tflops, then auto."""
    for value, name in ((override_tflops, "logging.peak_tflops override"), (cluster_tflops, "cluster.peak_tflops")):
        if value is not None:
            if value <= 0:
                raise ValueError(f"{name.split()[0]} must be positive, got {value}")
            return Peak(value * 1e12, name)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        flops = cuda_table_peak(name, dtype)
        if flops is None:
            log.warning("no known %s peak for %r: MFU is not reported; set logging.peak_tflops", dtype, name)
            return None
        return Peak(flops, f"datasheet dense {dtype} peak for {name}")
    if device.type == "cpu":
        return cpu_measured_peak(dtype, cache_dir)
    raise ValueError(f"no peak FLOP/s rule for device type {device.type!r}; set logging.peak_tflops")
