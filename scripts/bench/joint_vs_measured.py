"""Joint planner check: predicted step time of (tp, pp, dp, AMSP degrees, micro-batch) configurations
against train.py runs of the same configurations on this machine's ranks.

Each configuration runs `train.py` on 4 ranks posing as 2 nodes of 2 (torchrun over loopback, or
inside the emulated cluster of netns_cluster.py with a link rate) for a few steps; the measured step
time is the median of the steps after the first two. Before them, a worker launched the same way
measures what train.py's startup measures: the collective probe, and per micro-batch size the units'
forward + backward at tp 1 (compute_profile.py) and tp 2 (amsp/parallel/tp_profile.py, on real TP
groups), with the overlap slowdown. The prediction prices each configuration with
amsp.planner.joint.price_config on the cpu preset with those measurements merged in, its 4 ranks
sharing this machine's cores (ClusterSpec.shared_cores). Reports Spearman(predicted, measured), each
prediction's error, and whether the planner's first choice among the configurations is within 5% of
the fastest measured. The first 21 configurations are AMSP plans alone (tp = pp = 1).

    python scripts/bench/joint_vs_measured.py --json /tmp/jb/loopback.json --markdown /tmp/jb/loopback.md
    python scripts/bench/joint_vs_measured.py --rate 200mbit --json /tmp/jb/200mbit.json   # needs root + iproute2
    python scripts/bench/joint_vs_measured.py --slow-node 0.5 --json /tmp/jb/mixed.json    # needs root + cgroup v1
    python scripts/bench/joint_vs_measured.py --amsp-only --rate 1600mbit   # 21 AMSP plans, AMSP planner prices too

--slow-node Q: the mixed-cluster check (joint_vs_measured_mixed.py): node 1 slowed to Q of a core, the
node types' units measured per node, MIXED_CONFIGS priced and run, then train.py's own startup.
--reprice JSON prices an earlier run (either kind) again.
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

import slow_node  # noqa: E402
from torchrun_cmd import torchrun_cmd  # noqa: E402
from planner_vs_measured import spearman  # noqa: E402

MODEL = ["model=tiny", "data.seq_len=128", "trainer.global_batch_size=16", "optim.warmup_steps=2"]
# (tp, pp, p/g/os on the DP group, micro-batch size) on 4 ranks posing as 2 nodes of 2.
# Every AMSP plan of the 4-rank DP group at micro-batch 1 and 2 (issue 15's >= 20 plans), then
# tensor- and pipeline-parallel layouts (issue 16's >= 30 configurations in all).
DP_DEGREES = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 2), (1, 2, 4), (1, 4, 4), (2, 2, 2), (2, 2, 4), (2, 4, 4),
              (4, 4, 4)]
CONFIGS = [(1, 1, d, m) for m in (1, 2) for d in DP_DEGREES] + [(1, 1, (2, 2, 2), 4)] + [
    (2, 1, (1, 1, 1), 2), (2, 1, (1, 1, 2), 2), (2, 1, (2, 2, 2), 2), (2, 1, (2, 2, 2), 4), (2, 1, (1, 2, 2), 1),
    (1, 2, (1, 1, 1), 2), (1, 2, (1, 1, 2), 2), (1, 2, (2, 2, 2), 2), (1, 2, (2, 2, 2), 1), (1, 2, (1, 2, 2), 4),
    (2, 2, (1, 1, 1), 1), (2, 2, (1, 1, 1), 2), (1, 4, (1, 1, 1), 1), (1, 4, (1, 1, 1), 2),
]
RANKS, RANKS_PER_NODE = 4, 2
def run_config(tp, pp, deg, mbs, steps, rate, workdir, split=None, placed=False) -> float | None:
    """Median step seconds of train.py at this configuration; deg None: amsp.plan=auto (the AMSP planner
    chooses at startup, its table lands in RUN_DIR/plan.txt). split: blocks per stage (None: train.py's
    default); placed: ranks join the emulated nodes' cgroups (slow_node.py)."""
    name = (f"tp{tp}pp{pp}_{'-'.join(map(str, deg)) if deg else 'auto'}_mbs{mbs}"
            + (f"_split{'-'.join(map(str, split))}" if split else ""))
    plan = (["amsp.plan=auto"] if deg is None else
            [f"amsp.p={deg[0]}", f"amsp.g={deg[1]}", f"amsp.os={deg[2]}", "amsp.plan=custom"])
    layers = [f"parallel.layer_split=[{','.join(map(str, split))}]"] if split else []
    got = run_train(name, [f"parallel.tp={tp}", f"parallel.pp={pp}", *layers, *plan,
                           f"trainer.micro_batch_size={mbs}"], steps, rate, workdir, placed)
    if got is not None and deg is None:
        print((open(os.path.join(workdir, name, "plan.txt")).read()), file=sys.stderr)
    return got


def run_train(name: str, args: list[str], steps: int, rate, workdir, placed=False, env=None) -> float | None:
    """train.py on the 4 ranks with MODEL and `args` for `steps` steps: the median step seconds after the
    first two (None, said on stderr, when it failed)."""
    args = [*MODEL, *args, f"trainer.max_steps={steps}", "trainer.log_interval=1", "trainer.val_samples=0",
            "trainer.checkpoint_interval=0", "logging.wandb.mode=disabled", "logging.plot=false",
            f"trainer.output_dir={workdir}", f"trainer.run_name={name}", "amsp.ranks_per_node=2",
            "amsp.planner.recheck_steps=0"]
    cmd = launch_cmd(rate, "train.py", args, workdir, placed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).splitlines()
        keep = os.path.join(tempfile.gettempdir(), f"joint_vs_measured_{name}.log")  # outlives the work dir
        with open(keep, "w") as f:
            f.write("\n".join(out))
        why = [ln for ln in out if "input error" in ln or "Error" in ln or "exitcode" in ln or "terminate" in ln]
        print(f"  {name}: failed ({proc.returncode}), output in {keep}:", *(why[-4:] or out[-3:]), sep="\n    ",
              file=sys.stderr)
        return None
    recs = [json.loads(x) for x in open(os.path.join(workdir, name, "metrics.jsonl"))]
    return statistics.median(r["step_time_s"] for r in recs if r["step"] > 2)


def optimizer_rate(got: dict) -> float | None:
    """The measured AdamW seconds per element (compute_profile.time_optimizer), median over the sizes the
    worker measured; None from a measurement taken before it was timed."""
    rates = [v["optimizer_s_per_elem"] for v in got["by_mbs"].values() if v.get("optimizer_s_per_elem")]
    return statistics.median(rates) if rates else None


def predict(tp, pp, deg, mbs, eff_by_mbs, slowdown, points, cfg_overrides, units, opt_rate=None) -> float | None:
    from amsp.plan import Degrees
    from dataclasses import replace

    from amsp.planner.__main__ import compose_config
    from amsp.planner.from_config import cluster_spec, cpu_shared_cores
    from amsp.planner.joint.hetero import from_spec
    from amsp.planner.joint.search import price_config
    from amsp.schedule import Precision
    from configs.schema import to_llama_config

    cfg = compose_config([*MODEL, *cfg_overrides])
    spec = cluster_spec(cfg, nodes=2, ranks_per_node=2, local_ranks=4, device="cpu")
    if points is not None:  # the measured collective curves merged into the preset, as train.py does
        from amsp.planner.probe import apply_points

        spec = apply_points(spec, *points)
    # the 2 emulated nodes share this machine: its 4 ranks, one thread each, share its cores
    spec = replace(spec, shared_cores=cpu_shared_cores(RANKS, threads=1))
    res = price_config(to_llama_config(cfg.model), from_spec(spec), seq_len=int(cfg.data.seq_len),
                       global_batch=int(cfg.trainer.global_batch_size), precision=Precision.named("fp32"), tp=tp,
                       pp=pp, micro_batch_size=mbs, degrees=Degrees(*deg), efficiency={spec.name: eff_by_mbs[mbs]},
                       reserved_bytes=0, overlap_slowdown=slowdown,
                       unit_times={(spec.name, t, m): v for (t, m), v in units.items()},
                       optimizer_s_per_elem={spec.name: opt_rate} if opt_rate else None)
    return None if res is None else res[0]


def predict_amsp(deg, mbs, got: dict, points, cfg_overrides) -> float:
    """The AMSP planner's own prediction (amsp/planner/cost_model.py), priced from the inputs train.py's
    startup gives it (from_config: the cpu preset with the probe merged in, the measured compute profile
    of this micro-batch size): what `amsp.plan=auto` ranks plans by, apart from the joint planner."""
    from amsp.plan import Degrees, make_plan
    from amsp.planner.__main__ import compose_config
    from amsp.planner.compute_profile import ComputeProfile
    from amsp.planner.cost_model import CostModel
    from amsp.planner.from_config import cluster_spec, options_from_config, workload_from_config
    from amsp.planner.probe import apply_points

    cfg = compose_config([*MODEL, *cfg_overrides, f"trainer.micro_batch_size={mbs}"])
    spec = apply_points(cluster_spec(cfg, nodes=2, ranks_per_node=RANKS_PER_NODE, local_ranks=RANKS, device="cpu"),
                        *points)
    m = got["by_mbs"][str(mbs)] if str(mbs) in got["by_mbs"] else got["by_mbs"][mbs]
    block, head, emb = m["units"]["1"] if "1" in m["units"] else m["units"][1]
    prof = ComputeProfile(m["block_forward_s"], block - m["block_forward_s"], head, emb, m["overlap_slowdown"],
                          "measured by the bench's worker", optimizer_s_per_elem=m.get("optimizer_s_per_elem"))
    w = workload_from_config(cfg, spec)
    plan = make_plan("custom", RANKS, RANKS_PER_NODE, blocks=Degrees(*deg))
    return CostModel(w, spec, options_from_config(cfg, prof)).evaluate(plan).step_time_s


def efficiency(mbs: int, block_forward_s: float) -> float:
    """One block's forward (timed on the 4 ranks at once, as train.py times it) against its FLOPs at the
    cpu preset's measured peak: what units without a measured time are priced with."""
    from amsp.planner.__main__ import compose_config
    from amsp.planner.from_config import cluster_spec
    from amsp.planner.workload import Workload
    from amsp.schedule import Precision
    from configs.schema import to_llama_config

    cfg = compose_config(MODEL)
    spec = cluster_spec(cfg, nodes=2, ranks_per_node=RANKS_PER_NODE, local_ranks=RANKS, device="cpu")
    w = Workload(to_llama_config(cfg.model), int(cfg.data.seq_len), mbs, 1, Precision.named("fp32"))
    return min(1.0, w.block_forward_flops() / (block_forward_s * spec.peak_flops))


def measure_worker(path: str, sizes: list[int], per_node: bool = False) -> None:
    """Launched on the 4 ranks exactly as the runs are (torchrun, or inside the emulated cluster): what
    train.py's startup measures, for each micro-batch size: one block, the head and the embedding timed
    with the overlap slowdown (compute_profile.py), the tensor-parallel units at tp 2 on real TP groups
    (amsp/parallel/tp_profile.py); once, the collective probe of the 2 x 2 layout (probe.py).
    per_node: the same units, but each node's own (median over its ranks; `by_node`), as a startup on a
    mixed cluster would keep one profile per node type (compute_profile keeps the median over all ranks,
    tp_profile the slowest)."""
    import torch

    from amsp.launch import init_distributed
    from amsp.parallel.tp_profile import measure_tp_units
    from amsp.planner.__main__ import compose_config
    from amsp.planner.compute_profile import measure_profile
    from amsp.planner.from_config import cpu_shared_cores
    from amsp.planner.probe import _to_json, probe_points, probe_sizes
    from amsp.topology import Topology
    from configs.schema import to_llama_config

    denv = init_distributed(backend="gloo")
    cfg = compose_config(MODEL)
    model, seq = to_llama_config(cfg.model), int(cfg.data.seq_len)
    out = {"by_node": {}} if per_node else {"by_mbs": {}}
    for mbs in sizes:
        if per_node:
            from joint_vs_measured_mixed import node_units

            for node, v in node_units(model, seq, mbs, denv.world_size).items():
                out["by_node"].setdefault(node, {"by_mbs": {}})["by_mbs"][mbs] = v
            continue
        prof = measure_profile(model, seq, mbs, "fp32", "none", "cpu", denv.world_size, denv.rank, None, False,
                               cores_shared=cpu_shared_cores(RANKS, threads=1) is not None)
        tp2 = measure_tp_units(model, seq, mbs, "fp32", "cpu", 2, denv.world_size, repeats=5)
        out["by_mbs"][mbs] = {"block_forward_s": prof.block_forward_s, "overlap_slowdown": prof.overlap_slowdown,
                              "optimizer_s_per_elem": prof.optimizer_s_per_elem,
                              "units": {1: [prof.block_forward_s + prof.block_backward_s,
                                            prof.head_forward_backward_s, prof.embedding_s],
                                        2: [tp2.block_s, tp2.head_s, tp2.embedding_s]}}
    points, _ = probe_points(Topology(denv.world_size, RANKS_PER_NODE), denv.rank, torch.device("cpu"), None, False,
                             probe_sizes(64 * 2**20), 4.0)
    out["points"] = _to_json(points)
    if denv.rank == 0:
        json.dump(out, open(path, "w"))
    # gloo's threads torn down before the interpreter's exit: a rank left to exit with a live group can
    # abort in its destructor ("terminate called without an active exception"), most often a throttled one
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(sizes: list[int], rate: str | None, placed: bool = False, per_node: bool = False) -> dict:
    """measure_worker's results, run on the same 4 ranks (and links) as the configurations."""
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "measured.json")
        cmd = launch_cmd(rate, os.path.abspath(__file__), ["--measure-worker", path, "--sizes",
                                                           ",".join(map(str, sizes)),
                                                           *(["--per-node"] if per_node else [])], work, placed)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
        if proc.returncode != 0 or not os.path.exists(path):
            raise SystemExit(f"measurement failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.load(open(path))


def launch_cmd(rate: str | None, script: str, args: list[str], work: str, placed: bool = False) -> list[str]:
    """The command that runs `script` on 4 ranks: torchrun over loopback, or the emulated 2 x 2 cluster;
    placed: each rank first joins its emulated node's cgroups (slow_node.py, loopback only)."""
    if placed:
        if rate:
            raise SystemExit("--slow-node runs over loopback; leave --rate out")
        return torchrun_cmd(RANKS, [*slow_node.shim_args(script, RANKS_PER_NODE), *args], work)
    if rate:
        return [sys.executable, os.path.join(HERE, "netns_cluster.py"), "run", "--nodes", "2", "--ranks-per-node",
                str(RANKS_PER_NODE), "--rate", rate, "--", sys.executable, script, *args]
    return torchrun_cmd(RANKS, [script, *args], work)


def pricing_inputs(got: dict):
    """(efficiency by mbs, units {(tp, mbs): seconds}, overlap slowdown, probe points) from measure()."""
    from amsp.planner.probe import _from_json

    by_mbs = {int(m): v for m, v in got["by_mbs"].items()}
    eff = {m: efficiency(m, v["block_forward_s"]) for m, v in by_mbs.items()}
    units = {(int(tp), m): tuple(t) for m, v in by_mbs.items() for tp, t in v["units"].items()}
    slowdown = statistics.median(v["overlap_slowdown"] for v in by_mbs.values())
    return eff, units, slowdown, (_from_json(got["points"]), "probe")


def prediction_stats(rows: list[dict], key: str, label) -> tuple[int, dict] | None:
    """(rows priced and run, Spearman / errors / first choice of the predictions in rows[*][key] against
    the runs); None with fewer than 3. label(row) names the first choice."""
    ok = [r for r in rows if r.get(key) and r["measured_s"]]
    if len(ok) < 3:
        return None
    errs = [(r[key] - r["measured_s"]) / r["measured_s"] for r in ok]
    first = min(ok, key=lambda r: r[key])
    return len(ok), {"spearman": spearman([r[key] for r in ok], [r["measured_s"] for r in ok]),
                     "within_20pct": sum(abs(e) <= 0.2 for e in errs),
                     "median_abs_error": statistics.median(map(abs, errs)), "worst_error": max(errs, key=abs),
                     "first_choice": label(first),
                     "first_choice_vs_fastest": first["measured_s"] / min(r["measured_s"] for r in ok)}


def amsp_planner_summary(rows: list[dict]) -> dict | None:
    """The AMSP planner's own predictions (predict_amsp) of the data-parallel rows against the runs."""
    got = prediction_stats(rows, "predicted_amsp_s", lambda r: f"{'/'.join(map(str, r['degrees']))} mbs{r['mbs']}")
    return None if got is None else {"configs": got[0], **got[1]}


def summarize(rows: list[dict], rate: str | None, got: dict, t0: float, a) -> None:
    eff, units, slowdown, _ = pricing_inputs(got)
    ok = [r for r in rows if r["predicted_s"] and r["measured_s"]]
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]) if len(ok) > 2 else float("nan")
    errs = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in ok]
    first = min(ok, key=lambda r: r["predicted_s"]) if ok else None
    fastest = min(ok, key=lambda r: r["measured_s"]) if ok else None
    dp_only = [r for r in ok if r["tp"] == 1 and r["pp"] == 1]
    summary = {"rate": rate or "loopback (unshaped)", "configs": len(rows), "priced_and_ran": len(ok),
               "spearman": rho, "within_20pct": sum(e <= 0.2 for e in errs), "median_error": statistics.median(errs)
               if errs else None, "first_choice_vs_fastest": (first["measured_s"] / fastest["measured_s"])
               if ok else None,
               "amsp_plans_only": {"configs": len(dp_only), "spearman": spearman(
                   [r["predicted_s"] for r in dp_only], [r["measured_s"] for r in dp_only]) if len(dp_only) > 2
                   else float("nan"),
                   "within_20pct": sum(abs(r["predicted_s"] - r["measured_s"]) <= 0.2 * r["measured_s"]
                                       for r in dp_only),
                   "first_choice_vs_fastest": min(dp_only, key=lambda r: r["predicted_s"])["measured_s"]
                   / min(r["measured_s"] for r in dp_only) if dp_only else None},
               "amsp_planner": amsp_planner_summary(dp_only),
               "wall_s": time.time() - t0, "efficiency": eff, "overlap_slowdown": slowdown,
               "optimizer_s_per_elem": optimizer_rate(got),
               "bandwidth": "probe" + (f" inside the emulated cluster (link {rate})" if rate else ""),
               "units": {f"tp{tp} mbs{m}": t for (tp, m), t in units.items()}}

    def line(r: dict) -> str:
        amsp = r.get("predicted_amsp_s")
        return (f"| {r['tp']} | {r['pp']} | {'/'.join(map(str, r['degrees']))} | {r['mbs']} | {_s(r['predicted_s'])} "
                f"| {_s(amsp)} | {_s(r['measured_s'])} | {_err(r['predicted_s'], r['measured_s'])} "
                f"| {_err(amsp, r['measured_s'])} |\n")

    write_results(a, summary, rows, got, "| tp | pp | p/g/os | mbs | predicted s (joint) | AMSP planner s | measured s "
                  "| error (joint) | error (AMSP) |\n|---|---|---|---|---|---|---|---|---|\n", line)


def _s(seconds: float | None) -> str:
    return f"{seconds:.3f}" if seconds else "-"


def _err(predicted: float | None, measured: float | None) -> str:
    return f"{(predicted - measured) / measured:+.0%}" if predicted and measured else "-"


def write_results(a, summary: dict, rows: list[dict], got: dict, header: str, line) -> None:
    """The summary on stdout; with --json every row and the measurements; with --markdown the table."""
    print(json.dumps(summary, indent=1))
    if a.json:
        json.dump({"summary": summary, "rows": rows, "measured": got}, open(a.json, "w"), indent=1)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(header)
            for r in rows:
                f.write(line(r))


def overrides_for(rate: str | None) -> list[str]:
    """The planner is told the emulated link, as a user would set cluster.* for their fabric."""
    return [f"cluster.inter_bandwidth_gbs={float(rate.removesuffix('mbit')) / 8e3}"] if rate else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default=None, help="emulated inter-node link rate (netns_cluster.py), e.g. 200mbit")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--limit", type=int, default=0, help="first N configurations only")
    ap.add_argument("--amsp-only", action="store_true", help="the 21 data-parallel configurations (AMSP plans) only")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--auto", action="store_true", help="run amsp.plan=auto (DP only) at micro-batch 1 and 2 "
                    "and compare with the fastest AMSP plan of the same size in --against")
    ap.add_argument("--against", metavar="JSON", help="an earlier --json of the same links (for --auto)")
    ap.add_argument("--reprice", metavar="JSON", help="price the runs and measurements of an earlier --json again "
                                                        "with the current cost model (nothing is run)")
    ap.add_argument("--slow-node", type=float, metavar="Q", help="a mixed cluster: node 1 slowed to Q of a core "
                    "(slow_node.py; root, cgroup v1), joint_vs_measured_mixed.MIXED_CONFIGS run and priced on it")
    ap.add_argument("--unit-measurements", type=int, default=3, metavar="N", help="--slow-node: measure the "
                    "mixed layout's per-node units N times and price with the median")
    ap.add_argument("--startup-runs", type=int, default=3, metavar="N", help="--slow-node: then N independent "
                    "train.py startups with parallel.auto and the two node groups named (parallel.cluster_file)")
    ap.add_argument("--without-optimizer-rate", action="store_true", help="--reprice: drop the measured AdamW "
                    "rate (the preset's memory bandwidth prices the optimizer step)")
    ap.add_argument("--measure-worker", metavar="PATH", help=argparse.SUPPRESS)  # internal: one rank's measurement
    ap.add_argument("--sizes", default="1", help=argparse.SUPPRESS)
    ap.add_argument("--per-node", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure_worker:
        measure_worker(a.measure_worker, [int(x) for x in a.sizes.split(",")], a.per_node)
        return 0
    t0 = time.time()
    if a.reprice and "quota" in json.load(open(a.reprice))["summary"]:  # an earlier --slow-node run
        a.slow_node = json.load(open(a.reprice))["summary"]["quota"]
    if a.slow_node:
        from joint_vs_measured_mixed import mixed_main

        return mixed_main(a, t0)
    if a.auto:
        rows = json.load(open(a.against))["rows"] if a.against else []
        with tempfile.TemporaryDirectory() as work:
            for mbs in (1, 2):
                got = run_config(1, 1, None, mbs, a.steps, a.rate, work)
                same = [r["measured_s"] for r in rows
                        if r["tp"] == r["pp"] == 1 and r["mbs"] == mbs and r["measured_s"]]
                vs = f", {got / min(same):.3f}x the fastest AMSP plan at mbs {mbs} ({min(same):.3f} s)" if same else ""
                print(f"amsp.plan=auto mbs {mbs}: {got:.3f} s/step{vs}")
        return 0
    if a.reprice:
        old = json.load(open(a.reprice))
        got, rate = old["measured"], old["summary"]["rate"]
        if a.without_optimizer_rate:
            for v in got["by_mbs"].values():
                v["optimizer_s_per_elem"] = None
        rate = None if rate.startswith("loopback") else rate
        eff, units, slowdown, points = pricing_inputs(got)
        rows = [{**r, "degrees": tuple(r["degrees"]),
                 "predicted_s": predict(r["tp"], r["pp"], tuple(r["degrees"]), r["mbs"], eff, slowdown, points,
                                        overrides_for(rate), units, optimizer_rate(got)),
                 "predicted_amsp_s": predict_amsp(tuple(r["degrees"]), r["mbs"], got, points, overrides_for(rate))
                 if r["tp"] == r["pp"] == 1 else None} for r in old["rows"]]
        summarize(rows, rate, got, t0, a)
        return 0
    configs = [c for c in CONFIGS if c[0] == c[1] == 1] if a.amsp_only else CONFIGS
    configs = configs[:a.limit] if a.limit else configs
    got = measure(sorted({c[3] for c in configs}), a.rate)
    eff, units, slowdown, points = pricing_inputs(got)
    print("compute efficiency by micro-batch size:", {k: round(v, 3) for k, v in eff.items()},
          f"overlap slowdown {slowdown:.2f}; units (block, head, embedding s):", units, file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, (tp, pp, deg, mbs) in enumerate(configs):
            pred = predict(tp, pp, deg, mbs, eff, slowdown, points, overrides_for(a.rate), units, optimizer_rate(got))
            amsp = predict_amsp(deg, mbs, got, points, overrides_for(a.rate)) if tp == pp == 1 else None
            meas = run_config(tp, pp, deg, mbs, a.steps, a.rate, work)
            rows.append({"tp": tp, "pp": pp, "degrees": deg, "mbs": mbs, "predicted_s": pred, "measured_s": meas,
                         "predicted_amsp_s": amsp})
            print(f"[{i + 1}/{len(configs)} {time.time() - t0:.0f}s] tp{tp} pp{pp} {deg} mbs{mbs}: predicted "
                  f"{pred if pred is None else round(pred, 4)} measured {meas if meas is None else round(meas, 4)}",
                  file=sys.stderr)
    summarize(rows, a.rate, got, t0, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
