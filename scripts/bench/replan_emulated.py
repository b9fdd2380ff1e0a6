"""Re-planning end to end on the emulated cluster (issue 15, item 5): an automatic plan chosen from a
wrong prior switches to a better one from what the run measures, and the run ends sooner than staying.

Train.py runs of the same model, batch and seed on 2 emulated nodes x 2 ranks (netns_cluster.py,
links shaped to --rate), the probe off so the planner starts from the `cpu` preset's alpha-beta figures
(2 GB/s inter-node: 10x the 1600 Mbit/s = 0.2 GB/s link by default):
  replan    amsp.plan=auto, amsp.planner.recheck_steps=K, amsp.planner.replan=true: after K steps the
            run times the links (amsp.planner.recheck_probe), compares measured with predicted, refits
            and, for a plan predicted >= 5% faster, switches through a checkpoint;
  stay      the same with replan=false: the recheck reports, the prior's plan trains to the end;
  named     (after a switch) the prior's plan named by hand with replan=true: a plan the user named is
            never replaced;
  sequence  (after a switch) the replan run's two plans named by hand without a recheck: the first to
            the switch step, then resumed from its checkpoint with the second.
Reported: each run's plans, the switch step, wall time (launch to exit, every startup, the recheck's
probe and the switch's checkpoint included), the sum of its step times, the median step before and
after the switch, the largest loss difference from the `stay` run (another plan after the switch: fp32
reductions in another order) and the replan run's largest relative loss difference from `sequence`
(the cross-plan tolerance, 1e-6 in tests/training/test_continuation.py).

    python scripts/bench/replan_emulated.py --json /tmp/rp/emulated.json       # root + iproute2
    python scripts/bench/replan_emulated.py --rate 200mbit --prior-inter-gbs 0.25    # 10x the 0.025 GB/s link
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import netns_cluster as nc  # noqa: E402

BASE = ["model=tiny", "trainer.global_batch_size=8", "trainer.micro_batch_size=1",
        "trainer.val_samples=0", "trainer.checkpoint_interval=0", "trainer.log_interval=1",
        "logging.wandb.mode=disabled", "logging.plot=false", "amsp.planner.probe=false",
        "amsp.planner.probe_cache=false"]  # the recheck measures the links afresh: no earlier run's probe


def read_run(run_dir: str) -> dict:
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if x.strip()]
    steps = {}
    for r in rows:  # a resumed (switched) run logs its steps again from the checkpoint on: keep the last
        if r.get("loss") is not None and r.get("step") is not None:
            steps[int(r["step"])] = r
    history = []
    path = os.path.join(run_dir, "replan.json")
    if os.path.exists(path):
        history = json.load(open(path))
    return {"losses": {s: steps[s]["loss"] for s in sorted(steps)},
            "step_s": {s: steps[s]["step_time_s"] for s in sorted(steps)}, "replan": history}


def launch(cluster, name: str, extra: list[str], out: str, timeout: float) -> dict:
    run_dir = os.path.join(out, name)
    argv = [sys.executable, os.path.join(ROOT, "train.py"), *BASE, *extra, f"trainer.output_dir={out}",
            f"trainer.run_name={name}"]
    t0 = time.monotonic()
    log_dir = os.path.join(out, f"{name}-logs")
    os.makedirs(log_dir, exist_ok=True)
    res = cluster.launch(argv, ranks_per_node=2, timeout_s=timeout, log_dir=log_dir)
    wall = time.monotonic() - t0
    if not res.ok:
        tail = "\n".join(r.log[-1500:] for r in res.ranks if r.returncode not in (0, None))[-3000:]
        raise SystemExit(f"run {name} failed (timed out: {res.timed_out}):\n{tail}")
    got = read_run(run_dir)
    got["wall_s"] = wall
    got["plan_lines"] = [line.split("] ", 1)[-1] for line in res.ranks[0].log.splitlines()
                         if "chosen plan" in line or "planner recheck" in line or "switching" in line][:12]
    return got


def switch_step(run: dict) -> int | None:
    for h in run["replan"]:
        if h.get("switched_at_step") is not None:
            return int(h["switched_at_step"])
    return None


def summary(runs: dict) -> dict:
    ref = runs["stay"]["losses"]
    out = {}
    for name, r in runs.items():
        sw = switch_step(r)
        steps = sorted(r["step_s"])
        before = [r["step_s"][s] for s in steps if 1 < s <= (sw or steps[-1])]
        after = [r["step_s"][s] for s in steps if sw is not None and s > sw + 1]
        common = [s for s in r["losses"] if s in ref]
        out[name] = {"switch_at_step": sw, "wall_s": r["wall_s"], "sum_step_s": sum(r["step_s"].values()),
                     "median_step_before_s": statistics.median(before) if before else None,
                     "median_step_after_s": statistics.median(after) if after else None,
                     "final_loss": r["losses"][steps[-1]] if steps else None,
                     "max_loss_diff_vs_stay": max(abs(r["losses"][s] - ref[s]) for s in common) if common else None}
    if "sequence" in runs:  # the cross-plan check: the same plan sequence, uninterrupted by a recheck
        seq, rep = runs["sequence"]["losses"], runs["replan"]["losses"]
        out["replan"]["max_loss_rel_diff_vs_sequence"] = max(abs(rep[s] - seq[s]) / abs(seq[s])
                                                             for s in seq if s in rep)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="1600mbit", help="emulated link rate (tc units)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128, help="shorter: less compute to hide communication behind")
    ap.add_argument("--recheck", type=int, default=4)
    ap.add_argument("--prior-inter-gbs", type=float, help="the prior's inter-node bandwidth (cluster."
                    "inter_bandwidth_gbs; default: the cpu preset's 2 GB/s)")
    ap.add_argument("--prior-intra-gbs", type=float, help="the prior's intra-node bandwidth (default: the preset's)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per run")
    ap.add_argument("--json")
    ap.add_argument("--out", help="run directories and rank logs (default: a new temporary directory, kept)")
    a = ap.parse_args()
    problems = nc.check_requirements()
    if problems:
        raise SystemExit("; ".join(problems))
    prior = []
    if a.prior_inter_gbs:
        prior.append(f"cluster.inter_bandwidth_gbs={a.prior_inter_gbs}")
    if a.prior_intra_gbs:
        prior.append(f"cluster.intra_bandwidth_gbs={a.prior_intra_gbs}")
    common = [f"data.seq_len={a.seq_len}", f"trainer.max_steps={a.steps}", f"amsp.planner.recheck_steps={a.recheck}",
              *prior]
    runs = {}
    t0 = time.time()
    out = a.out or tempfile.mkdtemp(prefix="replan-")
    os.makedirs(out, exist_ok=True)
    print(f"runs in {out}", file=sys.stderr)
    with nc.NetnsCluster(2, rate=a.rate) as cluster:
        for name, extra in (("replan", ["amsp.planner.replan=true"]), ("stay", ["amsp.planner.replan=false"])):
            runs[name] = launch(cluster, name, common + extra, out, a.timeout)
            print(f"[{time.time() - t0:.0f}s] {name}: wall {runs[name]['wall_s']:.1f} s, switch at "
                  f"{switch_step(runs[name])}", file=sys.stderr)
        switched = [h for h in runs["replan"]["replan"] if h.get("from_degrees")]
        if switched:  # the prior's plan, named by hand: the recheck may only report
            named = [f"amsp.{k}={v}" for k, v in switched[0]["from_degrees"].items()] + ["amsp.planner.replan=true"]
            runs["named"] = launch(cluster, "named", common + named, out, a.timeout)
            print(f"[{time.time() - t0:.0f}s] named: wall {runs['named']['wall_s']:.1f} s, switch at "
                  f"{switch_step(runs['named'])}", file=sys.stderr)
            # the replan run's plan sequence without a recheck: the first plan to the switch step, then
            # resumed from its final checkpoint with the second (what the replan run's losses must equal)
            k, fixed = switched[0]["switched_at_step"], [f"data.seq_len={a.seq_len}", "amsp.planner.recheck_steps=0",
                                                         *prior]
            first = launch(cluster, "sequence", fixed + [f"trainer.max_steps={k}"] + [
                f"amsp.{d}={v}" for d, v in switched[0]["from_degrees"].items()], out, a.timeout)
            runs["sequence"] = launch(cluster, "sequence", fixed + [f"trainer.max_steps={a.steps}"] + [
                f"amsp.{d}={v}" for d, v in switched[0]["to_degrees"].items()], out, a.timeout)
            runs["sequence"]["wall_s"] += first["wall_s"]
            print(f"[{time.time() - t0:.0f}s] sequence: wall {runs['sequence']['wall_s']:.1f} s", file=sys.stderr)
    result = {"rate": a.rate, "seq_len": a.seq_len, "steps": a.steps, "recheck_steps": a.recheck, "prior": prior,
              "summary": summary(runs),
              "runs": runs, "wall_s": time.time() - t0}
    print(json.dumps(result["summary"], indent=1))
    if a.json:
        json.dump(result, open(a.json, "w"), indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
