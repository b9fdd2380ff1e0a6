"""Startup bandwidth probe: time the three collectives on the real ranks and build the curves.

Two shapes, each with every rank taking part at once, because concurrency is what the cost model
prices (cost_model.py):
  * intra: the node groups of amsp.topology (shard groups of degree R): per-rank bus bandwidth
    bytes*f(R)/t;
  * inter: the replica groups of degree R (one rank per node, R groups side by side): bus bandwidth
    through one node's interfaces, R*bytes*f(nodes)/t.
With amsp.ranks_per_node smaller than the real ranks per machine, one machine poses as several
nodes and "inter" measures whatever joins those ranks (loopback here, veth links in the emulated
cluster). Each (kind, size) is timed `repeats` times after one warm-up; the slowest rank's median
counts. Only the timed collectives run on the data plane (the device's backend and tensors: that
is what is measured); the barriers, the slowest-rank reduction and the object exchanges are control
values and go through amsp.control. The result is cached on disk keyed by the cluster shape (world,
ranks per node, the set of host names, backend, device type, probe sizes), so a restarted job skips
the probe.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import socket
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from amsp import control
from amsp.routing_check import data_plane
from amsp.topology import Topology

from .cluster import KINDS, BandwidthCurve, ClusterSpec, format_size, ring_factor

log = logging.getLogger(__name__)

PROBE_SIZES = (64 * 2**10, 512 * 2**10, 4 * 2**20)  # bytes per call (amsp.schedule's convention)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("AMSP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "amsp")
    return pathlib.Path(base) / "probe"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(kind: str, nbytes: int, n: int, group, device: torch.device) -> None:
    elems = max(n, nbytes // 4 // n * n)  # fp32, divisible by the group size
    with data_plane():
        if kind == "all_gather":
            out = torch.empty(elems, device=device)
            _ALL_GATHER(out, torch.ones(elems // n, device=device), group=group)
        elif kind == "reduce_scatter":
            out = torch.empty(elems // n, device=device)
            _REDUCE_SCATTER(out, torch.ones(elems, device=device), group=group)
        else:
            dist.all_reduce(torch.ones(elems, device=device), group=group)


def _time(kind: str, nbytes: int, n: int, group, device: torch.device, repeats: int) -> float:
    _run(kind, nbytes, n, group, device)  # warm-up: connection setup, allocation
    samples = []
    for _ in range(repeats):
        control.barrier()
        _sync(device)
        t0 = time.perf_counter()
        _run(kind, nbytes, n, group, device)
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return control.all_reduce_max_floats([statistics.median(samples)])[0]


def measure(topo: Topology, rank: int, device: torch.device, sizes=PROBE_SIZES, repeats: int = 2) -> dict:
    """{(kind, scope): [(bytes, GB/s), ...]} measured on all ranks (collective: every rank calls it)."""
    r, nodes = topo.ranks_per_node, topo.nodes
    shapes = []
    if r > 1:
        shapes.append(("intra", topo.shard_groups(r), r, 1.0))
    if nodes > 1:
        shapes.append(("inter", topo.replica_groups(r), nodes, float(r)))
    points: dict = {}
    for scope, groups, n, concurrency in shapes:
        # data-plane groups with the run's timeout; collective over the world, same order everywhere
        handles = [dist.new_group(list(g), timeout=control.collective_timeout()) for g in groups]
        mine = handles[[i for i, g in enumerate(groups) if rank in g][0]]
        for kind in KINDS:
            for size in sizes:
                t = _time(kind, size, n, mine, device, repeats)
                gbps = size * ring_factor(kind, n) * concurrency / t / 1e9
                points.setdefault((kind, scope), []).append((size, gbps))
    return points


def cache_key(topo: Topology, hosts: list[str], backend: str, device: torch.device, sizes=PROBE_SIZES) -> str:
    shape = {"world": topo.world, "ranks_per_node": topo.ranks_per_node, "hosts": sorted(set(hosts)),
             "backend": backend, "device": device.type, "sizes": list(sizes), "torch": torch.__version__}
    return hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def _to_json(points: dict) -> dict:
    return {f"{k}|{s}": pts for (k, s), pts in points.items()}


def _from_json(d: dict) -> dict:
    return {tuple(key.split("|")): [tuple(p) for p in pts] for key, pts in d.items()}


def probe_points(topo: Topology, rank: int, device: torch.device, cache_dir: pathlib.Path | None = None,
                 use_cache: bool = True) -> tuple[dict, str]:
    """(measured or cached points {(kind, scope): [(bytes, GB/s)]}, 'probe' | 'cache'). Collective."""
    backend = dist.get_backend()
    hosts = control.all_gather_object(socket.gethostname())
    key = cache_key(topo, hosts, backend, device)
    path = (cache_dir or default_cache_dir()) / f"probe-{key}.json"
    box = [None]
    if rank == 0 and use_cache and path.exists():
        try:
            box[0] = json.loads(path.read_text())["points"]
        except (OSError, ValueError, KeyError) as e:
            log.warning("probe cache %s unreadable (%s); probing again", path, e)
    box[0] = control.broadcast_object(box[0], src=0)
    if box[0] is not None:
        points, source = _from_json(box[0]), "cache"
        if rank == 0:
            log.info("bandwidth probe: cached result %s for %d ranks x %d per node", path, topo.world,
                     topo.ranks_per_node)
    else:
        t0 = time.perf_counter()
        points, source = measure(topo, rank, device), "probe"
        if rank == 0:
            log.info("bandwidth probe: %d ranks (%d per node, %d node(s)) over %s in %.2f s", topo.world,
                     topo.ranks_per_node, topo.nodes, backend, time.perf_counter() - t0)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "hosts": sorted(set(hosts)), "world": topo.world,
                                       "ranks_per_node": topo.ranks_per_node, "backend": backend,
                                       "points": _to_json(points)}, indent=1))
            tmp.replace(path)
    if rank == 0:
        log.info("measured collective bandwidths (bus GB/s; inter = per node):\n%s", format_points(points))
    return points, source


def apply_points(cluster: ClusterSpec, points: dict, source: str) -> ClusterSpec:
    """The cluster with the measured curves in place of its preset ones."""
    curves = dict(cluster.curves)
    for (kind, scope), pts in points.items():
        curves[(kind, scope)] = BandwidthCurve(tuple(sorted((int(s), float(b)) for s, b in pts)))
    missing = [s for s in ("intra", "inter") if not any(sc == s for _, sc in points)]
    if missing:
        log.info("bandwidth probe: nothing to measure %s (%s); the %s figures stay", "/".join(missing),
                 "a single node" if "inter" in missing else "one rank per node", cluster.name)
    return replace(cluster, curves=curves, source=source)


def format_points(points: dict) -> str:
    lines = []
    for (kind, scope), pts in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"  {scope:5s} {kind:14s} " + "  ".join(f"{format_size(s)}:{b:.3g}" for s, b in pts))
    return "\n".join(lines)
