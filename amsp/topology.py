"""Who is where: node map and the rank lists of every shard / replica group (pure, no torch.distributed).

Groups are consecutive global ranks: the d-degree shard groups are [0..d-1], [d..2d-1], ...; the
replica group of a degree joins the ranks at the same position in every shard group.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    world: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world % self.ranks_per_node:
            raise ValueError(f"world size {self.world} is not a multiple of ranks_per_node={self.ranks_per_node}")

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def crosses_nodes(self, ranks: list[int] | tuple[int, ...]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def shard_groups(self, d: int) -> list[tuple[int, ...]]:
        """The N/d groups of d consecutive ranks."""
        return [tuple(range(s, s + d)) for s in range(0, self.world, d)]

    def replica_groups(self, d: int) -> list[tuple[int, ...]]:
        """The d groups of ranks holding the same shard of a degree-d state (stride d)."""
        return [tuple(range(i, self.world, d)) for i in range(d)]

    def strided_within(self, outer: int, stride: int) -> list[tuple[int, ...]]:
        """Inside each `outer`-rank shard group, the ranks that are `stride` apart (outer/stride each).

        Used for the step between two degrees (e.g. G shard -> OS shard inside the OS group)."""
        groups = []
        for start in range(0, self.world, outer):
            for offset in range(stride):
                groups.append(tuple(range(start + offset, start + outer, stride)))
        return groups

    def group_of(self, rank: int, groups: list[tuple[int, ...]]) -> tuple[int, ...]:
        for g in groups:
            if rank in g:
                return g
        raise KeyError(f"rank {rank} is in none of the groups")
