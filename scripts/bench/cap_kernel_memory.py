"""Kernel memory of a capped rank at its peak, against the kernel memory's own maximum (CPU, cgroup v1).

A cgroup-v1 memory group is charged for its anonymous pages and, with kernel-memory accounting on, for
the kernel memory its processes use (page tables, slab; TCP buffers only where memory.kmem.tcp has a
limit). What a cap kills for is the sum at its largest, so the kernel memory that matters is the one at
that moment, not memory.kmem.max_usage_in_bytes, which may peak elsewhere in the run. Each configuration
of joint_memory_caps.py runs once in unlimited groups (its MEASURED_IN_GROUPS mode) while this samples
every rank's group every 50 ms: the group's anonymous pages (memory.stat rss) plus its kernel memory at
their sampled peak, the kernel memory there, and its maximum over the run; with each rank's anonymous
memory above where it joined its group (what the reserve and the prediction price, from the rank's
VmHWM). `--reserve` adds the debug-sized run the bench's runtime reserve is measured on.

    python scripts/bench/cap_kernel_memory.py --only 3,13 --reserve     # needs root (cgroup v1)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import joint_memory_caps as caps  # noqa: E402

MIB = 2**20
RESERVE_RUN = ("reserve (debug model)", (1, 1, (1, 1, 1), 1),
               ["model=debug", "data.seq_len=64", "trainer.global_batch_size=8"])


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the group is not there yet, or already removed
        return None


def sample_groups(tag_dir: str, best: dict, stop: threading.Event) -> None:
    """Per rank file in tag_dir: the sample where anonymous + kernel memory was largest."""
    groups: dict[str, str] = {}  # rank file -> its group's directory, read once the rank has joined
    while not stop.wait(0.05):
        for name in (n for n in os.listdir(tag_dir) if n.startswith("rank") and n not in groups):
            group = _read(os.path.join(tag_dir, name))
            if group:
                groups[name] = group.strip()
        for name, group in groups.items():
            kmem = _read(os.path.join(group, "memory.kmem.usage_in_bytes"))
            stat = _read(os.path.join(group, "memory.stat"))
            if kmem is None or stat is None:
                continue
            anon = int(dict(line.split() for line in stat.splitlines())["rss"])
            if anon + int(kmem) > best.get(name, (0, 0))[0]:
                best[name] = (anon + int(kmem), int(kmem))


def measure(cfg: tuple, extra: list[str], work: str) -> list[dict]:
    tag_dir = tempfile.mkdtemp(dir=work)
    best, stop = {}, threading.Event()
    sampler = threading.Thread(target=sample_groups, args=(tag_dir, best, stop))
    sampler.start()
    try:
        got = caps.run(*cfg, caps.MEASURED_IN_GROUPS, extra, work, prefix="kmem_", tag_dir=tag_dir)
    finally:
        stop.set()
        sampler.join()
    out = []
    for g in got["groups"]:
        r = json.load(open(os.path.join(tag_dir, f"peak{g['rank'][4:]}.json")))
        charged, kmem_at_peak = best.get(g["rank"], (0, 0))
        out.append({"rank": g["rank"], "anon_above_join_mib": r["anon_base_mib"] - r["anon_join_mib"]
                    + caps.anon_growth_mib(r), "join_to_build_mib": r["anon_base_mib"] - r["anon_join_mib"],
                    "growth_mib": caps.anon_growth_mib(r), "charged_peak_mib": charged / MIB,
                    "kmem_at_peak_mib": kmem_at_peak / MIB, "kmem_max_mib": g["kmem_peak_bytes"] / MIB})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="3,13", help="comma-separated joint_memory_caps.CONFIGS indices")
    ap.add_argument("--reserve", action="store_true", help="also the runtime reserve's debug-sized run")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.access(caps.CGROUP, os.W_OK):
        raise SystemExit(f"{caps.CGROUP} is not writable: needs root and a cgroup-v1 memory controller")
    runs = [(str(caps.CONFIGS[int(i)]), caps.CONFIGS[int(i)], caps.MODEL) for i in a.only.split(",")]
    runs += [RESERVE_RUN] if a.reserve else []
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, cfg, extra in runs:
            for r in measure(cfg, extra, work):
                rows.append({"run": name, **r})
                print(f"{name} {r['rank']}: anonymous above the join {r['anon_above_join_mib']:.1f} MiB, group "
                      f"peak {r['charged_peak_mib']:.1f} MiB with {r['kmem_at_peak_mib']:.1f} MiB kernel memory "
                      f"there (maximum over the run {r['kmem_max_mib']:.1f})", flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
