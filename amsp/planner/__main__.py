"""Command line: the planner's table (or a what-if across scales) on any machine, no GPU needed.

    python -m amsp.planner model=llama2_13b cluster=a800x8 cluster.nodes=128 data.seq_len=4096 \\
        trainer.micro_batch_size=1 trainer.global_batch_tokens=4194304
    python -m amsp.planner simulate model=llama2_13b cluster=a800x8 [--gpus 8,16,...,1024] ...

The arguments after the optional mode are Hydra overrides of the same config train.py composes
(configs/train.yaml); the cluster's shape is cluster.nodes x cluster.ranks_per_node.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import sys

from hydra import compose, initialize_config_dir

from configs.schema import register_configs

from .from_config import cluster_spec, options_from_config, planner_config, precision_name, workload_from_config
from .report import NoFeasiblePlan
from .simulate import DEFAULT_GPUS, format_simulation, simulate
from .solve import plan_cluster

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


def compose_config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="train", overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in ("plan", "simulate") else "plan"
    ap = argparse.ArgumentParser(prog="python -m amsp.planner [plan|simulate]", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default=",".join(map(str, DEFAULT_GPUS)), help="simulate: GPU counts")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama2_13b cluster=a800x8")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    cfg = compose_config(args.overrides)
    cluster = cluster_spec(cfg)
    options = options_from_config(cfg)
    p = planner_config(cfg)
    print(cluster.describe())
    try:
        if mode == "simulate":
            r = cluster.ranks_per_node
            rows = simulate(lambda n: workload_from_config(cfg, cluster.with_shape(max(1, n // r), min(r, n))),
                            cluster, options, [int(x) for x in args.gpus.split(",")])
            print(f"model {cfg.model.name}, seq_len {cfg.data.seq_len}, micro-batch {cfg.trainer.micro_batch_size}, "
                  f"recomputation {cfg.model.activation_checkpointing}, assumed MFU of compute {options.mfu:.0%}")
            print(format_simulation(rows))
            return 0
        w = workload_from_config(cfg, cluster)
        print(f"model {cfg.model.name}: {w.params_per_rank() / 1e9:.2f}B parameters per replica, seq_len {w.seq_len}, "
              f"{w.micro_batches} micro-batch(es) of {w.micro_batch_size} per rank, "
              f"{precision_name(cfg, cluster)}, "
              f"recomputation {w.recompute}, tp {w.tp}, pp {w.pp}")
        res = plan_cluster(w, cluster, options, top_k=p.top_k, time_limit_s=p.time_limit_s)
        print(res.table())
        return 0
    except (NoFeasiblePlan, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
