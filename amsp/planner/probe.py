"""Startup bandwidth probe: time the three collectives on the real ranks and merge the curves into
the preset's.

Shapes, each with the groups of one layout running at once, because concurrency is what the cost
model prices (comm_time.py):
  * intra: the node groups of amsp.topology (shard groups of degree R, one per node, all at once):
    per-rank bus bandwidth S*f(R)/t;
  * inter: the replica groups of degree `nodes` (one rank per node, R groups side by side sharing
    each node's NICs): bus bandwidth through one node's interfaces, R*S*f(nodes)/t — what the cost
    model divides by (R/k groups share a node's NICs);
  * inter, one group: replica group 0 alone (the other ranks idle), logged next to the concurrent
    figure so the NIC sharing is visible (concurrent/alone = 1 means the groups do not contend).
Sizes grow by 4x from 64 KiB up to amsp.planner.probe_max_mib (256 MiB by default) until the probe's
time budget (amsp.planner.probe_budget_s) would be exceeded; what was measured is logged. Points are
stored as cluster.py's lookup convention reads them: (per-rank chunk S/n, bus GB/s).

With amsp.ranks_per_node smaller than the real ranks per machine, one machine poses as several
nodes and "inter" measures whatever joins those ranks (loopback here, veth links in the emulated
cluster). Each (kind, size) is timed `repeats` times after one warm-up; the slowest rank's median
counts, and the budget is charged with that agreed time, so every rank stops at the same size. Only
the timed collectives run on the data plane; barriers, the slowest-rank reduction and the object
exchanges are control values and go through amsp.control.

The measured points are merged with the preset's curves (merge_curve): inside the measured size
range the measurement wins; outside it the preset's curve is scaled to meet the measurement at its
ends, so the curve stays continuous and keeps the preset's shape where nothing was measured. The
result is cached on disk keyed by the cluster shape (world, ranks per node, the set of host names,
backend, device type, candidate sizes, budget; hosts are named with their network namespace and
socket interfaces, network_identity), so a restarted job skips the probe.
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

from .cache_file import read_shared, write_atomic
from .cluster import KINDS, SCOPES, BandwidthCurve, ClusterSpec, format_size, ring_factor

log = logging.getLogger(__name__)

PROBE_MIN_BYTES = 64 * 2**10
PROBE_MAX_BYTES = 256 * 2**20
PROBE_BUDGET_S = 4.0
SINGLE_GROUP = "inter_one_group"  # logged scope: replica group 0 alone (not a cost-model curve)


def probe_sizes(max_bytes: int = PROBE_MAX_BYTES, min_bytes: int = PROBE_MIN_BYTES) -> tuple[int, ...]:
    """Candidate message sizes S (bytes per call, amsp.schedule's convention), x4 apart."""
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    return tuple(sizes)


PROBE_SIZES = probe_sizes()
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
    """Slowest rank's median seconds of one call; a rank outside any group (group None) only joins
    the barriers and the reduction."""
    if group is not None:
        _run(kind, nbytes, n, group, device)  # warm-up: connection setup, allocation
    samples = []
    for _ in range(repeats):
        control.barrier()
        _sync(device)
        t0 = time.perf_counter()
        if group is not None:
            _run(kind, nbytes, n, group, device)
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return control.all_reduce_max_floats([statistics.median(samples)])[0]


def _shapes(topo: Topology, rank: int) -> list:
    """(scope, my group handle or None, group size, groups sharing a node's links) per measured layout."""
    r, nodes = topo.ranks_per_node, topo.nodes
    shapes = []

    def handles(groups):  # data-plane groups with the run's timeout; collective over the world
        return [dist.new_group(list(g), timeout=control.collective_timeout()) for g in groups]

    if r > 1:
        groups = topo.shard_groups(r)
        hs = handles(groups)
        shapes.append(("intra", hs[_index(groups, rank)], r, 1.0))
    if nodes > 1:
        groups = topo.replica_groups(r)
        hs = handles(groups)
        mine = _index(groups, rank)
        shapes.append(("inter", hs[mine], nodes, float(r)))
        if r > 1:  # the same layout with one group running: what a node's NICs give one group
            shapes.append((SINGLE_GROUP, hs[mine] if mine == 0 else None, nodes, 1.0))
    return shapes


def _index(groups, rank: int) -> int:
    return next(i for i, g in enumerate(groups) if rank in g)


def measure(topo: Topology, rank: int, device: torch.device, sizes=PROBE_SIZES, repeats: int = 2,
            budget_s: float = PROBE_BUDGET_S) -> dict:
    """{(kind, scope): [(per-rank chunk bytes, bus GB/s), ...]} measured on all ranks (collective).

    Sizes grow until the next one would take the probe past budget_s (the next size's time is
    guessed as 4x the last one's, the bandwidth-bound regime); the charge is the agreed slowest-rank
    time, so all ranks stop together."""
    shapes = _shapes(topo, rank)
    points: dict = {}
    spent, stopped = 0.0, {}
    # each (layout, kind) gets an equal share, so every curve reaches comparable sizes
    share = budget_s / max(1, len(shapes) * len(KINDS))
    for scope, group, n, concurrency in shapes:
        for kind in KINDS:
            last, here = 0.0, 0.0
            for size in sizes:
                if last and here + (repeats + 1) * 4 * last > share:
                    stopped[(kind, scope)] = size
                    break
                t = _time(kind, size, n, group, device, repeats)
                last, here = t, here + (repeats + 1) * t
                gbps = size * ring_factor(kind, n) * concurrency / t / 1e9
                points.setdefault((kind, scope), []).append((max(1, size // n), gbps))
            spent += here
    if rank == 0:
        cut = ", ".join(f"{s} {k} up to {format_size(stopped[(k, s)] // 4)}" for k, s in sorted(stopped))
        log.info("bandwidth probe: %.2f s of collectives (budget %.1f s)%s", spent, budget_s,
                 f"; budget reached: {cut}" if cut else f"; every size up to {format_size(sizes[-1])}")
    return points


def network_identity() -> str:
    """This rank's host and network path: the host name, its network namespace and the interfaces the
    collectives were told to use. Same host names with another namespace (the emulated cluster of
    scripts/bench/netns_cluster.py, a container network) are other links, so they get their own probe."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    ifaces = ",".join(os.environ.get(k, "") for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"))
    return f"{socket.gethostname()}|{netns}|{ifaces}|{os.environ.get('MASTER_ADDR', '')}"


def cache_key(topo: Topology, hosts: list[str], backend: str, device: torch.device, sizes=PROBE_SIZES,
              budget_s: float = PROBE_BUDGET_S) -> str:
    # "points": the stored convention (per-rank chunk), so caches of the older layout never match
    shape = {"world": topo.world, "ranks_per_node": topo.ranks_per_node, "hosts": sorted(set(hosts)),
             "backend": backend, "device": device.type, "sizes": list(sizes), "budget_s": budget_s,
             "torch": torch.__version__, "points": "chunk"}
    return hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def _to_json(points: dict) -> dict:
    return {f"{k}|{s}": pts for (k, s), pts in points.items()}


def _from_json(d: dict) -> dict:
    return {tuple(key.split("|")): [tuple(p) for p in pts] for key, pts in d.items()}


def probe_points(topo: Topology, rank: int, device: torch.device, cache_dir: pathlib.Path | None = None,
                 use_cache: bool = True, sizes=PROBE_SIZES, budget_s: float = PROBE_BUDGET_S) -> tuple[dict, str]:
    """(measured or cached points {(kind, scope): [(bytes, GB/s)]}, 'probe' | 'cache PATH'). Collective."""
    backend = dist.get_backend()
    hosts = control.all_gather_object(network_identity())
    key = cache_key(topo, hosts, backend, device, sizes, budget_s)
    path = (cache_dir or default_cache_dir()) / f"probe-{key}.json"
    cached = read_shared(path, "points", use_cache, rank, True, "probe")
    if cached is not None:
        points, source = _from_json(cached), f"cache {path}"  # the recheck removes a stale one (cached_probe)
        if rank == 0:
            log.info("bandwidth probe: cached result %s for %d ranks x %d per node", path, topo.world,
                     topo.ranks_per_node)
    else:
        t0 = time.perf_counter()
        points, source = measure(topo, rank, device, sizes, budget_s=budget_s), "probe"
        if rank == 0:
            log.info("bandwidth probe: %d ranks (%d per node, %d node(s)) over %s in %.2f s", topo.world,
                     topo.ranks_per_node, topo.nodes, backend, time.perf_counter() - t0)
            write_atomic(path, {"key": key, "hosts": sorted(set(hosts)), "world": topo.world,
                                "ranks_per_node": topo.ranks_per_node, "backend": backend,
                                "points": _to_json(points)})
    if rank == 0:
        log.info("measured collective bandwidths (bus GB/s by per-rank chunk; inter = per node):\n%s%s",
                 format_points(points), nic_sharing(points))
    return points, source


def cached_probe(source: str) -> str | None:
    """The cache file a cluster's curves were read from (probe_points' source "cache PATH"), else None."""
    if not source.startswith("cache "):
        return None
    path = source[len("cache "):]
    while path.endswith(", refitted"):  # replan.scaled_cluster's mark
        path = path[:-len(", refitted")]
    return path


def merge_curve(preset: BandwidthCurve | None, measured: list) -> BandwidthCurve:
    """The measured points inside their size range; the preset's points outside it, scaled to meet the
    measurement at the nearest measured end (continuous, the preset's shape kept). No preset: the
    measurement alone (clamped flat beyond its ends by BandwidthCurve)."""
    pts = sorted((int(s), float(b)) for s, b in measured)
    if preset is None:
        return BandwidthCurve(tuple(pts))
    lo, hi = pts[0][0], pts[-1][0]
    below = pts[0][1] / preset.gbps(lo)
    above = pts[-1][1] / preset.gbps(hi)
    outside = [(s, b * below) for s, b in preset.points if s < lo] + [(s, b * above) for s, b in preset.points if s > hi]
    return BandwidthCurve(tuple(sorted(outside + pts)))


def apply_points(cluster: ClusterSpec, points: dict, source: str) -> ClusterSpec:
    """The cluster with the measured points merged into its preset curves (merge_curve)."""
    curves = dict(cluster.curves)
    for (kind, scope), pts in points.items():
        if scope in SCOPES:  # SINGLE_GROUP is logged, not priced
            curves[(kind, scope)] = merge_curve(cluster.curves.get((kind, scope)), pts)
    missing = [s for s in SCOPES if not any(sc == s for _, sc in points)]
    if missing:
        log.info("bandwidth probe: nothing to measure %s (%s); the %s figures stay", "/".join(missing),
                 "a single node" if "inter" in missing else "one rank per node", cluster.name)
    return replace(cluster, curves=curves, source=source)


def nic_sharing(points: dict) -> str:
    """'inter all_gather: R groups at once get 0.52x ... of one group alone' per kind, at the largest size."""
    lines = []
    for kind in KINDS:
        one, many = points.get((kind, SINGLE_GROUP)), points.get((kind, "inter"))
        if one and many:
            size = min(one[-1][0], many[-1][0])
            a, b = dict(one).get(size), dict(many).get(size)
            if a and b:
                lines.append(f"  inter {kind}: all groups at once get {b / a:.2f}x the node bandwidth of one "
                             f"group alone at {format_size(size)} chunks")
    return ("\nNIC sharing (per-node bus GB/s, concurrent / alone):\n" + "\n".join(lines)) if lines else ""


def format_points(points: dict) -> str:
    lines = []
    for (kind, scope), pts in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"  {scope:5s} {kind:14s} " + "  ".join(f"{format_size(s)}:{b:.3g}" for s, b in pts))
    return "\n".join(lines)
