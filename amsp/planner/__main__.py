"""Command line: the planner's table (or a what-if across scales) on any machine, no GPU needed.

    python -m amsp.planner model=llama2_13b cluster=a800x8 cluster.nodes=128 data.seq_len=4096 \\
        trainer.micro_batch_size=1 trainer.global_batch_tokens=4194304
    python -m amsp.planner --json ...                 # machine-readable: choice, every candidate, inputs
    python -m amsp.planner --price zero3 --price 8/8/64 ...   # price named plans (P/G/OS[|P/G/OS])
    python -m amsp.planner --compute-profile prof.json ...    # measured compute instead of FLOPs at MFU
    python -m amsp.planner simulate model=llama2_13b cluster=a800x8 [--gpus 8,16,...,1024] ...
    python -m amsp.planner simulate --collectives tensor ...  # what-if: DeepSpeed ZeRO-3's collectives
    python -m amsp.planner --joint model=llama2_70b cluster=h100x8 cluster.nodes=64 ...   # TP x PP x DP x AMSP
    python -m amsp.planner --joint --hetero configs/clusters_mixed/mixed_a100_v100.yaml ...  # mixed nodes

The mode (plan, the default, or simulate) may stand anywhere among the arguments; the other bare
arguments are Hydra overrides of the same config train.py composes (configs/train.yaml); the cluster's
shape is cluster.nodes x cluster.ranks_per_node. A plan that cannot be read or broken sharding rules
are a one-line error with exit status 2. Nothing here imports torch (the probe and the compute
measurement run inside train.py), so it starts fast.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import pathlib
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from amsp.batch_geometry import batch_geometry, requested_global_batch
from amsp.errors import InputError
from amsp.parallel.micro_batches import micro_batch_problem
from configs.schema import register_configs
from configs.validate import AMSP_DEGREES, JOINT_CHOOSES

from .compute_profile import SHAPE_CHECKED, check_profile_shape, load_profile, load_profiles
from .allocator import describe_margin
from .cost_model import CostModel, overlap_slowdown_of
from .from_config import (cluster_spec, options_from_config, planner_config, precision_name,
                          refuse_state_budget_for_joint, run_precision, with_model_parallel, workload_from_config)
from .report import NoFeasiblePlan, cluster_json, format_table, plan_cost_json
from .simulate import DEFAULT_GPUS, format_simulation, simulate
from .solve import parse_plan, plan_cluster, price_plan

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


def compose_config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="train", overrides=overrides)


def checked_config(overrides: list[str]):
    """The composed config, refused as one line (InputError; exit status 2) when an override names an
    unknown key or preset, has the wrong type, or a value outside its range (configs/validate.py, the
    checks train.py runs before anything starts)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from configs.validate import validate_config

    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if e.__cause__ is not None and str(e.__cause__) not in str(e) else None
        raise InputError("config: " + " ".join(f"{e} {cause or ''}".split())) from e
    validate_config(cfg, what_if=True)  # amsp.planner.tp / pp are what-if degrees here
    return cfg


# What the joint planner chooses itself (train.py refuses them with parallel.auto=true; configs/validate.py):
# an override of these would be silently replaced by its choice.
JOINT_KEYS = tuple(f"parallel.{k}" for k in JOINT_CHOOSES) + tuple(f"amsp.{k}" for k in AMSP_DEGREES)


def overridden(overrides: list[str], keys) -> list[str]:
    """The Hydra overrides (key=value, +key=value, ++key=value, ~key) that set one of `keys`, in order."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in keys:
            out.append(o)
    return out


def refuse_ignored_options(mode: str, args) -> None:
    """An option the chosen planner does not read is an error, not silently dropped."""
    # simulate plans at each of --gpus and prices no named plan; plan (and --joint) prices the cluster's shape
    if args.gpus is not None and mode != "simulate" and not args.joint:  # --joint refuses it below
        raise InputError(f"--gpus {args.gpus} applies only with simulate (a plan is priced on cluster.nodes x "
                         f"cluster.ranks_per_node GPUs)")
    if args.price and mode == "simulate" and not args.joint:
        raise InputError(f"--price {' --price '.join(args.price)}: not available with simulate (it solves at each "
                         f"GPU count); price plans without simulate")
    if args.joint:
        ignored = [name for name, given in (("simulate", mode == "simulate"), ("--price", bool(args.price)),
                                            ("--collectives tensor", args.collectives != "unit"),
                                            (f"--gpus {args.gpus}", args.gpus is not None)) if given]
        ignored += overridden(args.overrides, JOINT_KEYS)
        # a named AMSP plan: the joint planner picks every stage's degrees (amsp.plan=auto is what it does)
        ignored += [o for o in overridden(args.overrides, ("amsp.plan",)) if o.split("=", 1)[-1] != "auto"]
        # recomputation is chosen per stage, as train.py's config check says under parallel.auto
        ignored += [o for o in overridden(args.overrides, ("model.activation_checkpointing",))
                    if o.split("=", 1)[-1] != "none"]
        if ignored:
            raise InputError(f"{' and '.join(ignored)}: not available with --joint (the joint planner ranks its "
                             f"whole space and prices the 1F1B schedule; name a plan's tp/pp with parallel.* and "
                             f"use the AMSP planner to price its degrees)")
    else:
        ignored = [o for o, v in (("--hetero", args.hetero), ("--efficiency", args.efficiency)) if v]
        if ignored:
            raise InputError(f"{' and '.join(ignored)} {'apply' if len(ignored) > 1 else 'applies'} only with "
                             f"--joint (the joint planner)")


def refuse_auto_without_joint(cfg, args) -> None:
    """parallel.auto=true makes train.py run the joint search; without --joint this CLI would price
    parallel.tp / pp with the data-parallel planner instead, a different question answered silently."""
    if not args.joint and OmegaConf.select(cfg, "parallel.auto") is True:
        raise InputError("parallel.auto=true: the planner CLI runs the joint search (what train.py runs with "
                         "parallel.auto=true) only with --joint: python -m amsp.planner --joint ...; without "
                         "--joint, drop parallel.auto to price parallel.tp / parallel.pp")


MODES = ("plan", "simulate")


def split_mode(overrides: list[str]) -> tuple[str, list[str]]:
    """The mode word (plan | simulate) wherever it stands among the arguments, and the Hydra overrides
    without it: a bare word is never an override (those are key=value, ~key), so taking it is safe, and
    Hydra would otherwise refuse it with a grammar error that does not say what was meant."""
    modes = [o for o in overrides if o in MODES]
    if len(set(modes)) > 1:
        raise InputError(f"{' and '.join(dict.fromkeys(modes))}: give one mode (plan, the default, or simulate)")
    return (modes[0] if modes else "plan"), [o for o in overrides if o not in MODES]


def kernels_json(k) -> dict:
    """The kernels the activations are priced for (Workload.kernels; the CLI assumes, train.py asks)."""
    return {"fused": sorted(k.fused), "kv_repeated": k.kv_repeated, "compiled": k.compiled}


def inputs_json(cfg, w, cluster, options, model: CostModel) -> dict:
    """What the plans were priced with: workload, cluster figures, options, where compute came from."""
    workload = {"model": dataclasses.asdict(w.model), "seq_len": w.seq_len, "micro_batch_size": w.micro_batch_size,
                "micro_batches": w.micro_batches, "precision": precision_name(cfg, cluster),
                "param_bytes": w.precision.param_bytes, "grad_bytes": w.precision.grad_bytes,
                "recompute": w.recompute, "tp": w.tp, "pp": w.pp, "params_per_rank": w.params_per_rank(),
                "kernels": kernels_json(w.run_kernels)}
    g = batch_geometry(cfg, model.dp_world, announce=False)  # what the step was priced for, and what was asked
    workload.update(global_batch=g.global_batch, requested_global_batch=g.requested)
    opts = dataclasses.asdict(options)
    return {"workload": workload, "cluster": cluster_json(cluster), "options": opts,
            "bandwidth_source": cluster.source, "compute_source": model.compute_source,
            "overlap_slowdown": dict(zip(("value", "source"), overlap_slowdown_of(options, cluster)))}


def announce_rounded_batch(g, dp_world: int, where: str = "") -> None:
    """Say once (stderr, whatever the output format) that the step was priced for a rounded batch: the
    workload takes the batch train.py would (from_config.micro_batches), which logs nothing itself."""
    if g.rounded:
        print(f"note: {where}global batch {g.requested} samples does not split into micro-batches of "
              f"{g.micro_batch} on {dp_world} data-parallel ranks: priced as {g.global_batch} ({g.accumulation} "
              f"micro-batch(es) per rank per step), as train.py rounds it (trainer.round_global_batch)",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m amsp.planner [plan|simulate]", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", help=f"simulate: GPU counts (default {','.join(map(str, DEFAULT_GPUS))})")
    ap.add_argument("--json", action="store_true", help="print JSON on stdout instead of the tables")
    ap.add_argument("--price", action="append", default=[], metavar="PLAN",
                    help="price this plan instead of solving: a preset (ddp, zero1, zero2, zero3, hsdp), "
                         "P/G/OS, or P/G/OS|P/G/OS for blocks | embedding+head; repeatable")
    ap.add_argument("--compute-profile", metavar="FILE",
                    help="JSON with block_forward_s, block_backward_s, head_forward_backward_s, embedding_s "
                         "[, overlap_slowdown] (compute_profile.ComputeProfile): measured compute instead "
                         "of FLOPs at amsp.planner.mfu")
    ap.add_argument("--joint", action="store_true",
                    help="search tensor / pipeline / data parallelism, the layer split, the micro-batch size and "
                         "each stage's AMSP degrees and recomputation together (amsp/planner/joint)")
    ap.add_argument("--hetero", metavar="FILE", help="--joint on a mixed cluster: a YAML of node groups "
                    "(configs/clusters_mixed/); default: the `cluster` preset, cluster.nodes nodes")
    ap.add_argument("--efficiency", metavar="FILE",
                    help="--joint: JSON {node preset: fraction of peak its compute reaches}, e.g. measured per "
                         "GPU type; default: amsp.planner.mfu for every type")
    ap.add_argument("--collectives", choices=("unit", "tensor"), default="unit",
                    help="what-if: 'tensor' prices the sharded plans' collectives as DeepSpeed ZeRO-3 issues them "
                         "(one all-gather per submodule's weight, norms never gathered, gradients in buckets), "
                         "to compare with published systems; 'unit' (default) is this engine's one per unit")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama2_13b cluster=a800x8")
    # intermixed: Hydra overrides may come before, between or after the options
    args = ap.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        mode, args.overrides = split_mode(args.overrides)  # the mode may stand anywhere among the arguments
        return _run(mode, args)
    except (NoFeasiblePlan, ValueError, InputError) as e:  # PlanError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(mode: str, args) -> int:
    refuse_ignored_options(mode, args)
    cfg = with_model_parallel(checked_config(args.overrides))
    refuse_auto_without_joint(cfg, args)
    if args.joint:
        return _run_joint(cfg, args)
    # Everything an input can be refused for is read before the first line of output (the cluster's
    # header), so a refused run prints its one error line only.
    counts = gpu_counts(args.gpus if args.gpus is not None else ",".join(map(str, DEFAULT_GPUS)))
    cluster = cluster_spec(cfg)
    profile, profile_shape = None, ""
    if args.compute_profile:
        profile = load_profile(args.compute_profile)
        profile_shape = check_profile_shape(args.compute_profile, planned_shape(cfg, cluster),
                                            cluster_name=cluster.name)
    options = dataclasses.replace(options_from_config(cfg, profile), granularity=args.collectives)
    p = planner_config(cfg)
    out = (lambda s: None) if args.json else print
    if mode == "simulate":
        r = cluster.ranks_per_node
        # simulated before the header: a degree no count can run (tp beyond a node) is refused inside it
        rows = simulate(lambda n: workload_from_config(cfg, cluster.with_shape(max(1, n // r), min(r, n))),
                        cluster, options, counts)
        out(cluster.describe(overlap_slowdown_of(options, cluster)))
        ranks_per_replica = p.tp * p.pp
        for n in sorted({row["gpus"] for row in rows if "global_batch" in row}):
            dp = n // ranks_per_replica
            announce_rounded_batch(batch_geometry(cfg, dp, announce=False), dp, where=f"at {n} GPUs, ")
        if args.json:
            print(json.dumps({"simulation": rows, "cluster": cluster_json(cluster)}))
            return 0
        compute = (f"compute from {profile.source} ({profile_shape})" if profile is not None
                   else f"assumed MFU of compute {options.mfu:.0%}")
        print(f"model {cfg.model.name}, seq_len {cfg.data.seq_len}, micro-batch {cfg.trainer.micro_batch_size}, "
              f"recomputation {cfg.model.activation_checkpointing}, {compute}")
        print(format_simulation(rows))
        return 0
    w = workload_from_config(cfg, cluster)
    model = CostModel(w, cluster, options)
    announce_rounded_batch(batch_geometry(cfg, model.dp_world, announce=False), model.dp_world)
    # the rounded batch's micro-batches against the schedule, as train.py refuses them before any build
    if w.pp > 1 and (problem := micro_batch_problem(w.schedule, w.micro_batches, w.pp)) is not None:
        raise InputError(problem)
    plans = [parse_plan(text, model.dp_world, model.dp_per_node) for text in args.price]
    out(cluster.describe(overlap_slowdown_of(options, cluster)))
    shape = f" ({profile_shape})" if profile_shape else ""
    out(f"model {cfg.model.name}: {count_text(w.params_per_rank())} parameters per rank, seq_len {w.seq_len}, "
        f"{w.micro_batches} micro-batch(es) of {w.micro_batch_size} per rank, {precision_name(cfg, cluster)}, "
        f"recomputation {w.recompute}, tp {w.tp}, pp {w.pp}; compute from {model.compute_source}{shape}")
    out(f"{w.run_kernels.describe()} (assumed here; train.py's startup asks its device)")
    out(describe_margin(options.memory_margin, cluster.device))
    if args.price:
        costs = [price_plan(w, cluster, options, plan) for plan in plans]
        if args.json:
            print(json.dumps({"priced": [plan_cost_json(c) for c in costs],
                              "inputs": inputs_json(cfg, w, cluster, options, model)}))
        else:
            print(format_table(costs, "priced plans (total > device memory = does not fit):"))
        return 0
    with json_error(args.json, lambda: inputs_json(cfg, w, cluster, options, model)):
        try:
            res = plan_cluster(w, cluster, options, top_k=p.top_k, time_limit_s=p.time_limit_s)
        except NoFeasiblePlan as e:  # its hints name this CLI's keys
            raise e.in_context("cli")
    if args.json:
        print(json.dumps({**res.to_json(), "inputs": inputs_json(cfg, w, cluster, options, model)}))
    else:
        print(res.table())
    return 0


@contextlib.contextmanager
def json_error(enabled: bool, inputs):
    """--json: a plan search that finds nothing still prints a JSON object on stdout (the error and what
    was priced, inputs()), so a script reading stdout gets one; the error then ends the run as always
    (one line on stderr, exit status 2)."""
    try:
        yield
    except (NoFeasiblePlan, InputError) as e:
        if enabled:
            print(json.dumps({"error": str(e), "inputs": inputs()}))
        raise


def count_text(n: float) -> str:
    """A parameter count in the unit that keeps its digits: 6.74B, 7.34M, 164.16K. Not train.py's format, which
    logs millions whatever the size (0.16M)."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def planned_shape(cfg, cluster) -> dict:
    """What the CLI prices, in compute_profile.measured_shape's fields (a profile file's record)."""
    from configs.schema import to_llama_config

    m = to_llama_config(cfg.model)
    return {"dim": m.dim, "n_layers": m.n_layers, "ffn": m.ffn_hidden_dim, "heads": m.n_heads,
            "kv_heads": m.n_kv_heads, "vocab": m.vocab_size, "seq_len": int(cfg.data.seq_len),
            "micro_batch": int(cfg.trainer.micro_batch_size), "dtype": precision_name(cfg, cluster),
            "device": cluster.device}


def gpu_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise InputError(f"--gpus {text}: expected comma-separated GPU counts >= 1, e.g. 8,64,1024")
    return counts


def _run_joint(cfg, args) -> int:
    from configs.schema import to_llama_config

    from .joint.hetero import from_spec, load_hetero, read_efficiency_file
    from .joint.search import FIXED_LAYOUT_KEYS, fixed_layout, format_joint, plan_joint
    from .joint_inputs import joint_compute
    from .workload import default_kernels

    cluster = load_hetero(args.hetero) if args.hetero else from_spec(cluster_spec(cfg))
    p = planner_config(cfg)
    refuse_state_budget_for_joint(p, context="cli")
    model = to_llama_config(cfg.model)
    seq, mbs = int(cfg.data.seq_len), int(cfg.trainer.micro_batch_size)
    sp, lp = bool(cfg.parallel.sequence_parallel), bool(cfg.parallel.loss_parallel)
    # amsp.planner.tp / pp fix the searched tp x pp, as at train.py's parallel.auto startup; at 1 x 1 (their
    # default, which train.py cannot tell from one given) they leave both to the search: named so, refused
    given = overridden(args.overrides, FIXED_LAYOUT_KEYS)
    if given and (p.tp, p.pp) == (1, 1):
        raise InputError(f"{' and '.join(given)}: with --joint, amsp.planner.tp / amsp.planner.pp fix the searched "
                         f"layout only other than tp 1 x pp 1, their default, under which every tp and pp is "
                         f"searched (as with parallel.auto=true); drop them, or price tp 1 x pp 1 without --joint")
    layout = fixed_layout(p.tp, p.pp, model, cluster.world, cluster.ranks_per_node, seq, sp, lp)
    # as the data-parallel path (batch_geometry): tokens that are no whole number of sequences are refused,
    # not floored into a smaller batch than asked
    global_batch = int(requested_global_batch(cfg))
    prec = run_precision(cfg, cluster.groups[0].spec)  # gradients in amsp.grad_comm, as the engine
    # Compute: a profile file (tp 1 units per node group, as train.py's startup measures them), else
    # the fraction of peak each kind of node reaches (--efficiency, else amsp.planner.mfu).
    profiles = {}
    if args.compute_profile:
        if args.efficiency:
            raise InputError("--compute-profile and --efficiency: give one (a profile sets each group's efficiency)")
        names = {g.name for g in cluster.groups}
        # the model's shape is checked; the device is not: a mixed cluster's groups run on several
        check_profile_shape(args.compute_profile, planned_shape(cfg, cluster.groups[0].spec),
                            compare=tuple(k for k in SHAPE_CHECKED if k != "device"))
        for group, prof in load_profiles(args.compute_profile).items():
            if group is not None and group not in names:
                raise InputError(f"--compute-profile {args.compute_profile}: node group {group!r} is not in the "
                                 f"cluster (groups: {', '.join(sorted(names))})")
            profiles[(group, mbs)] = prof
    jc = joint_compute(cluster, profiles, {}, model, seq, mbs, prec, p.mfu, p.overlap_slowdown,
                       str(cfg.amsp.optimizer_kernel))
    cluster, eff = jc.cluster, jc.efficiency
    if args.efficiency:
        eff.update(read_efficiency_file(args.efficiency, cluster))
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    kernels = default_kernels(to_llama_config(cfg.model))  # what plan_joint assumes without a device
    inputs = {"cluster": cluster.describe(), "model": cfg.model.name, "seq_len": seq, "global_batch": global_batch,
              "efficiency": eff, "compute": jc.sources, "precision": precision_name(cfg, cluster.groups[0].spec),
              "grad_bytes": prec.grad_bytes, "kernels": kernels_json(kernels), "sequence_parallel": sp,
              "loss_parallel": lp, "fixed_layout": None if layout is None else {"tp": layout[0], "pp": layout[1]}}
    with json_error(args.json, lambda: inputs):
        plans = plan_joint(model, cluster, seq_len=seq, global_batch=global_batch, precision=prec,
                           efficiency=eff, top_k=p.top_k, memory_margin=p.memory_margin,
                           reserved_bytes=p.reserved_gib * 2**30, overlap_slowdown=p.overlap_slowdown, progress=log,
                           unit_times=jc.unit_times, optimizer_s_per_elem=jc.optimizer_s_per_elem or None,
                           overlap_spread=bool(cfg.amsp.overlap_spread), spread_window=int(cfg.amsp.spread_window),
                           sequence_parallel=sp, overlap_update=bool(cfg.amsp.overlap_update),
                           optimizer_kernel=str(cfg.amsp.optimizer_kernel), loss_parallel=lp, layout=layout)
    if args.json:
        print(json.dumps({"choice": plans[0].to_json(), "alternatives": [x.to_json() for x in plans[1:]],
                          "inputs": inputs}))
    else:
        print(f"model {cfg.model.name}, seq_len {seq}, global batch {global_batch} samples; compute at "
              + ", ".join(f"{k} {v:.0%}" for k, v in eff.items()) + f" of peak ({'; '.join(jc.sources)}); "
              f"{kernels.describe()} (assumed)")
        print(format_joint(plans, cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
