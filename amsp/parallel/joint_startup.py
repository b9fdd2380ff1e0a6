"""parallel.auto: the joint planner (amsp/planner/joint) at training startup.

Rank 0 prices the joint space on the run's cluster (the `cluster` preset shaped by the launcher, or the
device's own preset on a GPU, as the AMSP planner does; the collective probe's curves merged in) with
what this machine measures: one block's forward at the run's shape (amsp/planner/compute_profile.py,
cached) and the tensor-parallel units timed on real TP groups of every candidate tp
(amsp/parallel/tp_profile.py); every rank receives the choice over the control plane. The run then
takes the plan's tp, pp, layer split, micro-batch size and per-stage recomputation as if they had been
given by hand, and each rank the AMSP degrees of its own stage's DP group.
"""
from __future__ import annotations

import logging
import pathlib

from omegaconf import DictConfig, OmegaConf

from amsp import control

log = logging.getLogger(__name__)


def joint_plan_for_run(cfg: DictConfig, denv, device, run_dir: pathlib.Path | None):
    """(cfg with parallel.* and trainer.micro_batch_size set from the choice, the JointPlan). Collective."""
    from configs.schema import to_llama_config

    from ..planner.from_config import cluster_spec, planner_config, precision_name, refuse_state_budget_for_joint
    from ..planner.joint.hetero import from_spec
    from ..planner.joint.search import format_joint, plan_joint
    from ..planner.startup import measured_compute, probe_for_run, ranks_per_node, with_probe
    from ..planner.workload import Workload
    from ..schedule import Precision

    p = planner_config(cfg)
    refuse_state_budget_for_joint(p)  # before any collective: every rank raises alike
    model = to_llama_config(cfg.model)
    seq = int(cfg.data.seq_len)
    tokens = OmegaConf.select(cfg, "trainer.global_batch_tokens")
    global_batch = int(tokens) // seq if tokens else int(cfg.trainer.global_batch_size)
    points = probe_for_run(cfg, denv, device)  # collective
    profile = measured_compute(cfg, denv, device) if p.measure_compute else None  # collective
    tp_times = measured_tp_units(cfg, model, denv, device) if p.measure_compute else {}  # collective
    box: list = [None]
    if denv.rank == 0:
        r = ranks_per_node(cfg, denv.local_world_size)
        try:
            spec = cluster_spec(cfg, nodes=denv.world_size // r, ranks_per_node=r, local_ranks=denv.local_world_size,
                                device=device)
            spec = with_probe(spec, points, p)
            cluster = from_spec(spec)
            prec = Precision.named(precision_name(cfg, spec))
            eff, source = float(p.mfu), f"amsp.planner.mfu={p.mfu}"
            if profile is not None:  # the measured block forward against its FLOPs at this machine's peak
                w = Workload(model, seq, int(cfg.trainer.micro_batch_size), 1, prec)
                eff = min(1.0, w.block_forward_flops() / (profile.block_forward_s * spec.peak_flops))
                source = f"{profile.source}: one block's forward at {eff:.0%} of the peak"
            slowdown = p.overlap_slowdown if p.overlap_slowdown is not None else \
                (profile.overlap_slowdown if profile is not None else None)
            mbs = int(cfg.trainer.micro_batch_size)
            units = {(spec.name, tp, mbs): v for tp, v in tp_times.items()}
            if profile is not None:  # tp 1: the profile's own units
                units[(spec.name, 1, mbs)] = (profile.block_forward_s + profile.block_backward_s,
                                              profile.head_forward_backward_s, profile.embedding_s)
            plans = plan_joint(model, cluster, seq_len=seq, global_batch=global_batch, precision=prec,
                               efficiency={spec.name: eff}, top_k=p.top_k, memory_margin=p.memory_margin,
                               reserved_bytes=p.reserved_gib * 2**30, overlap_slowdown=slowdown,
                               unit_times=units, overlap_spread=bool(cfg.amsp.overlap_spread),
                               spread_window=int(cfg.amsp.spread_window),
                               optimizer_s_per_elem={spec.name: profile.optimizer_s_per_elem}
                               if profile is not None and profile.optimizer_s_per_elem is not None else None)
            text = f"joint planner (compute: {source})\n" + format_joint(plans, cluster)
            log.info("%s", text)
            if run_dir is not None:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "plan.txt").write_text(text + "\n")
            box[0] = plans[0]
        except (ValueError, RuntimeError) as e:  # InputError is a ValueError: tell the other ranks, then raise
            box[0] = e
    if denv.world_size > 1:
        box[0] = control.broadcast_object(box[0], src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    plan = box[0]
    cfg = OmegaConf.merge(cfg, {
        "parallel": {"tp": plan.tp, "pp": plan.pp, "layer_split": plan.layer_split if plan.pp > 1 else None,
                     "schedule": "1f1b", "virtual_stages": 1, "recompute_stages": plan.recompute},
        "trainer": {"micro_batch_size": plan.micro_batch_size},
    })
    return cfg, plan


def measured_tp_units(cfg: DictConfig, model, denv, device) -> dict:
    """{tp: (block, head, embedding) seconds} for every tp the joint planner may pick on this run's nodes,
    timed on real TP groups (amsp/parallel/tp_profile.py), or read from the cache a run of the same shape
    on the same machine and world wrote (beside the compute profile's; amsp.planner.probe_cache=false
    measures again). Collective; {} on one rank."""
    import torch
    import torch.distributed as dist

    from ..planner.cache_file import read_shared, write_atomic
    from ..planner.compute_profile import cache_key, default_cache_dir
    from ..planner.from_config import planner_config
    from ..planner.joint.search import tp_candidates
    from ..planner.startup import cores_shared, ranks_per_node, timing_dtype
    from .tp_profile import TP_PROFILE_VERSION, TPUnitTimes, measure_tp_units

    p = planner_config(cfg)
    device = torch.device(device)
    seq, mbs = int(cfg.data.seq_len), int(cfg.trainer.micro_batch_size)
    dtype = timing_dtype(cfg, device)
    backend = dist.get_backend() if dist.is_initialized() else None
    key = cache_key(model, seq, mbs, dtype, "none", device, denv.world_size, backend, cores_shared(device, denv))
    cache = pathlib.Path(p.cache_dir) if p.cache_dir else default_cache_dir()  # as the compute profile
    out = {}
    for tp in tp_candidates(model, ranks_per_node(cfg, denv.local_world_size), seq)[1:]:  # tp 1: the profile
        # sequence and loss parallelism on, as the run applies them
        path = cache / f"tp{tp}-v{TP_PROFILE_VERSION}-{key}.json"
        cached = read_shared(path, "times", p.probe_cache, denv.rank, denv.world_size > 1, "tensor-parallel profile")
        if cached is not None:
            times = TPUnitTimes(**cached)
        else:
            times = measure_tp_units(model, seq, mbs, dtype, device, tp, denv.world_size)
            if denv.rank == 0:
                write_atomic(path, {"key": key, "times": vars(times)})
        if denv.rank == 0:
            log.info("tensor-parallel profile%s: %s", f" (cached {path})" if cached is not None else "",
                     times.describe())
        out[tp] = (times.block_s, times.head_s, times.embedding_s)
    return out


def stage_plan(plan, mesh, rank: int):
    """The AMSP Plan of this rank's stage (its DP group's degrees, for blocks and embedding+head)."""
    from ..plan import Degrees, Plan

    stage = mesh.coords(rank).pp if mesh is not None else 0
    deg = Degrees(*plan.stage_plans[stage])
    return Plan(deg, deg, name="joint")
