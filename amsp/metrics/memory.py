"""Memory of this process, as the metrics logger reports it at each log step.

CUDA: the caching allocator's peaks since the previous log step (the peak statistics are reset
after each reading, so every log interval reports its own peak) and what is allocated now.
CPU: the resident set size now (/proc/self/statm) and the peak RSS since the previous log step
(VmHWM of /proc/self/status, reset after each reading through /proc/self/clear_refs). Not getrusage:
its ru_maxrss survives exec, so a rank spawned by a large parent (pytest, a launcher) would report the
parent's resident set as its own peak. Without procfs (macOS) the lifetime ru_maxrss is the peak.
"""
from __future__ import annotations

import os
import resource
import sys

import torch

# What `memory_snapshot` returns; None where the device has no such number.
MEMORY_FIELDS = ("memory_peak_bytes", "memory_reserved_peak_bytes", "memory_current_bytes")
# What the numbers mean, written into every record so a reader needs no device knowledge.
MEMORY_KIND = {"cuda": "cuda_allocator", "cpu": "cpu_rss"}


def _status_kib(fields: tuple[str, ...]) -> dict[str, int] | None:
    try:
        with open("/proc/self/status") as f:
            got = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in fields}
    except OSError:
        return None
    return got if len(got) == len(fields) else None


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on CUDA, peak RSS of this process image on CPU; both since the last reset."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    got = _status_kib(("VmHWM",))
    if got is not None:
        return got["VmHWM"] * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(rss if sys.platform == "darwin" else rss * 1024)


def release_freed_heap() -> bool:
    """Hand glibc's freed heap memory back to the kernel (malloc_trim(0): the heap's top, and the free
    pages inside it through madvise), so that a resident-set baseline taken next does not hold blocks
    the process already freed. With glibc's defaults the freed blocks of the startup's measurements
    (the compute profile's block, head and 4 x 128 MiB AdamW tensors) stayed resident; the engine then
    reused them below the recheck's baseline, which read the main job's peak ~100 MiB low whenever
    the profile was measured rather than cached (0.245 against 0.348 GiB). False where there is no
    glibc (nothing to do)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def reset_cpu_peak() -> None:
    """Restart VmHWM from the current RSS ("5": reset the peak RSS only; proc(5) clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # no procfs: the peak stays the lifetime peak, as documented above
        pass


def anon_rss_bytes() -> int:
    """Anonymous and shared-memory resident bytes now: what the kernel cannot reclaim without swap (the
    tensors, the runtime's heaps), unlike file-backed pages (code, a memory-mapped dataset). Without the
    fields (no procfs): the resident set."""
    got = _status_kib(("RssAnon", "RssShmem"))
    return current_rss_bytes() if got is None else (got["RssAnon"] + got["RssShmem"]) * 1024


def anon_peak_bytes() -> int:
    """The peak resident set since the last reset less the file-backed pages now: the anonymous peak,
    exact when no file page (the memory-mapped dataset as training reads it, code as it first runs) was
    mapped between the peak and now, otherwise short by those pages (a few steps' worth: the window since
    the last reset)."""
    got = _status_kib(("VmHWM", "RssFile"))
    return peak_memory_bytes(torch.device("cpu")) if got is None else (got["VmHWM"] - got["RssFile"]) * 1024


def current_rss_bytes() -> int:
    """Resident set size of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no procfs (macOS): the lifetime peak is the closest number there is
        return peak_memory_bytes(torch.device("cpu"))


def memory_snapshot(device: torch.device, reset_peak: bool = True) -> dict[str, int | None]:
    """MEMORY_FIELDS for `device`. The peak (CUDA allocator, CPU VmHWM) restarts afterwards when
    reset_peak, so the next snapshot reports the peak of the next window only."""
    if device.type == "cuda":
        out = {"memory_peak_bytes": int(torch.cuda.max_memory_allocated(device)),
               "memory_reserved_peak_bytes": int(torch.cuda.max_memory_reserved(device)),
               "memory_current_bytes": int(torch.cuda.memory_allocated(device))}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        return out
    if device.type == "cpu":
        current = current_rss_bytes()
        # The kernel's high-water mark lags the RSS it is compared with by a few pages (per-CPU
        # counters), and a peak is never below the current value by definition.
        out = {"memory_peak_bytes": max(peak_memory_bytes(device), current), "memory_reserved_peak_bytes": None,
               "memory_current_bytes": current}
        if reset_peak:
            reset_cpu_peak()
        return out
    raise ValueError(f"no memory statistics for device type {device.type!r}")
