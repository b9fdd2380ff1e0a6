"""Sharding plans: one shard degree each for parameters (P), gradients (G) and optimizer states (OS).

A degree d over N data-parallel ranks with R ranks per node means: the state is split into d
shards held by a group of d consecutive ranks, and replicated N/d times. Rules (DESIGN.md §2):
  * nesting: p divides g divides os (so the P group sits inside the G group inside the OS group,
    and a rank's OS shard lies inside its G shard inside its P shard);
  * every degree divides N;
  * fill-a-node: d <= R must divide R (d consecutive ranks of one node); d > R must be a multiple
    of R (d/R whole nodes).
Presets are points of this space: ddp 1/1/1, zero1 1/1/N, zero2 1/N/N, zero3 N/N/N, hsdp R/R/R.
This module is pure (no torch.distributed): the planner and the engine both build on it.
"""
from __future__ import annotations

from dataclasses import dataclass

PRESET_NAMES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
UNIT_GROUPS = ("blocks", "embed_head")  # a plan may give these two groups different degrees


class PlanError(ValueError):
    """A plan that breaks a sharding rule; the message names the rule and the valid choices."""


@dataclass(frozen=True)
class Degrees:
    p: int
    g: int
    os: int

    def __str__(self) -> str:
        return f"{self.p}/{self.g}/{self.os}"


@dataclass(frozen=True)
class ShardShape:
    """How a degree maps onto the cluster: `ranks_in_node` ranks on each of `nodes` nodes."""

    ranks_in_node: int
    nodes: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


@dataclass(frozen=True)
class Plan:
    blocks: Degrees
    embed_head: Degrees
    name: str = "custom"

    def for_group(self, group: str) -> Degrees:
        if group not in UNIT_GROUPS:
            raise KeyError(f"unknown unit group {group!r}; expected one of {UNIT_GROUPS}")
        return getattr(self, group)

    def __str__(self) -> str:
        if self.blocks == self.embed_head:
            return f"{self.name} (p/g/os = {self.blocks})"
        return f"{self.name} (blocks p/g/os = {self.blocks}, embedding+head = {self.embed_head})"


def shard_shape(d: int, ranks_per_node: int) -> ShardShape:
    if d <= ranks_per_node:
        return ShardShape(d, 1)
    return ShardShape(ranks_per_node, d // ranks_per_node)


def valid_degree(d: int, world: int, ranks_per_node: int) -> bool:
    if d < 1 or world % d:
        return False
    if d <= ranks_per_node:
        return ranks_per_node % d == 0
    return d % ranks_per_node == 0


def valid_degrees(world: int, ranks_per_node: int) -> list[int]:
    return [d for d in range(1, world + 1) if valid_degree(d, world, ranks_per_node)]


def check_topology(world: int, ranks_per_node: int) -> None:
    if ranks_per_node < 1 or world % ranks_per_node:
        raise PlanError(f"world size {world} is not a whole number of nodes of {ranks_per_node} ranks "
                        f"(amsp.ranks_per_node must divide the world size)")


def enumerate_degrees(world: int, ranks_per_node: int) -> list[Degrees]:
    """Every valid (p, g, os) for this cluster shape, smallest degrees first."""
    ds = valid_degrees(world, ranks_per_node)
    return [Degrees(p, g, o) for p in ds for g in ds for o in ds if g % p == 0 and o % g == 0]


def validate_degrees(deg: Degrees, world: int, ranks_per_node: int, what: str = "plan") -> Degrees:
    check_topology(world, ranks_per_node)
    ds = valid_degrees(world, ranks_per_node)
    for name in ("p", "g", "os"):
        d = getattr(deg, name)
        if d < 1 or world % d:
            raise PlanError(f"{what}: {name}={d} breaks the divisibility rule (every degree divides the "
                            f"world size {world}); valid degrees here: {ds}")
        if not valid_degree(d, world, ranks_per_node):
            rule = (f"a degree <= {ranks_per_node} ranks per node must divide {ranks_per_node}" if d <= ranks_per_node
                    else f"a degree > {ranks_per_node} ranks per node must be a multiple of it (whole nodes)")
            raise PlanError(f"{what}: {name}={d} breaks the fill-a-node rule ({rule}); valid degrees here: {ds}")
    if not (deg.p <= deg.g <= deg.os):
        raise PlanError(f"{what}: p/g/os = {deg} breaks the ordering rule p <= g <= os; valid plans include "
                        f"{_examples(world, ranks_per_node)}")
    if deg.g % deg.p or deg.os % deg.g:
        raise PlanError(f"{what}: p/g/os = {deg} breaks the nesting rule (p divides g divides os, so each "
                        f"group sits inside the next); valid plans include {_examples(world, ranks_per_node)}")
    return deg


def _examples(world: int, ranks_per_node: int, limit: int = 12) -> str:
    all_ = enumerate_degrees(world, ranks_per_node)
    shown = ", ".join(str(d) for d in all_[:limit])
    return shown + (f", … ({len(all_)} in all)" if len(all_) > limit else "")


def preset_degrees(name: str, world: int, ranks_per_node: int) -> Degrees:
    n, r = world, min(ranks_per_node, world)
    table = {"ddp": Degrees(1, 1, 1), "zero1": Degrees(1, 1, n), "zero2": Degrees(1, n, n),
             "zero3": Degrees(n, n, n), "hsdp": Degrees(r, r, r)}
    if name not in table:
        raise PlanError(f"unknown plan preset {name!r}; expected one of {', '.join(PRESET_NAMES)}, "
                        f"'auto', or explicit degrees (amsp.p / amsp.g / amsp.os)")
    return validate_degrees(table[name], world, ranks_per_node, what=f"preset {name}")


def make_plan(name: str, world: int, ranks_per_node: int, blocks: Degrees | None = None,
              embed_head: Degrees | None = None) -> Plan:
    """A preset by name, or explicit degrees (name 'custom'); embed_head defaults to the blocks'."""
    if blocks is None:
        blocks = preset_degrees(name, world, ranks_per_node)
    validate_degrees(blocks, world, ranks_per_node, what=f"{name} blocks")
    embed_head = blocks if embed_head is None else validate_degrees(
        embed_head, world, ranks_per_node, what=f"{name} embedding+head")
    return Plan(blocks=blocks, embed_head=embed_head, name=name)


def _explicit(triple: tuple, what: str) -> Degrees | None:
    given = [v is not None for v in triple]
    if not any(given):
        return None
    if not all(given):
        names = [n for n, v in zip(("p", "g", "os"), triple) if v is None]
        raise PlanError(f"{what}: explicit degrees need p, g and os together; missing {', '.join(names)}")
    return Degrees(*(int(v) for v in triple))


# The amsp.plan values explicit block degrees may come with: neither names degrees of its own.
EXPLICIT_DEGREES_WITH = ("custom", "auto")


def plan_from_settings(name: str, world: int, ranks_per_node: int, blocks: tuple = (None, None, None),
                       embed_head: tuple = (None, None, None)) -> Plan:
    """The plan a user asked for: a preset name, or explicit (p, g, os) degrees for the blocks
    (name becomes 'custom'), optionally different (p, g, os) for the embedding + head. Block degrees
    go with amsp.plan=custom or auto (the default, so `amsp.p=.. amsp.g=.. amsp.os=..` alone works); with a
    preset name they are an error (which did the user mean?), as is 'custom' without degrees."""
    b = _explicit(blocks, "amsp.p/g/os")
    e = _explicit(embed_head, "amsp.embed_head_p/g/os")
    if b is None and name == "custom":
        raise PlanError("amsp.plan=custom needs explicit degrees amsp.p, amsp.g and amsp.os")
    if b is not None and name not in EXPLICIT_DEGREES_WITH:
        raise PlanError(f"amsp.plan={name} and explicit degrees amsp.p/g/os={b} are ambiguous: drop the degrees "
                        f"to run the preset, or drop amsp.plan (or set amsp.plan=custom) to run the degrees")
    return make_plan("custom" if b is not None else name, world, ranks_per_node, blocks=b, embed_head=e)
