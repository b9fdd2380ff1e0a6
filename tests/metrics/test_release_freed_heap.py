"""The recheck's CPU baseline is taken after glibc has handed back what the startup freed
(amsp.metrics.memory.release_freed_heap): otherwise the engine reuses those resident blocks below the
baseline and the measured peak reads low whenever the startup measured something."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent("""
    import gc, torch
    from amsp.metrics.memory import anon_rss_bytes, release_freed_heap
    base = anon_rss_bytes()
    xs = [torch.ones(25_000) for _ in range(2000)]  # 100 KB each: under glibc's mmap threshold, on the heap
    pin = torch.ones(10)  # allocated after them: the freed blocks are not the heap's trimmable top
    del xs
    gc.collect()
    held = anon_rss_bytes() - base
    print(held, int(release_freed_heap()), anon_rss_bytes() - base)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and procfs")
def test_freed_heap_blocks_leave_the_resident_set():
    env = {"PATH": "/usr/bin:/bin"}  # glibc's defaults: no MALLOC_* settings inherited
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120,
                         cwd=Path(__file__).resolve().parents[2], check=True).stdout.split()
    held, released, after = int(out[0]), out[1] == "1", int(out[2])
    assert held > 150 * 2**20  # 200 MB freed, still resident: the situation the baseline must not include
    assert released and after < held / 4
