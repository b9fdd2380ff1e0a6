"""The one object that owns every parallel group: pipeline (PP), data (DP) and tensor (TP) ranks.

Rank order is AMP's and DeepSpeed's, TP innermost and PP outermost:
    global rank = tp_idx + tp * dp_idx + tp * dp * pp_idx
so a TP group is `tp` consecutive ranks (inside one node: tp must divide the ranks per node, where its
all-reduces and all-gathers run on the fastest links), a DP group is the ranks `tp` apart inside one
pipeline stage, and a PP group is the ranks `tp * dp` apart. The engine, the checkpoint writer, the data
loader and the planner ask this object for groups; nobody else computes rank lists.

A pipeline stage's tp * dp ranks either fit inside one node or fill whole nodes: the AMSP engine's
Topology describes a DP group by one members-per-node figure, and a stage of 1.5 nodes would put
unequal numbers of its DP ranks on its nodes (stage_layout_problem; the joint planner applies the same
rule). Every group the mesh makes carries the run's collective timeout (init_mesh).
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
        problem = stage_layout_problem(self.world, self.ranks_per_node, self.tp, self.pp)
        if problem:
            ok = [pp for pp in range(1, self.world // self.tp + 1) if (self.world // self.tp) % pp == 0
                  and not stage_layout_problem(self.world, self.ranks_per_node, self.tp, pp)]
            raise InputError(f"parallel.pp={self.pp} with parallel.tp={self.tp} on {self.world} ranks: {problem}; "
                             f"use parallel.pp in {ok} (or a world size that makes a stage whole nodes)")

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
        or the whole DP group when it is smaller than that (several stages share the node). Exact for
        every DP group because a stage fits inside a node or fills whole nodes (__post_init__)."""
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
        return init_mesh(device_type, (self.pp, self.dp, self.tp), ("pp", "dp", "tp"))

    def describe(self) -> str:
        return (f"mesh pp={self.pp} x dp={self.dp} x tp={self.tp} over {self.world} ranks "
                f"({self.ranks_per_node} per node; TP innermost, PP outermost)")


def stage_layout_problem(world: int, ranks_per_node: int, tp: int, pp: int) -> str | None:
    """Why pipeline stages of world / pp ranks cannot be laid on nodes of ranks_per_node, or None.

    Stage i holds ranks [i*S, (i+1)*S), S = tp * dp. When S neither divides ranks_per_node nor is a
    multiple of it, some stage straddles a node boundary part-way (S = 3 on nodes of 2: ranks 0-1 on
    node 0, rank 2 on node 1), so its DP group has unequal members per node. The AMSP hierarchy's
    Topology has one members-per-node figure and cannot describe that group; a flat DP group would hide
    which of its collectives cross nodes. Such layouts are refused here and by the joint planner alike.
    Pure arithmetic: the planner imports it without torch."""
    stage = world // pp
    if stage % ranks_per_node == 0 or ranks_per_node % stage == 0:
        return None
    return (f"a pipeline stage of tp x dp = {tp} x {stage // tp} = {stage} ranks neither fits inside a node of "
            f"{ranks_per_node} ranks nor fills whole nodes, so its data-parallel group would have unequal ranks "
            f"per node, which the AMSP hierarchy cannot describe")


def init_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """torch's init_device_mesh with the run's collective timeout (amsp.control.collective_timeout, which
    amsp.launch sets from trainer.collective_timeout_s) on every group it creates. Left alone, torch gives
    the mesh's subgroups its own default (30 min on gloo, 10 min on NCCL): a hung TP or PP peer would
    then be reported long after the default and control groups gave up. Collective."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from amsp import control

    # A dimension spanning the whole world reuses the default group, which already has the timeout;
    # an override would make torch create a second world-sized group (an extra NCCL communicator).
    world = dist.get_world_size()
    dims = [n for n, size in zip(names, shape) if size != world]
    options = _group_options(dist.get_backend(), control.collective_timeout()) if dims else None
    override = {n: options for n in dims} if options is not None else None
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names), backend_override=override)


def _group_options(backend: str, timeout):
    """Backend options carrying `timeout` for the mesh's groups (torch reads the timeout from them), of the
    class the default group's backend takes; None on the pretend world's fake backend, whose collectives
    return at once (no timeout can fire) and which takes only its own options class."""
    import torch.distributed as dist

    if "nccl" in backend:  # "nccl", or "cpu:gloo,cuda:nccl" (gloo's part reads only the timeout)
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # torch's own default for the groups it makes
        options._timeout = timeout
        return options
    if "gloo" in backend:
        return dist.ProcessGroupGloo.Options("gloo", timeout)  # gloo's groups read only the timeout
    if "fake" in backend:
        return None
    raise ValueError(f"cannot give the mesh's process groups the collective timeout on backend {backend!r}: "
                     f"this project runs nccl, gloo or the pretend world's fake backend")
