"""The memory a run's allocator holds beyond its live tensors, as a fraction of the tensor peak: the
planners' allocator margin (amsp.planner.memory_margin; null: this module's figure for the device and
allocator the run uses).

- CUDA: PyTorch's caching allocator keeps freed blocks cached for reuse by later requests; on one GPU
  the reserved peak was 1.06-1.07x the allocated one for 1/1/8 plans and up to 1.5x for 2/8/8
  (BENCHMARKS.md, planner memory on an H200). 8%, which the recheck raises to what the run reserved.
- CPU, glibc with an explicit mmap threshold of at most 128 KiB and a trim threshold
  (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, or glibc.malloc.* in GLIBC_TUNABLES): every
  tensor block is a mapping of its own, unmapped when freed, so the resident set follows the live
  tensors: 0. Run this way, 27 pipeline stages of 20 layouts (scripts/bench/joint_memory_caps.py
  --fidelity, 26 Nov) held anonymous peaks within -2.2% and +10.0% of the planner's tensor peak without
  any margin (mean |error| 1.9%; no stage more than 22 MiB above it).
- CPU, glibc's defaults: the mmap threshold grows with the blocks freed (up to 32 MiB) and freed heap
  blocks stay with the process; the main job's recheck measured 24% above its tensors. 8% as on
  CUDA, and the recheck raises it to what the run held.
- CPU, either setting, plus the page tables that map the tensors' pages: one 8-byte entry per 4 KiB
  page (x86-64 with transparent huge pages at `madvise` or `never`, as here: glibc does not ask for
  them), 1/512 of the tensors, kernel memory a memory cgroup charges with them. Measured on 4 gloo ranks
  (cgroup v1, scripts/bench/cap_kernel_memory.py, 28 Nov): 3.0-3.6 MiB of kernel memory at the peak of
  1.0-1.2 GiB ranks against 1.3 MiB for a 233 MiB one, +1/512 of the difference within 0.3 MiB. A
  GPU's page tables are the driver's, outside the allocations.

Torch-free: the planner CLI and the config check import it."""
from __future__ import annotations

import os
from typing import Mapping

CACHING_MARGIN = 0.08
GLIBC_DEFAULT_MARGIN = 0.08
PAGE_TABLE_FRACTION = 8 / 4096  # one page-table entry (8 bytes) per 4 KiB page of host memory
# glibc's own default M_MMAP_THRESHOLD: at or below it, and fixed, tensor blocks are mapped one by one
RETURNING_MMAP_THRESHOLD = 128 * 1024


def _glibc_settings(env: Mapping[str, str]) -> dict[str, str]:
    """glibc malloc's mmap and trim thresholds as the environment sets them (tunables win over the
    older MALLOC_*_ variables, as in glibc)."""
    out = {k: env[v] for k, v in (("mmap_threshold", "MALLOC_MMAP_THRESHOLD_"),
                                  ("trim_threshold", "MALLOC_TRIM_THRESHOLD_")) if v in env}
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name in ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold"):
            out[name.rsplit(".", 1)[1]] = value
    return out


def glibc_returns_freed_blocks(env: Mapping[str, str] | None = None) -> bool:
    """Whether glibc is set to map every block over a small fixed threshold and give freed memory
    back (what the memory benches run with), so the resident set follows the live tensors."""
    s = _glibc_settings(os.environ if env is None else env)
    try:
        mmap = int(s["mmap_threshold"], 0)
        int(s["trim_threshold"], 0)
    except (KeyError, ValueError):
        return False
    return 0 < mmap <= RETURNING_MMAP_THRESHOLD


def allocator_margin(device: str, env: Mapping[str, str] | None = None) -> tuple[float, str]:
    """(margin, why) for the allocator that serves `device` ("cpu" | "cuda") in this environment."""
    if device == "cuda":
        return CACHING_MARGIN, "PyTorch's caching allocator keeps freed blocks for reuse"
    tables = f"the page tables of the tensors' pages {100 * PAGE_TABLE_FRACTION:.1f}%"
    if glibc_returns_freed_blocks(env):
        return PAGE_TABLE_FRACTION, ("glibc maps each block over a small fixed threshold and returns freed "
                                     f"memory; {tables}")
    return (GLIBC_DEFAULT_MARGIN + PAGE_TABLE_FRACTION,
            f"glibc's defaults keep freed blocks ({100 * GLIBC_DEFAULT_MARGIN:.0f}%); {tables}")


def margin_for(configured: float | None, device: str, env: Mapping[str, str] | None = None) -> float:
    """amsp.planner.memory_margin when set, else the allocator's."""
    return allocator_margin(device, env)[0] if configured is None else configured


def describe_margin(configured: float | None, device: str, env: Mapping[str, str] | None = None) -> str:
    """One line for the planner's report: the margin it fits plans with and where it comes from."""
    if configured is not None:
        return f"allocator margin {100 * configured:.0f}% of the tensor peak (amsp.planner.memory_margin)"
    margin, why = allocator_margin(device, env)
    return f"allocator margin {100 * margin:.1f}% of the tensor peak ({why})"
