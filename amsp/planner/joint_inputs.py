"""What the joint planner prices compute with, from compute profiles: the same reading at train.py's
startup (amsp/parallel/joint_startup.py, profiles measured on the run's ranks) and in the CLI
(`python -m amsp.planner --joint --compute-profile FILE`, profiles given as a file). Torch-free.

Per node group: the tp 1 units (block forward + backward, head, embedding) at each micro-batch size
measured, the block forward's fraction of the group's peak (the efficiency FLOP-priced parts use),
the AdamW rate and the overlap slowdown when measured. A group without a profile is priced at
amsp.planner.mfu of its peak.
"""
from __future__ import annotations

import dataclasses

from .update_cost import scaled_rate
from .workload import Workload


@dataclasses.dataclass
class JointCompute:
    cluster: object  # HeteroCluster, each group's spec carrying its measured overlap slowdown
    efficiency: dict  # group -> fraction of peak
    unit_times: dict  # (group, tp, micro-batch) -> (block, head, embedding) seconds
    optimizer_s_per_elem: dict  # group -> AdamW seconds per element of the run's kernel, fp32 masters
    sources: list  # what each group's compute came from, for the report


def joint_compute(cluster, profiles: dict, tp_times: dict, model, seq_len: int, micro_batch: int, precision,
                  mfu: float, overlap_override: float | None, optimizer_kernel: str = "auto") -> JointCompute:
    """profiles: {(group or None, micro-batch): ComputeProfile} (None: every group); tp_times:
    {(group or None, tp, micro-batch): (block, head, embedding) s} of the TP units (tp > 1).
    optimizer_kernel: the run's amsp.optimizer_kernel; a rate timed with another kernel is scaled to it by
    the bytes each moves (update_cost.scaled_rate)."""
    eff, units, optimizer, sources, groups = {}, {}, {}, [], []
    for g in cluster.groups:
        mine = {m: v for (grp, m), v in profiles.items() if grp in (g.name, None)}
        for m, v in mine.items():  # tp 1: the profile's own units
            units[(g.name, 1, m)] = (v.block_forward_s + v.block_backward_s, v.head_forward_backward_s, v.embedding_s)
        prof = mine.get(micro_batch)
        spec = g.spec
        if prof is not None:  # the measured block forward against its FLOPs at this kind of node's peak
            w = Workload(model, seq_len, micro_batch, 1, precision)
            eff[g.name] = min(1.0, w.block_forward_flops() / (prof.block_forward_s * spec.peak_flops))
            if prof.optimizer_s_per_elem is not None:  # the weight write is the stage pricer's
                optimizer[g.name] = scaled_rate(optimizer_kernel, prof.optimizer_s_per_elem, prof.optimizer_kernel)
            if prof.overlap_slowdown is not None and overlap_override is None:
                spec = dataclasses.replace(spec, overlap_slowdown=prof.overlap_slowdown)
            sources.append(f"{'' if len(cluster.groups) == 1 else g.name + ': '}{prof.source}: one block's "
                           f"forward at {eff[g.name]:.0%} of the peak")
        else:
            eff[g.name] = float(mfu)
        units.update({(g.name, tp, m): v for (grp, tp, m), v in tp_times.items() if grp in (g.name, None)})
        groups.append(dataclasses.replace(g, spec=spec))
    if not profiles:
        sources.append(f"amsp.planner.mfu={mfu}")
    return JointCompute(dataclasses.replace(cluster, groups=tuple(groups)), eff, units, optimizer, sources)
