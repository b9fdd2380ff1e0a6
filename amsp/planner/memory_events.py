"""Gradient-bucket events of the memory model, one rule for both planners (cost_model.CostModel and its
ILP and grid, joint/stage_cost.py): what a unit's reduce-scatter holds while in flight on each
backend, the bytes of one event, and gloo's copies in the last micro-batch's G -> OS sync."""
from __future__ import annotations

from amsp.plan import Degrees


def collectives_stage_copies(device: str) -> bool:
    """gloo, the engine's CPU backend, runs a collective in buffers of its own: a reduce-scatter holds a
    copy of its input until the caller's wait, an all-gather a copy of its output at the wait. NCCL
    (CUDA) works in the caller's tensors. Measured on 4 gloo ranks (torch 2.13, a 94 MiB fp32 input,
    glibc returning freed blocks): reduce_scatter_tensor +94 MiB from its launch until its handle is
    released, its output's pages at the wait; all_reduce nothing."""
    return device == "cpu"


def reduce_scatter_inflight_bytes(numel: float, deg: Degrees, grad_bytes: int, param_bytes: int,
                                  staged: bool) -> float:
    """What a unit of `numel` (padded) elements holds beyond its flat gradient bucket while its gradient
    reduce-scatter (g > 1) is in flight beside the next unit filling: the output, its G-shard slice
    (added into the G shard at the wait: amsp.flat_unit finish_grad_reduce), and where collectives
    stage copies (gloo) the input's copy. With p > 1 the unit's gathered weights were freed after its
    backward while the gathered-pair term still counts a pair of units, so the copy adds only what it
    exceeds them by. Traced on 4 gloo ranks (102M parameters, fp32, 1/4/4): the peak is the last block
    filling while the head's reduce-scatter is in flight, +94 MiB of gloo's copy and +24 of output."""
    if deg.g == 1:
        return 0.0
    out = numel / deg.g * grad_bytes
    if not staged:
        return out
    gathered = numel * param_bytes if deg.p > 1 else 0.0
    return out + max(0.0, numel * grad_bytes - gathered)


def event_bytes(roles: tuple[str, ...], filler: str, credit, take, buckets, fills, inflight):
    """Bytes of one gradient-bucket event (CostModel.bucket_events): the held units' buckets, the filling
    unit's gradient in copy and what the in-flight unit's reduce-scatter holds beyond its bucket (the
    roles after the filler), less the credit. `take(role, table)` reads a role's entry of a table: a
    number, a candidate axis (exhaustive.grid) or a solver expression (ilp)."""
    return (sum(take(r, buckets) for r in roles) + take(filler, fills)
            + sum(take(r, inflight) for r in roles[1:]) - credit)


def sync_copy_bytes(numel: float, deg: Degrees, grad_bytes: int, staged: bool) -> float:
    """gloo's copy of a unit's G shard while its G -> OS reduce-scatter (os > g) is in flight in the last
    micro-batch's gradient sync (amsp.flat_unit launch_os_reduce). The engine launches a unit's before it
    waits on the one before it, so the copies of two neighbouring units are held at once: the planners
    add the largest neighbouring pair to the OS-shard gradients of the step phase (an upper bound: when
    the earlier one has finished, one copy is held). Traced on 2 gloo ranks (14M parameters, fp32, 1/1/2):
    one rank peaked at 220 MiB above its start at the wait of the last block's while the embedding's was
    in flight: 165 MiB of states + 27.5 of OS-shard gradients + 12 + 16 for the two copies."""
    if not staged or deg.os <= deg.g:
        return 0.0
    return numel / deg.g * grad_bytes
