"""Where a CUDA memory peak comes from: the allocations alive at the peak, by the code that made them.

torch's allocator can record every allocation and free with its Python stack
(torch.cuda.memory._record_memory_history). Replaying that trace finds the moment the allocated
bytes were highest and what was alive then; grouping those blocks by the innermost frame in this
repository names the term of the planner's memory model each one belongs to (a gathered unit,
a gradient bucket, an activation saved by a block, an optimizer state). The memory benchmark
(scripts/bench/bench_gpu_memory.py --breakdown) prints it beside the prediction's parts, which is how a
prediction error is traced to the term that is wrong rather than guessed at.

    with recorded_allocations() as rec:
        ...train a step...
    peak, rows = peak_breakdown(rec.snapshot)

live_cuda_tensors() answers the other question, what keeps memory after its owner was deleted.
"""
from __future__ import annotations

import gc
import os
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SELF = os.path.abspath(__file__)


@dataclass
class Recording:
    snapshot: dict = field(default_factory=dict)


@contextmanager
def recorded_allocations(max_entries: int = 1_000_000):
    """Record the CUDA allocator's allocations and frees (with Python stacks) inside the block; the
    snapshot is on the yielded object afterwards. Recording costs host time per allocation: for
    diagnosis, not for timed runs."""
    rec = Recording()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield rec
    finally:
        rec.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)


def _origin(frames: list[dict]) -> str:
    """The innermost frame of this repository's code (not this module), as 'path:line function';
    else the innermost frame at all."""
    for f in frames:
        name = os.path.abspath(f.get("filename", ""))
        if name.startswith(REPO + os.sep) and name != _SELF:
            return f"{os.path.relpath(name, REPO)}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line')} {f.get('name')}"
    return "(no stack)"


def peak_breakdown(snapshot: dict, device: int = 0, top: int = 15) -> tuple[int, list[tuple[str, int, int]]]:
    """(peak bytes allocated since the recording began, [(origin, bytes, blocks)] alive at that peak,
    largest first, the rest summed as one last row). A block is counted from its 'alloc' to its
    'free_completed' (the allocator's own accounting: a block freed while a stream still used it
    stays allocated until the stream is done); frees of blocks allocated before the recording began
    are ignored, so the peak is of what the recorded code allocated."""
    trace = snapshot["device_traces"][device]
    live: dict[int, int] = {}
    now = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = e["size"]
            now += e["size"]
            if now > peak:
                peak, peak_at = now, i
        elif action == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])
    alive: dict[int, dict] = {}
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    groups: dict[str, list[int]] = {}
    for e in alive.values():
        g = groups.setdefault(_origin(e.get("frames", [])), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    rows = sorted(((k, v[0], v[1]) for k, v in groups.items()), key=lambda r: -r[1])
    if len(rows) > top:
        rest = rows[top:]
        rows = rows[:top] + [(f"({len(rest)} other places)", sum(r[1] for r in rest), sum(r[2] for r in rest))]
    return peak, rows


def format_breakdown(peak: int, rows: list[tuple[str, int, int]]) -> str:
    gib = 2**30
    lines = [f"peak {peak / gib:.3f} GiB allocated by the recorded code; alive at the peak, by origin:"]
    lines += [f"  {b / gib:8.3f} GiB  {n:5d} blocks  {origin}" for origin, b, n in rows]
    return "\n".join(lines)


def _is_cuda_tensor(obj) -> bool:
    try:
        return isinstance(obj, torch.Tensor) and obj.is_cuda
    except Exception:  # noqa: BLE001 - proxies and half-built objects can raise anything here
        return False


def live_cuda_tensors(top: int = 6) -> str:
    """The largest CUDA tensors Python still reaches, by (shape, dtype), with what refers to one of each
    (two levels of referrer types): what keeps a freed variant's memory."""
    groups: dict[tuple, list] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if _is_cuda_tensor(o)]
    for obj in objects:
        try:
            key = (tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
            g = groups.setdefault(key, [0, 0, obj])
            g[0] += obj.untyped_storage().nbytes()
            g[1] += 1
        except RuntimeError:  # e.g. a tensor subclass without storage
            continue
    del objects
    lines = []
    for (shape, dtype), (nbytes, count, example) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        refs, mine = [], [groups, *groups.values()]  # this function's own bookkeeping
        for r in gc.get_referrers(example):
            if isinstance(r, types.FrameType) or any(r is m for m in mine):
                continue
            up = [type(r2).__name__ for r2 in gc.get_referrers(r) if r2 is not groups][:3]
            refs.append(f"{type(r).__name__}{'<' + ','.join(up) + '>' if up else ''}")
        lines.append(f"  {count} x {shape} {dtype}: {nbytes / 2**20:.0f} MiB (storage); referred to by "
                     f"{', '.join(refs[:4]) or 'nothing Python sees'}")
    return "\n".join(lines) or "  no CUDA tensor reachable from Python (held by C++: autograd graph, caches)"
