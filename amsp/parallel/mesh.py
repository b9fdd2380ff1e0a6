"""The one object that owns every parallel group: pipeline (PP), data (DP) and tensor (TP) ranks.

Rank order is AMP's and DeepSpeed's, TP innermost and PP outermost:
    global rank = tp_idx + tp * dp_idx + tp * dp * pp_idx
so a TP group is `tp` consecutive ranks (inside one node: tp must divide the ranks per node, where its
all-reduces and all-gathers run on the fastest links), a DP group is the ranks `tp` apart inside one
pipeline stage, and a PP group is the ranks `tp * dp` apart. The engine, the checkpoint writer, the data
loader and the planner ask this object for groups; nobody else computes rank lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..errors import InputError
from ..topology import Topology


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelMesh:
    world: int
    ranks_per_node: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise InputError(f"parallel.tp={self.tp} and parallel.pp={self.pp} must be >= 1")
        if self.world % (self.tp * self.pp):
            raise InputError(f"world size {self.world} is not divisible by tp*pp = {self.tp}*{self.pp}")
        if self.ranks_per_node % self.tp:
            raise InputError(f"parallel.tp={self.tp} must divide the {self.ranks_per_node} ranks per node: "
                             f"tensor-parallel groups stay inside a node")
        if self.world % self.ranks_per_node:
            raise InputError(f"world size {self.world} is not a multiple of ranks_per_node={self.ranks_per_node}")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def rank_of(self, c: Coords) -> int:
        return c.tp + self.tp * c.dp + self.tp * self.dp * c.pp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        return Coords(rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp)

    # ---- one rank's groups ----
    def tp_ranks(self, rank: int) -> tuple[int, ...]:
        c = self.coords(rank)
        return tuple(self.rank_of(Coords(c.pp, c.dp, t)) for t in range(self.tp))

    def dp_ranks(self, rank: int) -> tuple[int, ...]:
        c = self.coords(rank)
        return tuple(self.rank_of(Coords(c.pp, d, c.tp)) for d in range(self.dp))

    def pp_ranks(self, rank: int) -> tuple[int, ...]:
        c = self.coords(rank)
        return tuple(self.rank_of(Coords(p, c.dp, c.tp)) for p in range(self.pp))

    # ---- every group (all ranks, one deterministic order) ----
    def tp_groups(self) -> list[tuple[int, ...]]:
        return list(dict.fromkeys(self.tp_ranks(r) for r in range(self.world)))

    def dp_groups(self) -> list[tuple[int, ...]]:
        return list(dict.fromkeys(self.dp_ranks(r) for r in range(self.world)))

    def pp_groups(self) -> list[tuple[int, ...]]:
        return list(dict.fromkeys(self.pp_ranks(r) for r in range(self.world)))

    # ---- what the data-parallel layer sees ----
    @property
    def dp_ranks_per_node(self) -> int:
        """Members of one DP group per node: a node holds ranks_per_node / tp DP positions of a stage,
        or the whole DP group when it is smaller than that (several stages share the node)."""
        return min(self.dp, self.ranks_per_node // self.tp)

    def dp_topology(self, rank: int) -> Topology:
        """The AMSP topology of this rank's DP group: its members are global ranks, so the engine's
        groups name real ranks and intra/inter-node accounting uses the real node map."""
        return Topology(self.dp, self.dp_ranks_per_node, members=self.dp_ranks(rank),
                        global_ranks_per_node=self.ranks_per_node)

    def dp_topologies(self) -> list[Topology]:
        """Every DP group's topology (group creation is collective over the whole world)."""
        return [self.dp_topology(g[0]) for g in self.dp_groups()]

    def data_shard(self, rank: int) -> tuple[int, int]:
        """(index, count) of the data shard this rank reads: every rank of a TP group and of a pipeline
        feeds the same samples, so only the DP coordinate picks the shard."""
        return self.coords(rank).dp, self.dp

    def device_mesh(self, device_type: str):
        """torch DeviceMesh with dims ("pp", "dp", "tp") for DTensor (collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))

    def describe(self) -> str:
        return (f"mesh pp={self.pp} x dp={self.dp} x tp={self.tp} over {self.world} ranks "
                f"({self.ranks_per_node} per node; TP innermost, PP outermost)")
