"""Command line: the planner's table (or a what-if across scales) on any machine, no GPU needed.

    python -m amsp.planner model=llama2_13b cluster=a800x8 cluster.nodes=128 data.seq_len=4096 \\
        trainer.micro_batch_size=1 trainer.global_batch_tokens=4194304
    python -m amsp.planner --json ...                 # machine-readable: choice, every candidate, inputs
    python -m amsp.planner --price zero3 --price 8/8/64 ...   # price named plans (P/G/OS[|P/G/OS])
    python -m amsp.planner --compute-profile prof.json ...    # measured compute instead of FLOPs at MFU
    python -m amsp.planner simulate model=llama2_13b cluster=a800x8 [--gpus 8,16,...,1024] ...

The arguments after the optional mode are Hydra overrides of the same config train.py composes
(configs/train.yaml); the cluster's shape is cluster.nodes x cluster.ranks_per_node. A plan that
cannot be read or broken sharding rules are a one-line error with exit status 2. Nothing here
imports torch (the probe and the compute measurement run inside train.py), so it starts fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import sys

from hydra import compose, initialize_config_dir

from amsp.errors import InputError
from configs.schema import register_configs

from .compute_profile import load_profile
from .cost_model import CostModel
from .from_config import cluster_spec, options_from_config, planner_config, precision_name, workload_from_config
from .report import NoFeasiblePlan, cluster_json, format_table, plan_cost_json
from .simulate import DEFAULT_GPUS, format_simulation, simulate
from .solve import parse_plan, plan_cluster, price_plan

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


def compose_config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="train", overrides=overrides)


def inputs_json(cfg, w, cluster, options, model: CostModel) -> dict:
    """What the plans were priced with: workload, cluster figures, options, where compute came from."""
    workload = {"model": dataclasses.asdict(w.model), "seq_len": w.seq_len, "micro_batch_size": w.micro_batch_size,
                "micro_batches": w.micro_batches, "precision": precision_name(cfg, cluster),
                "param_bytes": w.precision.param_bytes, "grad_bytes": w.precision.grad_bytes,
                "recompute": w.recompute, "tp": w.tp, "pp": w.pp, "params_per_replica": w.params_per_rank()}
    opts = dataclasses.asdict(options)
    return {"workload": workload, "cluster": cluster_json(cluster), "options": opts,
            "bandwidth_source": cluster.source, "compute_source": model.compute_source}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in ("plan", "simulate") else "plan"
    ap = argparse.ArgumentParser(prog="python -m amsp.planner [plan|simulate]", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default=",".join(map(str, DEFAULT_GPUS)), help="simulate: GPU counts")
    ap.add_argument("--json", action="store_true", help="print JSON on stdout instead of the tables")
    ap.add_argument("--price", action="append", default=[], metavar="PLAN",
                    help="price this plan instead of solving: a preset (ddp, zero1, zero2, zero3, hsdp), "
                         "P/G/OS, or P/G/OS|P/G/OS for blocks | embedding+head; repeatable")
    ap.add_argument("--compute-profile", metavar="FILE",
                    help="JSON with block_forward_s, block_backward_s, head_forward_backward_s, embedding_s "
                         "[, overlap_slowdown] (compute_profile.ComputeProfile): measured compute instead "
                         "of FLOPs at amsp.planner.mfu")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama2_13b cluster=a800x8")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        return _run(mode, args)
    except (NoFeasiblePlan, ValueError, InputError) as e:  # PlanError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(mode: str, args) -> int:
    cfg = compose_config(args.overrides)
    cluster = cluster_spec(cfg)
    profile = load_profile(args.compute_profile) if args.compute_profile else None
    options = options_from_config(cfg, profile)
    p = planner_config(cfg)
    out = (lambda s: None) if args.json else print
    out(cluster.describe())
    if mode == "simulate":
        r = cluster.ranks_per_node
        rows = simulate(lambda n: workload_from_config(cfg, cluster.with_shape(max(1, n // r), min(r, n))),
                        cluster, options, [int(x) for x in args.gpus.split(",")])
        if args.json:
            print(json.dumps({"simulation": rows, "cluster": cluster_json(cluster)}))
            return 0
        print(f"model {cfg.model.name}, seq_len {cfg.data.seq_len}, micro-batch {cfg.trainer.micro_batch_size}, "
              f"recomputation {cfg.model.activation_checkpointing}, assumed MFU of compute {options.mfu:.0%}")
        print(format_simulation(rows))
        return 0
    w = workload_from_config(cfg, cluster)
    model = CostModel(w, cluster, options)
    out(f"model {cfg.model.name}: {w.params_per_rank() / 1e9:.2f}B parameters per replica, seq_len {w.seq_len}, "
        f"{w.micro_batches} micro-batch(es) of {w.micro_batch_size} per rank, {precision_name(cfg, cluster)}, "
        f"recomputation {w.recompute}, tp {w.tp}, pp {w.pp}; compute from {model.compute_source}")
    if args.price:
        plans = [parse_plan(text, model.dp_world, model.dp_per_node) for text in args.price]
        costs = [price_plan(w, cluster, options, plan) for plan in plans]
        if args.json:
            print(json.dumps({"priced": [plan_cost_json(c) for c in costs],
                              "inputs": inputs_json(cfg, w, cluster, options, model)}))
        else:
            print(format_table(costs, "priced plans (total > device memory = does not fit):"))
        return 0
    res = plan_cluster(w, cluster, options, top_k=p.top_k, time_limit_s=p.time_limit_s)
    if args.json:
        print(json.dumps({**res.to_json(), "inputs": inputs_json(cfg, w, cluster, options, model)}))
    else:
        print(res.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
