"""The analytic collective schedule of one training step under a plan.

This is the contract between the engine and the planner: the engine's communication accounting
must equal `step_collectives(...)` exactly (tests compare them), and the planner's cost model
prices exactly these collectives. Byte counts are per rank per call: all_gather counts its output
(the gathered tensor), reduce_scatter its input, all_reduce its tensor.

Per unit with padded size S (numel rounded up to a multiple of os), degrees p | g | os, N ranks and
M micro-batches (DESIGN.md §2):
  forward      all_gather   P group (p)                     S   elems   x M   if p > 1
  backward     all_gather   P group (p)                     S   elems   x M   if p > 1
  grad         reduce_scatter G group (g)                   S   elems   x M   if g > 1
  grad_to_os   reduce_scatter stride-g ranks in OS group    S/g elems   x 1   if os > g
  grad_replica all_reduce   OS replicas (stride os)         S/os elems  x 1   if N > os
  spread       all_gather   stride-p ranks in OS group      S/p elems   x 1   if os > p
and once per step an all_reduce of one fp32 over the world for the global gradient norm.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .plan import Degrees
from .topology import Topology


@dataclass(frozen=True)
class Precision:
    param_bytes: int = 4  # compute weights: what the P all-gathers and the spread move
    grad_bytes: int = 4  # gradient communication dtype (accumulation is always fp32)

    @property
    def master_is_weights(self) -> bool:
        """fp32 compute weights are the fp32 master: the master is the rank's OS chunk of its own P shard
        (the nesting puts the OS shard inside the P shard) and the optimizer updates it in place."""
        return self.param_bytes == 4

    @property
    def optim_bytes(self) -> int:
        """Optimizer-state bytes per element held in the OS shard: exp_avg and exp_avg_sq, plus a
        separate fp32 master unless the weights are the master (so fp32 DDP holds 16 bytes per
        parameter, like torch DDP + AdamW, not 20)."""
        return 8 if self.master_is_weights else 12

    @classmethod
    def named(cls, name: str) -> "Precision":
        table = {"fp32": cls(4, 4), "bf16": cls(2, 2)}
        if name not in table:
            raise ValueError(f"unknown precision {name!r}; expected fp32 or bf16")
        return table[name]


@dataclass(frozen=True)
class Unit:
    name: str
    group: str  # "blocks" or "embed_head"
    numel: int


@dataclass(frozen=True)
class Collective:
    phase: str  # forward | backward | grad | grad_to_os | grad_replica | spread | grad_norm
    kind: str  # all_gather | reduce_scatter | all_reduce
    unit: str
    group_size: int
    crosses_nodes: bool
    bytes: int  # per call, per rank
    count: int  # calls per step

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


def padded_numel(numel: int, deg: Degrees) -> int:
    return -(-numel // deg.os) * deg.os


def group_shapes(deg: Degrees, topo: Topology) -> dict[str, tuple[int, bool]]:
    """(size, crosses_nodes) of each group a unit with these degrees uses, seen from rank 0."""
    def shape(groups):
        g0 = groups[0]
        return len(g0), topo.crosses_nodes(g0)

    return {
        "p": shape(topo.shard_groups(deg.p)),
        "g": shape(topo.shard_groups(deg.g)),
        "g_to_os": shape(topo.strided_within(deg.os, deg.g)),
        "os_replica": shape(topo.replica_groups(deg.os)),
        "spread": shape(topo.strided_within(deg.os, deg.p)),
    }


def unit_collectives(unit: Unit, deg: Degrees, topo: Topology, micro_batches: int,
                     precision: Precision) -> list[Collective]:
    s = padded_numel(unit.numel, deg)
    shapes = group_shapes(deg, topo)
    pb, gb = precision.param_bytes, precision.grad_bytes
    out = []

    def add(phase, kind, key, elems, elem_bytes, count):
        size, crosses = shapes[key]
        if size > 1:
            out.append(Collective(phase, kind, unit.name, size, crosses, elems * elem_bytes, count))

    add("forward", "all_gather", "p", s, pb, micro_batches)
    add("backward", "all_gather", "p", s, pb, micro_batches)
    add("grad", "reduce_scatter", "g", s, gb, micro_batches)
    add("grad_to_os", "reduce_scatter", "g_to_os", s // deg.g, gb, 1)
    add("grad_replica", "all_reduce", "os_replica", s // deg.os, gb, 1)
    add("spread", "all_gather", "spread", s // deg.p, pb, 1)
    return out


def step_collectives(units: list[Unit], degrees_of: dict[str, Degrees], topo: Topology, micro_batches: int,
                     precision: Precision) -> list[Collective]:
    """Every collective one rank runs in one optimizer step, for units with per-group degrees."""
    out: list[Collective] = []
    for u in units:
        out += unit_collectives(u, degrees_of[u.group], topo, micro_batches, precision)
    if topo.world > 1:
        out.append(Collective("grad_norm", "all_reduce", "*", topo.world, topo.nodes > 1, 4, 1))
    return out


def totals(collectives: list[Collective]) -> Counter:
    """Bytes per (kind, group_size, 'inter'|'intra'): the shape the engine's accounting reports."""
    c: Counter = Counter()
    for x in collectives:
        c[(x.kind, x.group_size, "inter" if x.crosses_nodes else "intra")] += x.total_bytes
    return c
