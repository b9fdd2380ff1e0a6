"""Out of memory while the engine allocates its shards: one line with the planner's numbers.

The planner (amsp/planner) predicts each rank's bytes for a plan against the device memory it
assumes (on CPU: host RAM / local ranks, unless cluster.device_memory_gib says otherwise). When the
real allocation fails anyway (a memory cap, other processes, a wrong cluster figure), the run ends
with FaultError (exit 3) naming the failed allocation, the prediction for the chosen plan (auto or
named: the cost model evaluates either), the memory assumed, and what to change.
"""
from __future__ import annotations

import gc
import re
from typing import Callable, TypeVar

import torch

from amsp.errors import FaultError

T = TypeVar("T")
_GIB = 2**30


def oom_reason(exc: BaseException) -> str | None:
    """A short description if `exc` is an allocation failure, else None."""
    if isinstance(exc, MemoryError):
        return f"MemoryError {exc}".strip()
    text = str(exc)
    m = re.search(r"(\w+Allocator): can't allocate memory: you tried to allocate (\d+) bytes", text)
    if m:
        n = int(m.group(2))
        return f"{m.group(1)} could not allocate " + (f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.1f} MiB")
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if (oom_type is not None and isinstance(exc, oom_type)) or "out of memory" in text.lower():
        first = text.splitlines()[0] if text else type(exc).__name__
        return first[:200]
    return None


def planner_inputs(cfg, denv, device, cluster=None, options=None):
    """(Workload, ClusterSpec, Options) the planner prices this run's plans with; `cluster` and
    `options` are the ones the startup planner used (probe and compute profile applied) when given.
    Under the run's parallel.tp / pp (and pipeline schedule), as the startup planner prices them: the
    raw config's amsp.planner.tp / pp are 1, which priced a pipelined run's recheck as the whole model
    on every rank (predicted 3.06 s and 1.07 GiB for a pp 2 run that the startup had priced 5.01 s)."""
    from amsp.planner.from_config import cluster_spec, options_from_config, with_model_parallel, workload_from_config
    from amsp.planner.startup import kernels_for_run, ranks_per_node

    cfg = with_model_parallel(cfg, what_if=False)
    if cluster is None:
        r = ranks_per_node(cfg, denv.local_world_size)
        cluster = cluster_spec(cfg, nodes=max(1, denv.world_size // r), ranks_per_node=r,
                               local_ranks=denv.local_world_size, device=device)
    workload = workload_from_config(cfg, cluster, kernels_for_run(cfg, device))
    return workload, cluster, options or options_from_config(cfg)


def predicted_cost(cfg, denv, device, plan):
    """The planner's cost (PlanCost) of `plan` for this run's config and world."""
    from amsp.planner.cost_model import CostModel

    return CostModel(*planner_inputs(cfg, denv, device)).evaluate(plan)


def out_of_memory_error(reason: str, cfg, denv, device, plan) -> FaultError:
    where = f"rank {denv.rank} ran out of memory building the model on {device} ({reason})"
    try:
        cost = predicted_cost(cfg, denv, device, plan)
    except Exception as e:  # noqa: BLE001 - the numbers are a help; the failure is still reported
        return FaultError(f"{where}; the planner's prediction is not available ({type(e).__name__}: {e}). Free "
                          f"memory, or shard more (amsp.plan=zero3) or use more ranks")
    parts = ", ".join(f"{k} {v / _GIB:.2f}" for k, v in cost.memory.items() if v >= 0.005 * _GIB)
    return FaultError(
        f"{where}; the planner predicted {cost.memory_total / _GIB:.2f} GiB per rank for plan {plan} ({parts} GiB) "
        f"against {cost.device_memory / _GIB:.2f} GiB of device memory assumed. Less memory is really available "
        f"to this process: free it, set cluster.device_memory_gib to what is available (amsp.plan=auto then picks "
        f"a plan that fits or says none does), shard more (amsp.plan=zero3) or use more ranks")


def build_or_explain_oom(build: Callable[[], T], cfg, denv, device, plan) -> T:
    """build() (the engine's construction); an allocation failure becomes FaultError with the
    planner's numbers. The failed build's partial tensors are released before the numbers are
    computed."""
    reason = None
    try:
        return build()
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        reason = oom_reason(e)
        if reason is None:
            raise
    gc.collect()
    raise out_of_memory_error(reason, cfg, denv, device, plan)
