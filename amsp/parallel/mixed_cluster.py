"""A mixed cluster at training startup: parallel.cluster_file names the node groups parallel.auto plans on.

The file (configs/clusters_mixed/*.yaml, amsp/planner/joint/hetero.py) lists its node groups in the
order the launcher numbers the nodes: group 0's nodes hold ranks [0, n0 * R), the next group the ranks
after. The mesh puts pipeline stage i on the ranks after stage i-1's (amsp/parallel/mesh.py), so a stage
runs on the kind of node the planner priced it on only when the hosts were launched in the file's order.
Startup checks what it can see: the file's nodes times the launch's ranks per node against the world
size, and on GPUs each rank's device against its group's preset; a launch that contradicts the file is
refused before anything is measured.

Each group's preset is resolved as `cluster=<preset>` resolves it for a run on this machine (the cpu
preset's measured figures; on CUDA the smallest device memory among the group's ranks). What makes the
groups different in the plan is what each group measures at startup (amsp/parallel/joint_startup.py):
its own compute profile and tensor-parallel unit times, the median over its own ranks.
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib

from omegaconf import DictConfig, OmegaConf

from amsp import control
from amsp.errors import InputError

log = logging.getLogger(__name__)


def devices_of_ranks(device) -> list[tuple]:
    """(CUDA device name, its memory in bytes) of every rank, (None, None) on CPU. Collective."""
    import torch

    if torch.device(device).type != "cuda":
        return control.all_gather_object((None, None))
    return control.all_gather_object((torch.cuda.get_device_name(device),
                                      torch.cuda.get_device_properties(device).total_memory))


def mixed_cluster_for_run(cfg: DictConfig, world: int, local_world: int, device, ranks_per_node: int,
                          devices: list[tuple]):
    """The HeteroCluster of parallel.cluster_file with every group's preset resolved for this run, after
    checking it against the launch (devices: devices_of_ranks). Rank 0's work; InputError on a mismatch."""
    from amsp.planner.device_preset import load_preset, preset_for_device
    from amsp.planner.from_config import cluster_spec
    from amsp.planner.joint.hetero import load_hetero

    def resolve(preset: str, nodes: int):
        c = OmegaConf.merge(cfg, {"cluster": load_preset(preset)})
        return cluster_spec(c, nodes=nodes, ranks_per_node=ranks_per_node, local_ranks=local_world, device=device)

    path = cfg.parallel.cluster_file
    cluster = load_hetero(path, resolve=resolve)
    problems = launch_problems(cluster, world, [d[0] for d in devices], preset_for_device)
    if problems:
        raise InputError(f"parallel.cluster_file={path} does not describe this launch: " + "; ".join(problems))
    if devices[0][1] is not None:  # a group's memory: the smallest device among its ranks (an A100 may be 40 GB)
        memory: dict = {}
        for name, (_, total) in zip(cluster.group_names_by_rank(), devices, strict=True):
            memory[name] = min(memory.get(name, total), total)
        cluster = dataclasses.replace(cluster, groups=tuple(
            dataclasses.replace(g, spec=dataclasses.replace(g.spec, device_memory_bytes=memory[g.name]))
            for g in cluster.groups))
    log.info("parallel.cluster_file: %s (rank order: %s)", cluster.describe(),
             ", ".join(f"{g.name} nodes {sum(x.nodes for x in cluster.groups[:i])}-"
                       f"{sum(x.nodes for x in cluster.groups[:i + 1]) - 1}" for i, g in enumerate(cluster.groups)))
    return cluster


def _kind(g) -> str:
    """The preset a node group's GPUs should match: its preset's name, or for a single node type's own file
    (its preset is that file's path, hetero.read_cluster_file) the cluster name the file gives."""
    from amsp.planner.device_preset import preset_path

    preset = g.preset or g.name
    return g.name if preset_path(preset) == pathlib.Path(preset) else preset


def launch_problems(cluster, world: int, device_names: list, preset_for_device) -> list[str]:
    """What about this launch contradicts the cluster file (its groups shaped with the launch's ranks per
    node): its size, or a rank whose GPU is of another kind than its group's preset (device_names[r]: None
    on CPU, where nothing tells the kinds apart)."""
    r = cluster.ranks_per_node
    if cluster.world != world:
        return [f"its {sum(g.nodes for g in cluster.groups)} nodes of {r} ranks are {cluster.world} ranks, the "
                f"launch has {world} (ranks per node: amsp.ranks_per_node, else the launcher's per machine)"]
    wrong = []
    for rank, (group, name) in enumerate(zip(cluster.group_names_by_rank(), device_names, strict=True)):
        g = next(x for x in cluster.groups if x.name == group)
        seen = preset_for_device(name) if name else None
        kind = _kind(g)
        if seen is not None and seen != kind:
            wrong.append(f"rank {rank} (node {rank // r}) runs on {name} ({seen}) but the file puts "
                         f"it in group {group} ({kind})")
    if wrong:
        return [", ".join(wrong[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else "") +
                ": launch the hosts in the file's group order"]
    return []
