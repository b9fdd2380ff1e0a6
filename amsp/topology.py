"""Who is where: node map and the rank lists of every shard / replica group (pure, no torch.distributed).

Groups are consecutive ranks: the d-degree shard groups are [0..d-1], [d..2d-1], ...; the
replica group of a degree joins the ranks at the same position in every shard group.

With model parallelism the data-parallel group is a subset of the world (amsp.parallel.mesh): then
`members` lists its global ranks, positions 0..world-1 index into it, and every group comes out as
global ranks, so process groups and the intra/inter-node accounting name real ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from amsp.errors import InputError


def checked_ranks_per_node(world: int, ranks_per_node: int) -> int:
    """amsp.ranks_per_node (or the launcher's ranks per machine) as the node size of a world: a value that
    does not divide it is the user's input, refused in one line (Topology's own check is an invariant)."""
    if ranks_per_node < 1 or world % ranks_per_node:
        raise InputError(f"amsp.ranks_per_node={ranks_per_node} does not divide the world size {world} (nodes must "
                         f"hold equal numbers of ranks); set it to a divisor of {world} or leave it unset")
    return ranks_per_node


@dataclass(frozen=True)
class Topology:
    world: int  # ranks in the data-parallel group (the whole world without model parallelism)
    ranks_per_node: int  # of those, per node
    members: tuple[int, ...] | None = None  # their global ranks, ascending (None: 0..world-1)
    global_ranks_per_node: int | None = None  # of all ranks, per node (None: ranks_per_node)

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world % self.ranks_per_node:
            raise ValueError(f"world size {self.world} is not a multiple of ranks_per_node={self.ranks_per_node}")
        if self.members is not None and (len(self.members) != self.world or list(self.members) != sorted(self.members)):
            raise ValueError(f"members {self.members} must be {self.world} ascending global ranks")

    @property
    def is_subset(self) -> bool:
        return self.members is not None and self.members != tuple(range(self.world))

    def global_rank(self, position: int) -> int:
        return position if self.members is None else self.members[position]

    def position(self, rank: int) -> int:
        """Index of a global rank in this group (its rank inside the data-parallel group)."""
        if self.members is None:
            return rank
        return self.members.index(rank)

    def _global(self, positions) -> tuple[int, ...]:
        if self.members is None:
            return tuple(positions)
        return tuple(self.members[i] for i in positions)

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Node of a global rank."""
        return rank // (self.global_ranks_per_node or self.ranks_per_node)

    def crosses_nodes(self, ranks: list[int] | tuple[int, ...]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def shard_groups(self, d: int) -> list[tuple[int, ...]]:
        """The N/d groups of d consecutive ranks."""
        return [self._global(range(s, s + d)) for s in range(0, self.world, d)]

    def replica_groups(self, d: int) -> list[tuple[int, ...]]:
        """The d groups of ranks holding the same shard of a degree-d state (stride d)."""
        return [self._global(range(i, self.world, d)) for i in range(d)]

    def strided_within(self, outer: int, stride: int) -> list[tuple[int, ...]]:
        """Inside each `outer`-rank shard group, the ranks that are `stride` apart (outer/stride each).

        Used for the step between two degrees (e.g. G shard -> OS shard inside the OS group)."""
        groups = []
        for start in range(0, self.world, outer):
            for offset in range(stride):
                groups.append(self._global(range(start + offset, start + outer, stride)))
        return groups

    def group_of(self, rank: int, groups: list[tuple[int, ...]]) -> tuple[int, ...]:
        for g in groups:
            if rank in g:
                return g
        raise KeyError(f"rank {rank} is in none of the groups")
