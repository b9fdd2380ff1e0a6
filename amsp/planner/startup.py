"""The planner at training startup (amsp.plan=auto): probe the collectives, time the compute
(compute_profile.py; amsp.planner.measure_compute), solve on rank 0, agree on all ranks. On a GPU
with no cluster named the device's preset is used (from_config.cluster_spec -> device_preset.py).

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
from omegaconf import DictConfig, OmegaConf

from amsp import control
from amsp.errors import InputError
from amsp.plan import Plan, PlanError
from amsp.topology import Topology, checked_ranks_per_node

from .from_config import (cluster_spec, cpu_shared_cores, machine_ranks, options_from_config, planner_config,
                          with_model_parallel, workload_from_config)
from .compute_profile import ComputeProfile, measure_profile
from .allocator import describe_margin
from . import exhaustive
from .cost_model import CostModel, overlap_slowdown_of
from .probe import apply_points, probe_points, probe_sizes
from .ilp import SolverError
from .terms import GroupTerms
from .workload import Kernels
from .report import NoFeasiblePlan
from .solve import plan_cluster

log = logging.getLogger(__name__)


@dataclass
class PlanOutcome:
    plan: Plan
    table: str  # the text printed at startup and saved as RUN_DIR/plan.txt
    columns: list  # for WandbLogger.log_table("planner", columns, rows)
    rows: list
    # the inputs the choice was priced with (probe applied): the recheck (amsp/replan_switch.py) refits them
    cluster: object = None
    options: object = None


def ranks_per_node(cfg: DictConfig, local_world_size: int) -> int:
    """amsp.ranks_per_node when the config has it (one machine posing as several nodes), else the
    launcher's ranks per machine."""
    r = OmegaConf.select(cfg, "amsp.ranks_per_node")
    return int(r) if r else local_world_size


def plan_for_run(cfg: DictConfig, denv, device: torch.device | str = "cpu",
                 run_dir: pathlib.Path | None = None) -> PlanOutcome:
    """Choose the plan for this run. Collective when the world has several ranks."""
    device = torch.device(device)
    cfg = with_model_parallel(cfg, what_if=False)  # the AMSP plan is for each rank's DP group under these
    p = planner_config(cfg)
    r = checked_ranks_per_node(denv.world_size, ranks_per_node(cfg, denv.local_world_size))
    topo = Topology(denv.world_size, r)
    points = probe_for_run(cfg, denv, device)
    cluster = None
    if p.measure_compute:  # a plan that cannot fit is said before the compute is timed (which takes minutes)
        cluster = _on_rank0(denv, lambda: fitting_cluster(cfg, topo, r, denv, device, points, p))
    profile = measured_compute(cfg, denv, device) if p.measure_compute else None

    def solve():  # only rank 0 measures the CPU peak (if needed) and solves
        spec = cluster or with_probe(cluster_spec(cfg, nodes=topo.nodes, ranks_per_node=r,
                                                  local_ranks=denv.local_world_size, device=device), points, p)
        return _solve(cfg, spec, p, run_dir, profile, kernels_for_run(cfg, device))

    return _on_rank0(denv, solve)


def _on_rank0(denv, fn):
    """fn() on rank 0, its result on every rank (broadcast); its error raised on rank 0 and, as the
    RuntimeError naming it, on the others. A ValueError is the planner refusing its input (a workload or
    cluster the config describes): an InputError on every rank, one line and exit status 2, not a traceback.
    Collective when the world has several ranks."""
    box: list = [None]
    error = None
    if denv.rank == 0:
        try:
            box[0] = fn()
        except (ValueError, InputError) as e:  # tell the other ranks, then raise here; PlanError stays itself
            error = e if isinstance(e, (InputError, PlanError)) else InputError(f"planner: {e}")
            box[0] = _InputFailure(str(error))
        except (NoFeasiblePlan, SolverError) as e:  # tell the other ranks, then raise here
            error, box[0] = e, f"{type(e).__name__}: {e}"
    if denv.world_size > 1 and dist.is_initialized():
        box[0] = control.broadcast_object(box[0], src=0)
    if error is not None:
        raise error
    if isinstance(box[0], _InputFailure):  # the same input error rank 0 raises, so every rank exits 2
        raise InputError(box[0].message)
    if isinstance(box[0], str):
        raise RuntimeError(f"the planner failed on rank 0: {box[0]}")
    return box[0]


@dataclass(frozen=True)
class _InputFailure:
    """Rank 0's input error, broadcast to the other ranks (a plain str is a failure of another kind)."""
    message: str


def fitting_cluster(cfg: DictConfig, topo, r: int, denv, device, points, p):
    """The run's cluster (probe applied), after refusing a run no plan can fit: the smallest-memory plan
    over device memory is NoFeasiblePlan here, before the compute profile is timed, as memory does not
    depend on the timings (the planner prices time, not memory, from them)."""
    cluster = with_probe(cluster_spec(cfg, nodes=topo.nodes, ranks_per_node=r, local_ranks=denv.local_world_size,
                                      device=device), points, p)
    w = workload_from_config(cfg, cluster, kernels_for_run(cfg, device))
    options = options_from_config(cfg)
    model = CostModel(w, cluster, options)
    smallest = model.evaluate(exhaustive.smallest_memory(GroupTerms.build(model)).plan)
    # only the device memory is judged here: under a state budget a larger plan may still fit, which the
    # ILP decides after the timing
    if smallest.memory_total > smallest.device_memory:
        smallest.ranks_per_replica = w.tp * w.pp
        raise NoFeasiblePlan(smallest, w.recompute, w.micro_batch_size, context="train",
                             reserved_bytes=options.reserved_bytes)
    return cluster


def probe_for_run(cfg: DictConfig, denv, device: torch.device):
    """The collective probe's (points, source) on the run's ranks (probe.py), or None when it is off or
    there is one process. Collective."""
    p = planner_config(cfg)
    if not (p.probe and denv.world_size > 1 and dist.is_initialized()):
        return None
    topo = Topology(denv.world_size, ranks_per_node(cfg, denv.local_world_size))
    return probe_points(topo, denv.rank, device, pathlib.Path(p.cache_dir) if p.cache_dir else None,
                        p.probe_cache, probe_sizes(p.probe_max_mib * 2**20), p.probe_budget_s)


def with_probe(cluster, points, p):
    """The cluster with the probe's curves merged in, or as it is (logged) without a probe."""
    if points is not None:
        return apply_points(cluster, *points)
    why = "amsp.planner.probe=false" if not p.probe else "a single process has nothing to measure"
    log.info("planner: no bandwidth probe (%s); using the %s cluster figures", why, cluster.name)
    return cluster


def timing_dtype(cfg: DictConfig, device: torch.device) -> str:
    """The dtype startup timings run in: amsp.precision, else trainer.dtype, else what the engine's auto
    precision picks on this device (bf16 on CUDA, fp32 on CPU)."""
    a, t = OmegaConf.select(cfg, "amsp.precision") or "auto", cfg.trainer.dtype
    return a if a != "auto" else t if t != "auto" else "bf16" if device.type == "cuda" else "fp32"


def cores_shared(device: torch.device, denv) -> bool:
    """Whether this machine's ranks oversubscribe its CPU cores (part of the timing caches' keys)."""
    return device.type == "cpu" and cpu_shared_cores(machine_ranks(denv.local_world_size)) is not None


def blocks_compiled(cfg: DictConfig, device) -> bool:
    """Whether this run's engine compiles its blocks: model.compile resolved on the device, and only
    without model parallelism (amsp/build.py leaves TP / PP blocks eager)."""
    from amsp.compile import resolve_compile

    tp, pp = (int(OmegaConf.select(cfg, f"parallel.{k}", default=1)) for k in ("tp", "pp"))
    return resolve_compile(cfg.model.compile, torch.device(device)) and tp == pp == 1


def measured_compute(cfg: DictConfig, denv, device: torch.device, compiled: bool | None = None) -> ComputeProfile:
    """The run's compute profile (compute_profile.py), measured on every rank or read from the cache:
    the block the run executes (its fused kernels, compiled when the run compiles its blocks) and, under
    tensor parallelism, the TP-local units on real TP groups (tp_local_profile). compiled: time a compiled
    block or not (None: as this run's engine runs its blocks). Collective when the world has several ranks."""
    from configs.schema import to_llama_config

    p = planner_config(cfg)
    model = to_llama_config(cfg.model)
    cache = pathlib.Path(p.cache_dir) if p.cache_dir else None  # next to the probe's files
    profile = measure_profile(model, cfg.data.seq_len, cfg.trainer.micro_batch_size, timing_dtype(cfg, device),
                              model.activation_checkpointing, device, denv.world_size, denv.rank, cache,
                              p.probe_cache, p.overlap_slowdown, cores_shared=cores_shared(device, denv),
                              compiled=blocks_compiled(cfg, device) if compiled is None else compiled,
                              ranks_per_node=ranks_per_node(cfg, denv.local_world_size),
                              optimizer_kernel=str(cfg.amsp.optimizer_kernel))
    tp = int(OmegaConf.select(cfg, "parallel.tp", default=1))
    return tp_local_profile(profile, cfg, model, denv, device, tp) if tp > 1 else profile


def tp_local_profile(profile: ComputeProfile, cfg: DictConfig, model, denv, device, tp: int) -> ComputeProfile:
    """The profile of a tensor-parallel rank: its block, head and embedding are the TP-local units, timed
    on real TP groups with their collectives (amsp/parallel/tp_profile.py, the joint planner's
    measurement and cache), not the whole block the profile timed (tp times the work, no TP traffic).
    The TP measurement is forward + backward in one; it is split as the whole block splits. Collective."""
    from dataclasses import replace

    from amsp.parallel.joint_startup import measured_tp_degrees, measured_tp_units, tp_cache_path
    from configs.validate import ConfigError

    units = measured_tp_units(cfg, model, denv, device, tps=[tp])
    if (None, tp) not in units:  # every rank alike: one line and exit status 2, not a traceback
        raise ConfigError(f"parallel.tp={tp}: no tensor-parallel profile for it (measurable tp: "
                          f"{measured_tp_degrees(cfg, model, denv) or 'none'}: they divide the ranks per node, "
                          f"the heads, the vocabulary, the MLP's hidden size and, with sequence parallelism, "
                          f"data.seq_len); name one of those, or set amsp.planner.measure_compute=false")
    block_s, head_s, emb_s = units[(None, tp)]
    whole = profile.block_forward_s + profile.block_backward_s
    share = profile.block_forward_s / whole if whole > 0 else 1 / 3
    return replace(profile, block_forward_s=block_s * share, block_backward_s=block_s * (1 - share),
                   head_forward_backward_s=head_s, embedding_s=emb_s,
                   source=f"{profile.source}; TP-local units at tp {tp} measured on TP groups",
                   units_cache_file=str(tp_cache_path(cfg, model, denv, device, tp)))


def kernels_for_run(cfg: DictConfig, device) -> Kernels:
    """The kernels this run's model executes on `device` (kernels_for_model)."""
    from configs.schema import to_llama_config

    device = torch.device(device)
    return kernels_for_model(to_llama_config(cfg.model), device, timing_dtype(cfg, device),
                             compiled=blocks_compiled(cfg, device))


def kernels_for_model(model, device, dtype_name: str, compiled: bool = False) -> Kernels:
    """The kernels a model (LlamaConfig) executes on `device` in `dtype_name`, as far as they change its
    activation memory (Workload.kernels): the fused ops with a native kernel there, the norm backend
    (Transformer Engine's RMSNorm keeps its input and rstd, as the fused one does), whether attention
    takes repeated K/V copies (PyTorch SDPA except in bf16/fp16 on CUDA; models/llama/backends.py) and
    whether the blocks are compiled (model.compile; the engine compiles them only with tp = pp = 1)."""
    from models.llama.backends import resolve_attention, resolve_norm
    from models.llama.fused import ops_running

    fused = ops_running(model.fused, device)
    if resolve_norm(model.norm) == "te":
        fused |= {"rms_norm"}
    half_on_cuda = torch.device(device).type == "cuda" and dtype_name in ("bf16", "fp16")
    kv_repeated = resolve_attention(model.attention) == "sdpa" and not half_on_cuda
    return Kernels(fused=frozenset(fused), kv_repeated=kv_repeated, compiled=compiled,
                   loss_kernel="cuda" if torch.device(device).type == "cuda" else "cpu")


def _solve(cfg, cluster, p, run_dir, profile: ComputeProfile | None = None,
           kernels: Kernels | None = None) -> PlanOutcome:
    t0 = time.perf_counter()
    w = workload_from_config(cfg, cluster, kernels)
    options = options_from_config(cfg, profile)
    try:
        res = plan_cluster(w, cluster, options, top_k=p.top_k, time_limit_s=p.time_limit_s)
    except NoFeasiblePlan as e:  # its hints name train.py's keys
        raise e.in_context("train")
    columns, rows = res.wandb_table()
    text = "\n".join([cluster.describe(overlap_slowdown_of(options, cluster)), w.run_kernels.describe(),
                      describe_margin(options.memory_margin, cluster.device), res.table()])
    log.info("planner (%.2f s):\n%s", time.perf_counter() - t0, text)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.txt").write_text(text + "\n")
    return PlanOutcome(res.plan, text, columns, rows, cluster, options)
