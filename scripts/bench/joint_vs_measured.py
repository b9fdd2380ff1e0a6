"""Joint planner check: predicted step time of (tp, pp, dp, AMSP degrees, micro-batch) configurations
against train.py runs of the same configurations on this machine's ranks.

Each configuration runs `train.py` under torchrun (optionally inside the emulated cluster of
netns_cluster.py with a link rate) for a few steps; the measured step time is the median of the steps
after the first two. The prediction prices the same configuration with amsp.planner.joint.price_config
on the cluster train.py would plan for (the cpu preset with this machine's measured peak, or the link
rate given), with the compute efficiency measured for each micro-batch size (one block's forward,
amsp/planner/compute_profile.py). Reports Spearman(predicted, measured), each prediction's error, and
whether the planner's first choice among the configurations is within 5% of the fastest measured.

    python scripts/bench/joint_vs_measured.py --json /tmp/jb/loopback.json --markdown /tmp/jb/loopback.md
    python scripts/bench/joint_vs_measured.py --rate 200mbit --json /tmp/jb/200mbit.json   # needs root + iproute2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from planner_vs_measured import spearman  # noqa: E402

MODEL = ["model=tiny", "data.seq_len=128", "trainer.global_batch_size=16", "optim.warmup_steps=2"]
# (tp, pp, p/g/os on the DP group, micro-batch size) on 4 ranks posing as 2 nodes of 2
CONFIGS = [
    (1, 1, (1, 1, 1), 1), (1, 1, (1, 1, 1), 2), (1, 1, (1, 1, 4), 2), (1, 1, (1, 4, 4), 2), (1, 1, (4, 4, 4), 2),
    (1, 1, (2, 2, 2), 2), (1, 1, (2, 2, 4), 2), (1, 1, (1, 2, 2), 2), (1, 1, (4, 4, 4), 1), (1, 1, (2, 2, 2), 4),
    (2, 1, (1, 1, 1), 2), (2, 1, (1, 1, 2), 2), (2, 1, (2, 2, 2), 2), (2, 1, (2, 2, 2), 4), (2, 1, (1, 2, 2), 1),
    (1, 2, (1, 1, 1), 2), (1, 2, (1, 1, 2), 2), (1, 2, (2, 2, 2), 2), (1, 2, (2, 2, 2), 1), (1, 2, (1, 2, 2), 4),
    (2, 2, (1, 1, 1), 1), (2, 2, (1, 1, 1), 2), (1, 4, (1, 1, 1), 1), (1, 4, (1, 1, 1), 2),
]


def run_config(tp, pp, deg, mbs, steps, rate, workdir) -> float | None:
    name = f"tp{tp}pp{pp}_{'-'.join(map(str, deg))}_mbs{mbs}"
    args = [*MODEL, f"parallel.tp={tp}", f"parallel.pp={pp}", f"amsp.p={deg[0]}", f"amsp.g={deg[1]}",
            f"amsp.os={deg[2]}", "amsp.plan=custom", f"trainer.micro_batch_size={mbs}", f"trainer.max_steps={steps}",
            "trainer.log_interval=1", "trainer.val_samples=0", "trainer.checkpoint_interval=0",
            "logging.wandb.mode=disabled", "logging.plot=false", f"trainer.output_dir={workdir}",
            f"trainer.run_name={name}", "amsp.ranks_per_node=2", "amsp.planner.recheck_steps=0"]
    if rate:
        cmd = [sys.executable, os.path.join(HERE, "netns_cluster.py"), "run", "--nodes", "2", "--ranks-per-node", "2",
               "--rate", rate, "--", sys.executable, "train.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        print(f"  {name}: failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}",
              file=sys.stderr)
        return None
    recs = [json.loads(x) for x in open(os.path.join(workdir, name, "metrics.jsonl"))]
    return statistics.median(r["step_time_s"] for r in recs if r["step"] > 2)


def predict(tp, pp, deg, mbs, eff_by_mbs, slowdown, points, cfg_overrides) -> float | None:
    from amsp.plan import Degrees
    from amsp.planner.__main__ import compose_config
    from amsp.planner.from_config import cluster_spec
    from amsp.planner.joint.hetero import from_spec
    from amsp.planner.joint.search import price_config
    from amsp.schedule import Precision
    from configs.schema import to_llama_config

    cfg = compose_config([*MODEL, *cfg_overrides])
    spec = cluster_spec(cfg, nodes=2, ranks_per_node=2, local_ranks=4, device="cpu")
    if points is not None:  # the measured collective curves merged into the preset, as train.py does
        from amsp.planner.probe import apply_points

        spec = apply_points(spec, *points)
    res = price_config(to_llama_config(cfg.model), from_spec(spec), seq_len=int(cfg.data.seq_len),
                       global_batch=int(cfg.trainer.global_batch_size), precision=Precision.named("fp32"), tp=tp,
                       pp=pp, micro_batch_size=mbs, degrees=Degrees(*deg), efficiency={spec.name: eff_by_mbs[mbs]},
                       reserved_bytes=0, overlap_slowdown=slowdown)
    return None if res is None else res[0]


def _measure_on_rank(rank: int, world: int, mbs: int):
    """On all 4 ranks at once, as train.py's startup does: the block timing with its overlap slowdown
    (compute_profile.py) and, once, the collective probe (probe.py) of the 2 x 2 layout."""
    import torch

    from amsp.planner.__main__ import compose_config
    from amsp.planner.compute_profile import measure_profile
    from amsp.planner.probe import probe_points, probe_sizes
    from amsp.topology import Topology
    from configs.schema import to_llama_config

    cfg = compose_config(MODEL)
    prof = measure_profile(to_llama_config(cfg.model), int(cfg.data.seq_len), mbs, "fp32", "none", "cpu", world,
                           rank, None, False)
    points = probe_points(Topology(world, 2), rank, torch.device("cpu"), None, False, probe_sizes(64 * 2**20), 4.0)
    return prof.block_forward_s, prof.overlap_slowdown, points


def efficiency(mbs: int) -> tuple[float, float, tuple]:
    """One block's forward at this shape, timed on 4 ranks at once as train.py times it (they share this
    machine's cores as the run's ranks do), against its FLOPs at the cpu preset's measured peak."""
    from amsp.planner.__main__ import compose_config
    from amsp.planner.from_config import cluster_spec
    from amsp.planner.workload import Workload
    from amsp.schedule import Precision
    from configs.schema import to_llama_config
    from tests.distributed import run_distributed

    block_s, slowdown, points = run_distributed(_measure_on_rank, 4, mbs)[0]  # medians, agreed by all
    cfg = compose_config(MODEL)
    model = to_llama_config(cfg.model)
    spec = cluster_spec(cfg, nodes=2, ranks_per_node=2, local_ranks=4, device="cpu")
    w = Workload(model, int(cfg.data.seq_len), mbs, 1, Precision.named("fp32"))
    return min(1.0, w.block_forward_flops() / (block_s * spec.peak_flops)), slowdown, points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default=None, help="emulated inter-node link rate (netns_cluster.py), e.g. 200mbit")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--limit", type=int, default=0, help="first N configurations only")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    t0 = time.time()
    overrides = []
    if a.rate:  # the planner is told the emulated link, as a user would set cluster.* for their fabric
        gbs = float(a.rate.removesuffix("mbit")) / 8e3
        overrides = [f"cluster.inter_bandwidth_gbs={gbs}"]
    configs = CONFIGS[:a.limit] if a.limit else CONFIGS
    measured = {m: efficiency(m) for m in sorted({c[3] for c in configs})}
    eff = {m: v[0] for m, v in measured.items()}
    slowdown = statistics.median(v[1] for v in measured.values() if v[1] is not None)
    points = None if a.rate else measured[min(measured)][2]  # a shaped link: the rate given stands
    print("compute efficiency by micro-batch size:", {k: round(v, 3) for k, v in eff.items()},
          f"overlap slowdown {slowdown:.2f}", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, (tp, pp, deg, mbs) in enumerate(configs):
            pred = predict(tp, pp, deg, mbs, eff, slowdown, points, overrides)
            meas = run_config(tp, pp, deg, mbs, a.steps, a.rate, work)
            rows.append({"tp": tp, "pp": pp, "degrees": deg, "mbs": mbs, "predicted_s": pred, "measured_s": meas})
            print(f"[{i + 1}/{len(configs)} {time.time() - t0:.0f}s] tp{tp} pp{pp} {deg} mbs{mbs}: predicted "
                  f"{pred if pred is None else round(pred, 4)} measured {meas if meas is None else round(meas, 4)}",
                  file=sys.stderr)
    ok = [r for r in rows if r["predicted_s"] and r["measured_s"]]
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]) if len(ok) > 2 else float("nan")
    errs = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in ok]
    first = min(ok, key=lambda r: r["predicted_s"]) if ok else None
    fastest = min(ok, key=lambda r: r["measured_s"]) if ok else None
    summary = {"rate": a.rate or "loopback (unshaped)", "configs": len(rows), "priced_and_ran": len(ok),
               "spearman": rho, "within_20pct": sum(e <= 0.2 for e in errs), "median_error": statistics.median(errs)
               if errs else None, "first_choice_vs_fastest": (first["measured_s"] / fastest["measured_s"])
               if ok else None, "wall_s": time.time() - t0, "efficiency": eff, "overlap_slowdown": slowdown,
               "bandwidth": "probe" if points is not None else f"preset + rate {a.rate}"}
    print(json.dumps(summary, indent=1))
    if a.json:
        json.dump({"summary": summary, "rows": rows}, open(a.json, "w"), indent=1)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write("| tp | pp | p/g/os | mbs | predicted s | measured s | error |\n|---|---|---|---|---|---|---|\n")
            for r in rows:
                e = (f"{(r['predicted_s'] - r['measured_s']) / r['measured_s']:+.0%}"
                     if r["predicted_s"] and r["measured_s"] else "-")
                f.write(f"| {r['tp']} | {r['pp']} | {'/'.join(map(str, r['degrees']))} | {r['mbs']} | "
                        f"{r['predicted_s'] or '-'} | {r['measured_s'] or '-'} | {e} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
