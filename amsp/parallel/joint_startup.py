"""parallel.auto: the joint planner (amsp/planner/joint) at training startup.

Rank 0 prices the joint space on the run's cluster (the `cluster` preset shaped by the launcher, or the
device's own preset on a GPU, as the AMSP planner does; the collective probe's curves merged in) with
what this machine measures: one block's forward at the run's shape (amsp/planner/compute_profile.py,
cached) and the tensor-parallel units timed on real TP groups of every candidate tp
(amsp/parallel/tp_profile.py); every rank receives the choice over the control plane. The run then
takes the plan's tp, pp, layer split, micro-batch size and per-stage recomputation as if they had been
given by hand, and each rank the AMSP degrees of its own stage's DP group.

On a mixed cluster (parallel.cluster_file, amsp/parallel/mixed_cluster.py) the launch is checked against
the file first, and each node group keeps its own ranks' compute profile and TP unit times. Units are
measured at the run's micro-batch size and at 1 (the planner's other sizes lie on the line through them).
Rank 0 plans; its result, or its input error, reaches every rank (control.decided_by_rank0).
"""
from __future__ import annotations

import logging
import pathlib

from omegaconf import DictConfig, OmegaConf

from amsp import control

log = logging.getLogger(__name__)


def joint_plan_for_run(cfg: DictConfig, denv, device, run_dir: pathlib.Path | None):
    """(cfg with parallel.* and trainer.micro_batch_size set from the choice, the JointPlan, the planner's
    table). The table goes to run_dir/plan.txt when run_dir is given (None: the caller writes it once a
    resume's checks passed). Collective."""
    from configs.schema import to_llama_config

    from ..planner.from_config import planner_config, refuse_state_budget_for_joint
    from ..planner.joint.search import tp_candidates
    from ..planner.startup import probe_for_run, ranks_per_node
    from .mixed_cluster import devices_of_ranks, mixed_cluster_for_run

    p = planner_config(cfg)
    refuse_state_budget_for_joint(p)  # before any collective: every rank raises alike
    model = to_llama_config(cfg.model)
    r = ranks_per_node(cfg, denv.local_world_size)
    layout = run_layout(cfg, model, denv.world_size, r)  # before any collective too
    # the tp degrees the search prices are timed, no other: a fixed layout's, else the candidates under the
    # run's sequence and loss parallelism (a tied model without loss parallelism cannot run tp > 1)
    modes = tp_modes(cfg)
    tps = [layout[0]] if layout is not None else \
        tp_candidates(model, r, int(cfg.data.seq_len), modes["sequence_parallel"], modes["loss_parallel"])
    mixed = None
    if cfg.parallel.cluster_file:  # checked against the launch before anything is measured
        devices = devices_of_ranks(device)  # collective
        mixed = control.decided_by_rank0(
            lambda: mixed_cluster_for_run(cfg, denv.world_size, denv.local_world_size, device, r, devices), denv.rank)
    groups = mixed.group_names_by_rank() if mixed is not None else None
    points = probe_for_run(cfg, denv, device)  # collective
    # What this machine measures, keyed by node group (None: the one kind of node of a uniform cluster) and
    # micro-batch size: the run's and 1, so the planner's other sizes are priced on a fixed cost per
    # micro-batch plus one per sample (stage_cost.measured_units) instead of in proportion to the run's,
    # which made every size cost the same per sample and hid what a larger micro-batch saves.
    profiles, tp_times = {}, {}
    for m in sorted({1, int(cfg.trainer.micro_batch_size)}) if p.measure_compute else ():
        at = OmegaConf.merge(cfg, {"trainer": {"micro_batch_size": m}})
        profiles.update({(g, m): v for g, v in measured_profiles(at, denv, device, groups).items()})  # collective
        tp_times.update({(g, tp, m): v for (g, tp), v in measured_tp_units(at, model, denv, device, groups,
                                                                            tps).items()})
    plan, table = control.decided_by_rank0(
        lambda: _plan(cfg, denv, device, run_dir, mixed, r, points, profiles, tp_times, layout), denv.rank)
    return with_joint_plan(cfg, plan), plan, table


def run_layout(cfg: DictConfig, model, world: int, ranks_per_node: int) -> tuple[int, int] | None:
    """The (tp, pp) amsp.planner.tp / pp fix for the joint search, as `python -m amsp.planner --joint` reads
    them (joint.search.fixed_layout), or None (their default 1 x 1: every layout searched); a layout the
    search cannot take is an InputError naming them."""
    from ..planner.from_config import planner_config
    from ..planner.joint.search import fixed_layout

    p = planner_config(cfg)
    modes = tp_modes(cfg)
    return fixed_layout(int(p.tp), int(p.pp), model, world, ranks_per_node, int(cfg.data.seq_len),
                        modes["sequence_parallel"], modes["loss_parallel"])


def with_joint_plan(cfg: DictConfig, plan) -> DictConfig:
    """cfg as if the plan's choices had been given by hand. Its per-stage recomputation goes through
    parallel.recompute_stages where there is a mesh (tp or pp > 1); without one (tp = pp = 1) nothing reads
    that list, so the one stage's choice is model.activation_checkpointing (full, or none), as priced."""
    meshless = plan.tp == 1 and plan.pp == 1
    return OmegaConf.merge(cfg, {
        "parallel": {"tp": plan.tp, "pp": plan.pp, "layer_split": plan.layer_split if plan.pp > 1 else None,
                     "schedule": "1f1b", "virtual_stages": 1,
                     "recompute_stages": None if meshless else plan.recompute},
        "trainer": {"micro_batch_size": plan.micro_batch_size},
        **({"model": {"activation_checkpointing": "full" if plan.recompute[0] else "none"}} if meshless else {}),
    })


def _plan(cfg, denv, device, run_dir, mixed, r, points, profiles: dict, tp_times: dict,
          layout: tuple[int, int] | None = None):
    """Rank 0: the joint plan on the run's cluster priced with what was measured, and its table (logged;
    saved when run_dir is given)."""
    import dataclasses

    from configs.schema import to_llama_config

    from ..planner.allocator import describe_margin
    from ..planner.from_config import cluster_spec, on_device, planner_config, run_precision
    from ..planner.joint.hetero import from_spec
    from ..planner.joint.search import format_joint, plan_joint
    from ..planner.joint_inputs import joint_compute
    from ..planner.startup import kernels_for_run, with_probe

    p = planner_config(cfg)
    model = to_llama_config(cfg.model)
    seq, mbs = int(cfg.data.seq_len), int(cfg.trainer.micro_batch_size)
    tokens = OmegaConf.select(cfg, "trainer.global_batch_tokens")
    global_batch = int(tokens) // seq if tokens else int(cfg.trainer.global_batch_size)
    if mixed is None:
        cluster = from_spec(with_probe(cluster_spec(cfg, nodes=denv.world_size // r, ranks_per_node=r,
                                                    local_ranks=denv.local_world_size, device=device), points, p))
    else:  # the probe measured this cluster's links as a whole (the slowest rank's figures): every group gets them;
        # the run's device is every group's (a GPU preset named for a CPU run runs its updates inline)
        cluster = dataclasses.replace(mixed, groups=tuple(
            dataclasses.replace(g, spec=on_device(with_probe(g.spec, points, p), device)) for g in mixed.groups))
    prec = run_precision(cfg, cluster.groups[0].spec)  # gradients in amsp.grad_comm, as the engine
    jc = joint_compute(cluster, profiles, tp_times, model, seq, mbs, prec, p.mfu, p.overlap_slowdown,
                       str(cfg.amsp.optimizer_kernel))
    cluster, sources = jc.cluster, jc.sources
    kernels = kernels_for_run(cfg, device)
    plans = plan_joint(model, cluster, seq_len=seq, global_batch=global_batch, precision=prec,
                       efficiency=jc.efficiency, top_k=p.top_k, memory_margin=p.memory_margin,
                       reserved_bytes=p.reserved_gib * 2**30, overlap_slowdown=p.overlap_slowdown,
                       unit_times=jc.unit_times, overlap_spread=bool(cfg.amsp.overlap_spread),
                       spread_window=int(cfg.amsp.spread_window), optimizer_s_per_elem=jc.optimizer_s_per_elem or None,
                       kernels=kernels, sequence_parallel=bool(cfg.parallel.sequence_parallel),
                       overlap_update=bool(cfg.amsp.overlap_update), optimizer_kernel=str(cfg.amsp.optimizer_kernel),
                       loss_parallel=bool(cfg.parallel.loss_parallel), layout=layout)
    margin = describe_margin(p.memory_margin, cluster.groups[0].spec.device)
    text = (f"joint planner (compute: {'; '.join(sources)}; {kernels.describe()}; {margin})\n"
            + format_joint(plans, cluster))
    log.info("%s", text)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.txt").write_text(text + "\n")
    return plans[0], text


def measured_profiles(cfg: DictConfig, denv, device, groups: list[str] | None) -> dict:
    """{None: the run's compute profile} (startup.measured_compute), or on a mixed cluster {node group:
    its own ranks' profile} (compute_profile.measure_group_profiles). Collective."""
    from ..planner.compute_profile import measure_group_profiles
    from ..planner.from_config import planner_config
    from ..planner.startup import cores_shared, measured_compute, timing_dtype

    if groups is None:  # eager blocks, as the TP units are timed: only tp = pp = 1 runs compile theirs
        return {None: measured_compute(cfg, denv, device, compiled=False)}
    from configs.schema import to_llama_config

    p = planner_config(cfg)
    model = to_llama_config(cfg.model)
    return measure_group_profiles(model, int(cfg.data.seq_len), int(cfg.trainer.micro_batch_size),
                                  timing_dtype(cfg, device), model.activation_checkpointing, device, denv.world_size,
                                  denv.rank, groups, pathlib.Path(p.cache_dir) if p.cache_dir else None,
                                  p.probe_cache, cores_shared=cores_shared(device, denv),
                                  optimizer_kernel=str(cfg.amsp.optimizer_kernel))


def tp_cache_path(cfg: DictConfig, model, denv, device, tp: int, groups: list[str] | None = None) -> pathlib.Path:
    """The file measured_tp_units caches the units of `tp` in (beside the compute profile's, same key, and
    the run's sequence / loss parallelism when off)."""
    import torch
    import torch.distributed as dist

    from ..planner.compute_profile import cache_key, default_cache_dir, rank_layout
    from ..planner.from_config import planner_config
    from ..planner.startup import cores_shared, timing_dtype
    from .tp_profile import TP_PROFILE_VERSION

    p = planner_config(cfg)
    device = torch.device(device)
    backend = dist.get_backend() if dist.is_initialized() else None
    layout = rank_layout(groups, device) if groups is not None else None
    key = cache_key(model, int(cfg.data.seq_len), int(cfg.trainer.micro_batch_size), timing_dtype(cfg, device),
                    "none", device, denv.world_size, backend, cores_shared(device, denv), layout)
    cache = pathlib.Path(p.cache_dir) if p.cache_dir else default_cache_dir()
    # what is timed depends on them (tp_modes): a run with sequence or loss parallelism off keeps files apart;
    # the names with both on are unchanged, so their caches stay valid
    modes = tp_modes(cfg)
    off = "".join(f"-no{tag}" for tag, k in (("sp", "sequence_parallel"), ("lp", "loss_parallel")) if not modes[k])
    return cache / f"tp{tp}-v{TP_PROFILE_VERSION}{off}-{key}.json"


def tp_modes(cfg: DictConfig) -> dict:
    """The run's sequence_parallel / loss_parallel (parallel.*), as measure_tp_units takes them."""
    return {k: bool(OmegaConf.select(cfg, f"parallel.{k}", default=True))
            for k in ("sequence_parallel", "loss_parallel")}


def measured_tp_degrees(cfg: DictConfig, model, denv) -> list[int]:
    """The tp > 1 measured_tp_units times: the joint planner's candidates on this run's nodes, under the
    run's sequence parallelism (without it the sequence need not split over tp)."""
    from ..planner.joint.search import tp_candidates
    from ..planner.startup import ranks_per_node

    return tp_candidates(model, ranks_per_node(cfg, denv.local_world_size), int(cfg.data.seq_len),
                         tp_modes(cfg)["sequence_parallel"])[1:]  # tp 1: the compute profile


def measured_tp_units(cfg: DictConfig, model, denv, device, groups: list[str] | None = None,
                      tps: list[int] | None = None) -> dict:
    """{(None, tp): (block, head, embedding) seconds} for every tp the joint planner may pick on this run's
    nodes, timed on real TP groups (amsp/parallel/tp_profile.py; the slowest rank's), or read from the
    cache a run of the same shape on the same machine and world wrote (beside the compute profile's;
    amsp.planner.probe_cache=false measures again). groups (a mixed cluster's node group of every rank):
    {(group, tp): ...}, each group the median of its own ranks' times. tps: only these degrees (a run
    that names its tp needs no other). Collective; {} on one rank."""
    import torch

    from amsp import control

    from ..planner.cache_file import read_shared, write_atomic
    from ..planner.compute_profile import medians_by_group
    from ..planner.from_config import planner_config
    from ..planner.startup import timing_dtype
    from .tp_profile import TPUnitTimes, measure_tp_units

    p = planner_config(cfg)
    device = torch.device(device)
    seq, mbs = int(cfg.data.seq_len), int(cfg.trainer.micro_batch_size)
    dtype = timing_dtype(cfg, device)
    field = "times" if groups is None else "times_by_group"
    # as the run applies them: sequence parallelism sets the residual stream each rank holds and its
    # collectives, loss parallelism whether the full logits are gathered
    modes = tp_modes(cfg)
    out = {}
    for tp in [t for t in measured_tp_degrees(cfg, model, denv) if tps is None or t in tps]:
        path = tp_cache_path(cfg, model, denv, device, tp, groups)
        cached = read_shared(path, field, p.probe_cache, denv.rank, denv.world_size > 1, "tensor-parallel profile")
        if cached is not None:
            by_group = {None: TPUnitTimes(**cached)} if groups is None else \
                {g: TPUnitTimes(**v) for g, v in cached.items()}
        elif groups is None:
            by_group = {None: measure_tp_units(model, seq, mbs, dtype, device, tp, denv.world_size, **modes)}
        else:  # every rank its own times, each node group the median of its ranks
            mine = measure_tp_units(model, seq, mbs, dtype, device, tp, denv.world_size, **modes, slowest=False)
            rows = control.all_gather_object([mine.block_s, mine.head_s, mine.embedding_s])
            by_group = {g: TPUnitTimes(tp, *med) for g, med in medians_by_group(rows, groups).items()}
        if cached is None and denv.rank == 0:
            write_atomic(path, {"key": path.stem, field: vars(by_group[None]) if groups is None else
                                {g: vars(t) for g, t in by_group.items()}})
        for g, times in by_group.items():
            if denv.rank == 0:
                log.info("tensor-parallel profile%s%s: %s", "" if g is None else f" of node group {g}",
                         f" (cached {path})" if cached is not None else "", times.describe())
            out[(g, tp)] = (times.block_s, times.head_s, times.embedding_s)
    return out


def stage_plan(plan, mesh, rank: int):
    """The AMSP Plan of this rank's stage (its DP group's degrees, for blocks and embedding+head)."""
    from ..plan import Degrees, Plan

    stage = mesh.coords(rank).pp if mesh is not None else 0
    deg = Degrees(*plan.stage_plans[stage])
    return Plan(deg, deg, name="joint")
