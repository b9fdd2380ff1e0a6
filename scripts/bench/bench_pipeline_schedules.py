"""Pipeline schedules side by side through train.py (CPU, gloo): step time, peak memory and losses.

Each round runs every schedule once, in turn, on the same model, batch and seed (a fresh torchrun
group each, one thread per rank), so the rounds interleave the schedules and a slow spell of the shared
machine hits them alike. Per schedule: the median step time of each run after its first two steps,
the median over the rounds, its ratio to the first schedule listed, the largest rank's peak resident set
(train.py's memory_peak_bytes) and the losses, which must agree across schedules (they run the same
arithmetic in another order: fp32, so to a few 1e-6).

The default shape gives every rank of 2 its own core (pp 2, dp 1) and 4 micro-batches a step, where
1F1B idles each stage for one forward and one backward of the other per step, (pp - 1) / (m + pp - 1)
= 20% of it; zero bubble fills that with weight passes.

--recheck N runs each schedule once with the AMSP planner's plan (amsp.plan=auto) and its recheck after N
steps instead, and tabulates the planner's startup prediction of the step and the tensor peak against what
the recheck measured (RUN_DIR/replan.json): how well the planner prices a hand-named pipeline's schedule.

    python scripts/bench/bench_pipeline_schedules.py                                  # 1f1b vs zero_bubble
    python scripts/bench/bench_pipeline_schedules.py --schedules 1f1b,zero_bubble,interleaved:2 --rounds 3
    python scripts/bench/bench_pipeline_schedules.py --recheck 6 --schedules 1f1b,gpipe,interleaved:2,zero_bubble
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

from torchrun_cmd import torchrun_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2**20


def model_args(a) -> list[str]:
    return ["model=tiny", f"model.dim={a.dim}", f"model.n_layers={a.layers}", f"model.n_heads={a.dim // 64}",
            f"model.n_kv_heads={max(1, a.dim // 256)}", f"model.max_seq_len={a.seq}", f"data.seq_len={a.seq}",
            "model.vocab_size=32000"]


def run_schedule(a, spec: str, workdir: str, round_no: int) -> dict:
    """train.py under one schedule ("name" or "name:virtual_stages"): median step seconds after the first
    two steps, per-step losses, the largest rank's peak RSS (with --recheck: the planner's prediction and
    what its recheck measured)."""
    name, _, v = spec.partition(":")
    run_name = f"{name}{v}_r{round_no}"
    dp = a.ranks // a.pp
    plan = ["amsp.plan=auto", f"amsp.planner.recheck_steps={a.recheck}"] if a.recheck else \
        ["amsp.plan=ddp", "amsp.planner.recheck_steps=0"]
    args = [*model_args(a), f"parallel.pp={a.pp}", f"parallel.schedule={name}",
            f"parallel.virtual_stages={v or 1}", *plan, f"trainer.micro_batch_size={a.mbs}",
            f"trainer.global_batch_size={a.micro * a.mbs * dp}", f"trainer.max_steps={a.steps}",
            "trainer.log_interval=1", "trainer.val_samples=0", "trainer.checkpoint_interval=0",
            "logging.wandb.mode=disabled", "logging.plot=false",
            f"trainer.output_dir={workdir}", f"trainer.run_name={run_name}"]
    cmd = torchrun_cmd(a.ranks, ["train.py", *args], workdir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{spec} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    recs = [json.loads(x) for x in open(os.path.join(workdir, run_name, "metrics.jsonl"))]
    out = {"step_s": statistics.median(r["step_time_s"] for r in recs if r["step"] > 2),
           "losses": [r["loss"] for r in recs], "peak_mib": max(r["memory_peak_bytes"] or 0 for r in recs) / MIB}
    if a.recheck:
        rec = json.load(open(os.path.join(workdir, run_name, "replan.json")))[0]
        prior = rec["predicted_prior"]
        out["recheck"] = {"predicted_step_s": prior["step_time_s"], "measured_step_s": rec["measured"]["step_s"],
                          "predicted_gib": (prior["memory_total"] - prior["memory_bytes"].get("reserved", 0)) / 2**30,
                          "measured_gib": rec["measured"]["peak_bytes"] / 2**30}
    return out


def recheck_table(got: dict) -> list[str]:
    """Per schedule: the planner's predicted step and tensor peak against the recheck's measurements."""
    lines = ["| schedule | predicted step s | measured step s | error | predicted tensors GiB | measured peak GiB "
             "| error |", "|---|---:|---:|---:|---:|---:|---:|"]
    for s, runs in got.items():
        r = runs[0]["recheck"]
        lines.append(f"| {s} | {r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | "
                     f"{r['predicted_step_s'] / r['measured_step_s'] - 1:+.1%} | {r['predicted_gib']:.3f} | "
                     f"{r['measured_gib']:.3f} | {r['predicted_gib'] / r['measured_gib'] - 1:+.1%} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", default="1f1b,zero_bubble", help="comma-separated, name or name:virtual_stages")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--recheck", type=int, default=0, metavar="N",
                    help="one run per schedule under amsp.plan=auto, the planner's prediction against its recheck "
                         "after N steps")
    ap.add_argument("--markdown", help="append the table to this file")
    a = ap.parse_args()
    if a.recheck:
        a.rounds, a.steps = 1, max(a.steps, a.recheck + 2)
    if a.ranks % a.pp:
        raise SystemExit(f"--ranks {a.ranks} is not a multiple of --pp {a.pp}")
    specs = a.schedules.split(",")
    got: dict[str, list[dict]] = {s: [] for s in specs}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.rounds):
            for s in specs:
                res = run_schedule(a, s, work, r)
                got[s].append(res)
                print(f"[{time.time() - t0:.0f}s] round {r + 1}/{a.rounds} {s}: step {res['step_s']:.3f} s, "
                      f"peak {res['peak_mib']:.0f} MiB, final loss {res['losses'][-1]:.5f}", file=sys.stderr)
    base = statistics.median(x["step_s"] for x in got[specs[0]])
    ref_losses = got[specs[0]][0]["losses"]
    lines = [f"`python scripts/bench/bench_pipeline_schedules.py --schedules {a.schedules} --ranks {a.ranks} "
             f"--pp {a.pp} --micro {a.micro} --mbs {a.mbs} --steps {a.steps} --rounds {a.rounds} --dim {a.dim} "
             f"--layers {a.layers} --seq {a.seq}{f' --recheck {a.recheck}' if a.recheck else ''}` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - t0:.0f} s)", ""]
    if a.recheck:
        return emit("\n".join(lines + recheck_table(got)), a.markdown)
    lines += ["| schedule | step s per round | median step s | vs first | peak RSS MiB (largest rank) | "
              "max rel. loss difference vs first |", "|---|---|---:|---:|---:|---:|"]
    for s in specs:
        steps = [x["step_s"] for x in got[s]]
        med = statistics.median(steps)
        diff = max(abs(x - y) / abs(y) for run in got[s] for x, y in zip(run["losses"], ref_losses))
        lines.append(f"| {s} | {' / '.join(f'{x:.3f}' for x in steps)} | {med:.3f} | {med / base:.3f} | "
                     f"{max(x['peak_mib'] for x in got[s]):.0f} | {diff:.1e} |")
    return emit("\n".join(lines), a.markdown)


def emit(text: str, markdown: str | None) -> int:
    print(text)
    if markdown:
        with open(markdown, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
