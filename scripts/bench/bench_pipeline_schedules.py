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

    python scripts/bench/bench_pipeline_schedules.py                                  # 1f1b vs zero_bubble
    python scripts/bench/bench_pipeline_schedules.py --schedules 1f1b,zero_bubble,interleaved:2 --rounds 3
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2**20


def model_args(a) -> list[str]:
    return ["model=tiny", f"model.dim={a.dim}", f"model.n_layers={a.layers}", f"model.n_heads={a.dim // 64}",
            f"model.n_kv_heads={max(1, a.dim // 256)}", f"model.max_seq_len={a.seq}", f"data.seq_len={a.seq}",
            "model.vocab_size=32000"]


def run_schedule(a, spec: str, workdir: str, round_no: int) -> dict:
    """train.py under one schedule ("name" or "name:virtual_stages"): median step seconds after the first
    two steps, per-step losses, the largest rank's peak RSS."""
    name, _, v = spec.partition(":")
    run_name = f"{name}{v}_r{round_no}"
    dp = a.ranks // a.pp
    args = [*model_args(a), f"parallel.pp={a.pp}", f"parallel.schedule={name}",
            f"parallel.virtual_stages={v or 1}", "amsp.plan=ddp", f"trainer.micro_batch_size={a.mbs}",
            f"trainer.global_batch_size={a.micro * a.mbs * dp}", f"trainer.max_steps={a.steps}",
            "trainer.log_interval=1", "trainer.val_samples=0", "trainer.checkpoint_interval=0",
            "logging.wandb.mode=disabled", "logging.plot=false", "amsp.planner.recheck_steps=0",
            f"trainer.output_dir={workdir}", f"trainer.run_name={run_name}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.ranks}",
           "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{spec} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    recs = [json.loads(x) for x in open(os.path.join(workdir, run_name, "metrics.jsonl"))]
    return {"step_s": statistics.median(r["step_time_s"] for r in recs if r["step"] > 2),
            "losses": [r["loss"] for r in recs], "peak_mib": max(r["memory_peak_bytes"] or 0 for r in recs) / MIB}


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
    ap.add_argument("--markdown", help="append the table to this file")
    a = ap.parse_args()
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
             f"--layers {a.layers} --seq {a.seq}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{time.time() - t0:.0f} s)", "",
             "| schedule | step s per round | median step s | vs first | peak RSS MiB (largest rank) | "
             "max rel. loss difference vs first |", "|---|---|---:|---:|---:|---:|"]
    for s in specs:
        steps = [x["step_s"] for x in got[s]]
        med = statistics.median(steps)
        diff = max(abs(x - y) / abs(y) for run in got[s] for x, y in zip(run["losses"], ref_losses))
        lines.append(f"| {s} | {' / '.join(f'{x:.3f}' for x in steps)} | {med:.3f} | {med / base:.3f} | "
                     f"{max(x['peak_mib'] for x in got[s]):.0f} | {diff:.1e} |")
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
