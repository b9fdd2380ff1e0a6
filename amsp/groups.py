"""Process groups for a plan: created once, in the same order on every rank, and cached.

dist.new_group is collective over the whole world (every rank must call it for every group, even
the groups it is not in), so the list of groups is derived from the plan and the topology alone
and walked in one deterministic order. torch sorts a group's ranks; ours are ascending anyway, so
a member's group rank is its index in the tuple.

These are data-plane groups: the default group's (device) backend, and the collective timeout the
run was configured with (amsp.control keeps it), so a rank that hangs in a subgroup collective
makes the others fail after the timeout instead of waiting forever.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from . import control
from .plan import Degrees
from .topology import Topology

log = logging.getLogger(__name__)

# ranks tuple -> ProcessGroup; shared by every engine of the process (tests build many) so a
# group is never created twice. All ranks build engines in the same order, so all caches agree.
_CACHE: dict[tuple[int, ...], object] = {}
_CACHE_WORLD: list[int] = []


@dataclass(frozen=True)
class UnitGroups:
    """The five groups one rank uses for a unit with degrees `deg` (rank tuples + handles)."""

    deg: Degrees
    p: tuple[int, ...]
    g: tuple[int, ...]
    g_to_os: tuple[int, ...]
    os_replica: tuple[int, ...]
    spread: tuple[int, ...]

    KINDS = ("p", "g", "g_to_os", "os_replica", "spread")


def group_lists(deg: Degrees, topo: Topology) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every kind for these degrees (all ranks), as in amsp/schedule.py."""
    return {
        "p": topo.shard_groups(deg.p),
        "g": topo.shard_groups(deg.g),
        "g_to_os": topo.strided_within(deg.os, deg.g),
        "os_replica": topo.replica_groups(deg.os),
        "spread": topo.strided_within(deg.os, deg.p),
    }


def ensure_groups(degrees: list[Degrees], topo: Topology | list[Topology]) -> None:
    """Create (collectively, in a fixed order) every group of size > 1 these degrees need.

    With model parallelism pass every data-parallel group's topology (ParallelMesh.dp_topologies()):
    dist.new_group is collective over the whole world, so each rank also creates the groups of the
    DP groups it is not in, in the same order as everybody else."""
    topos = topo if isinstance(topo, list) else [topo]
    world = sum(t.world for t in topos)
    if not dist.is_initialized():
        if world != 1:
            raise RuntimeError(f"a plan over {world} ranks needs torch.distributed initialised")
        return
    if dist.get_world_size() != world:
        raise RuntimeError(f"topology says {world} ranks but the process group has {dist.get_world_size()}")
    ensure_rank_groups([ranks for t in topos for deg in degrees for groups in group_lists(deg, t).values()
                        for ranks in groups])


def ensure_rank_groups(rank_lists: list[tuple[int, ...]]) -> None:
    """Create (collectively: every rank passes the same list) the data-plane groups of these rank tuples
    that do not exist yet, e.g. a mesh's pipeline groups."""
    if not dist.is_initialized():
        return
    if _CACHE_WORLD and _CACHE_WORLD[0] != id(dist.group.WORLD):
        _CACHE.clear()  # a new default process group (tests re-initialise): old groups are dead
    _CACHE_WORLD[:] = [id(dist.group.WORLD)]
    new = [ranks for ranks in rank_lists if len(ranks) > 1 and ranks not in _CACHE]
    if not new:
        return
    timeout = control.collective_timeout()
    for ranks in dict.fromkeys(new):  # first-seen order, the same on every rank
        _CACHE[ranks] = dist.new_group(list(ranks), timeout=timeout)
    log.debug("created %d process groups (backend %s, timeout %s)", len(set(new)), dist.get_backend(), timeout)


def process_group(ranks: tuple[int, ...]):
    if len(ranks) < 2:
        return None
    try:
        return _CACHE[ranks]
    except KeyError:
        raise RuntimeError(f"process group {ranks} was not created by ensure_groups()") from None


def unit_groups(deg: Degrees, topo: Topology, rank: int) -> UnitGroups:
    lists = group_lists(deg, topo)
    return UnitGroups(deg, *(topo.group_of(rank, lists[k]) for k in UnitGroups.KINDS))
