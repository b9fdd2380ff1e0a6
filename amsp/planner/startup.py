"""The planner at training startup (amsp.plan=auto): probe, solve on rank 0, agree on all ranks.

Runs before any model state is allocated. Every rank takes part in the probe (collectives); rank 0
solves and broadcasts the plan (a control value: amsp.control), so all ranks build the engine with
the same degrees even if their floating-point results were to differ.
"""
from __future__ import annotations

import logging
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from amsp import control
from amsp.plan import Plan
from amsp.topology import Topology

from .from_config import cluster_spec, options_from_config, planner_config, workload_from_config
from .probe import apply_points, probe_points
from .ilp import SolverError
from .report import NoFeasiblePlan
from .solve import plan_cluster

log = logging.getLogger(__name__)


@dataclass
class PlanOutcome:
    plan: Plan
    table: str  # the text printed at startup and saved as RUN_DIR/plan.txt
    columns: list  # for WandbLogger.log_table("planner", columns, rows)
    rows: list


def ranks_per_node(cfg: DictConfig, local_world_size: int) -> int:
    """amsp.ranks_per_node when the config has it (one machine posing as several nodes), else the
    launcher's ranks per machine."""
    from omegaconf import OmegaConf

    r = OmegaConf.select(cfg, "amsp.ranks_per_node")
    return int(r) if r else local_world_size


def plan_for_run(cfg: DictConfig, denv, device: torch.device | str = "cpu",
                 run_dir: pathlib.Path | None = None) -> PlanOutcome:
    """Choose the plan for this run. Collective when the world has several ranks."""
    device = torch.device(device)
    p = planner_config(cfg)
    if p.tp * p.pp != 1:
        raise ValueError(f"amsp.planner.tp={p.tp} / pp={p.pp}: the engine runs data parallelism only, so a "
                         f"training run plans with tp = pp = 1; model-parallel degrees are for "
                         f"`python -m amsp.planner` what-ifs until model parallelism lands")
    r = ranks_per_node(cfg, denv.local_world_size)
    topo = Topology(denv.world_size, r)
    points = None
    if p.probe and denv.world_size > 1 and dist.is_initialized():
        points = probe_points(topo, denv.rank, device, pathlib.Path(p.cache_dir) if p.cache_dir else None,
                              p.probe_cache)
    box: list = [None]
    error = None
    if denv.rank == 0:  # only rank 0 measures the CPU peak (if needed) and solves
        try:
            cluster = cluster_spec(cfg, nodes=topo.nodes, ranks_per_node=r, local_ranks=denv.local_world_size,
                                   device=device)
            if points is not None:
                cluster = apply_points(cluster, *points)
            else:
                why = "amsp.planner.probe=false" if not p.probe else "a single process has nothing to measure"
                log.info("planner: no bandwidth probe (%s); using the %s cluster figures", why, cluster.name)
            box[0] = _solve(cfg, cluster, p, run_dir)
        except (NoFeasiblePlan, ValueError, SolverError) as e:  # tell the other ranks, then raise here
            error, box[0] = e, f"{type(e).__name__}: {e}"
    if denv.world_size > 1 and dist.is_initialized():
        box[0] = control.broadcast_object(box[0], src=0)
    if error is not None:
        raise error
    if isinstance(box[0], str):
        raise RuntimeError(f"the planner failed on rank 0: {box[0]}")
    return box[0]


def _solve(cfg, cluster, p, run_dir) -> PlanOutcome:
    t0 = time.perf_counter()
    w = workload_from_config(cfg, cluster)
    res = plan_cluster(w, cluster, options_from_config(cfg), top_k=p.top_k, time_limit_s=p.time_limit_s)
    columns, rows = res.wandb_table()
    text = cluster.describe() + "\n" + res.table()
    log.info("planner (%.2f s):\n%s", time.perf_counter() - t0, text)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.txt").write_text(text + "\n")
    return PlanOutcome(res.plan, text, columns, rows)
