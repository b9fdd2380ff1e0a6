"""The control plane: small CPU values every rank must agree on (signals, losses, norms, flags, objects).

The data plane (weights, gradients) runs on the device's backend, and NCCL refuses CPU tensors, so a
control value sent to the default group of a CUDA run fails on the first step. Control values
travel on a CPU group of their own (gloo; "cpu:fake" in a pretend world), created once right after
init with the configured collective timeout. It is separate from the default group on CPU runs too,
where both would be gloo: then the routing checker (amsp/routing_check.py) can tell a control value
that strayed onto the data plane from a legitimate one on any machine, not only where NCCL fails.

The functions take and return Python values (CPU tensors inside) and are collective over all ranks;
without torch.distributed (a single process) they return the local value.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class ControlPlane:
    group: Any  # the ProcessGroup that carries control values
    backend: str
    timeout: timedelta
    world_id: int  # id(dist.group.WORLD) at setup: a re-initialised world leaves this plane stale
    cpu_groups: list = field(default_factory=list)  # every CPU group made here (control + extra)

    @property
    def pretend(self) -> bool:
        # the fake backend returns at once and moves no data (amsp.launch's pretend world)
        return "fake" in self.backend


_PLANE: list[ControlPlane] = []  # at most one: the plane of the current world


def setup(timeout: timedelta, backend: str = "gloo") -> ControlPlane:
    """Create the control group (collective: every rank calls it once, right after init)."""
    if not dist.is_initialized():
        raise RuntimeError("amsp.control.setup() needs torch.distributed initialised first")
    group = dist.new_group(backend=backend, timeout=timeout)
    _PLANE[:] = [ControlPlane(group, backend, timeout, id(dist.group.WORLD), [group])]
    return _PLANE[0]


def _plane() -> ControlPlane | None:
    """The current world's plane; None without torch.distributed (a single process)."""
    if not dist.is_initialized():
        return None
    if not _PLANE or _PLANE[0].world_id != id(dist.group.WORLD):
        raise RuntimeError("the control plane is not set up for this process group: call "
                           "amsp.control.setup(timeout) right after init_process_group "
                           "(amsp.launch.init_distributed does)")
    return _PLANE[0]


def group():
    """The control group, or None in a single process."""
    plane = _plane()
    return plane.group if plane is not None else None


def collective_timeout() -> timedelta:
    """The timeout every group of this run gets (the one the control plane was set up with)."""
    plane = _plane()
    if plane is None:
        raise RuntimeError("no collective timeout without torch.distributed")
    return plane.timeout


def is_cpu_group(pg) -> bool:
    """True for a group made here (the control group or new_cpu_group's); pg None means WORLD."""
    if pg is None or not _PLANE or _PLANE[0].world_id != id(dist.group.WORLD):
        return False
    return any(pg is g for g in _PLANE[0].cpu_groups)


def pretend_world() -> bool:
    """True in amsp.launch's pretend world (fake backend: collectives move no data)."""
    return bool(_PLANE) and dist.is_initialized() and _PLANE[0].world_id == id(dist.group.WORLD) \
        and _PLANE[0].pretend


def new_cpu_group():
    """Another CPU group on the control backend with the timeout, for collectives a background
    thread runs (an asynchronous checkpoint save) so they never interleave with the main thread's.
    Collective over the world, like dist.new_group."""
    plane = _plane()
    if plane is None:
        return None
    g = dist.new_group(backend=plane.backend, timeout=plane.timeout)
    plane.cpu_groups.append(g)
    return g


def _all_reduce(values: list, dtype: torch.dtype, op) -> list:
    plane = _plane()
    if plane is None:
        return list(values)
    t = torch.tensor(values, dtype=dtype)
    dist.all_reduce(t, op=op, group=plane.group)
    return t.tolist()


def all_reduce_max_int(value: int) -> int:
    return int(_all_reduce([int(value)], torch.int64, dist.ReduceOp.MAX)[0])


def all_reduce_sum_floats(values: list[float]) -> list[float]:
    return [float(v) for v in _all_reduce([float(v) for v in values], torch.float64, dist.ReduceOp.SUM)]


def all_reduce_max_floats(values: list[float]) -> list[float]:
    return [float(v) for v in _all_reduce([float(v) for v in values], torch.float64, dist.ReduceOp.MAX)]


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """[rank][i] = values[i] on that rank (every rank passes the same number of values)."""
    plane = _plane()
    if plane is None:
        return [[float(v) for v in values]]
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine, group=plane.group)
    return [t.tolist() for t in out]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's obj on every rank (pickled; keep it small)."""
    plane = _plane()
    if plane is None:
        return obj
    if plane.pretend and dist.get_rank() != src:
        raise RuntimeError(f"pretend world: rank {dist.get_rank()} cannot receive rank {src}'s object, the fake "
                           f"backend moves no data; pretend to be rank {src} (AMSP_PRETEND_RANK={src})")
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=plane.group)
    return box[0]


def decided_by_rank0(decide, rank: int) -> Any:
    """decide() run on rank 0 only, its result on every rank; an input error (amsp.errors.RunError) or a
    ValueError / RuntimeError it raises is raised on every rank alike: a bad input stops the whole world
    with its own message, where rank 0 alone raising left the others to die on a closed connection."""
    from amsp.errors import RunError

    box = None
    if rank == 0:
        try:
            box = decide()
        except (RunError, ValueError, RuntimeError) as e:
            box = e
    box = broadcast_object(box, src=0)
    if isinstance(box, BaseException):
        raise box
    return box


def all_gather_object(obj: Any) -> list:
    """[rank] = that rank's obj (pickled; keep it small)."""
    plane = _plane()
    if plane is None:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=plane.group)
    return out


def barrier() -> None:
    plane = _plane()
    if plane is not None:
        dist.barrier(group=plane.group)
