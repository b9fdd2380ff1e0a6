"""Measured peak memory per rank against the planner's prediction, per plan, on real gloo ranks (CPU).

For each plan a fresh group of N ranks (torchrun; a fresh process per plan, so one plan's peak is not
another's) builds the engine and trains a few steps of a ~100M-parameter model in fp32. Each rank
reads its resident set before the engine exists (after torch import, process-group setup and one
warm-up step of a much smaller model, which pages in the runtime's code, kernels and buffers) and its
high-water mark (VmHWM) after the steps; the difference is what the plan's tensors took. glibc is
told to serve every block over 64 KiB by mmap and to give freed memory back at once
(MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_), so the resident set follows the live tensor bytes
instead of keeping freed blocks around. The prediction is the cost model's per-rank memory without
the reserve (amsp/planner/cost_model.py `evaluate`: the larger of the forward/backward and optimizer
step phases), the same quantity scripts/bench/bench_gpu_memory.py compares with
torch.cuda.max_memory_allocated on a GPU. Acceptance (issue 15, item 3): within 10%.

    .venv/bin/python scripts/bench/bench_memory_fidelity.py                       # 4 ranks, 5 plans
    .venv/bin/python scripts/bench/bench_memory_fidelity.py --ranks 2 --plans 1/1/1,2/2/2 --layers 2
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchrun_cmd import torchrun_cmd  # noqa: E402

MIB = 2**20
PLANS = "1/1/1,1/1/4,1/4/4,4/4/4,2/4/4"  # ddp, zero1, zero2, zero3, a hybrid (shard 2, reduce over 4)
NAMES = {"1/1/1": "ddp", "1/1/4": "zero1", "1/4/4": "zero2", "4/4/4": "zero3"}


def model_config(args):
    from models.llama import get_preset

    return get_preset("tiny").with_overrides(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                                             n_kv_heads=args.dim // 192, vocab_size=args.vocab,
                                             max_seq_len=args.seq, activation_checkpointing=args.checkpointing)


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(args) -> None:
    """One rank of one plan: baseline RSS, engine, steps, high-water mark."""
    import torch

    from amsp.engine import AMSPEngine, EngineOptions
    from amsp.launch import init_distributed
    from amsp.plan import Degrees, Plan
    from amsp.topology import Topology

    torch.set_num_threads(1)
    denv = init_distributed(backend="gloo", timeout_s=600)
    deg = Degrees(*map(int, args.plan.split("/")))

    def train(cfg, steps):
        eng = AMSPEngine(cfg, Plan(deg, deg, name="bench"), Topology(denv.world_size, denv.world_size), denv.rank,
                         seed=0, device=torch.device("cpu"), options=EngineOptions(precision="fp32",
                                                                                  spread_window=args.window))
        gen = torch.Generator().manual_seed(denv.rank)
        for _ in range(steps):
            for m in range(args.micro):
                x = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), generator=gen)
                eng.forward_backward(x[:, :-1], x[:, 1:], m, args.micro)
            eng.step(1e-4)

    # Warm-up on a model 1/64 the width: pages in the code, kernels, gloo buffers and thread stacks
    # a first step brings, which belong to the runtime (the reserve), not to the plan's tensors.
    warm = model_config(args).with_overrides(dim=max(64, args.dim // 8), n_heads=max(1, args.dim // 512),
                                             n_kv_heads=1, vocab_size=512)
    train(warm, 1)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = vm_kib("VmRSS")
    t0 = time.perf_counter()
    train(model_config(args), args.steps)
    out = {"rank": denv.rank, "baseline_bytes": base * 1024, "hwm_bytes": vm_kib("VmHWM") * 1024,
           "seconds": time.perf_counter() - t0}
    Path(args.result).with_suffix(f".{denv.rank}.json").write_text(json.dumps(out))


def predicted(args, plan_text: str, world: int) -> tuple[float, dict]:
    from amsp.plan import Degrees, Plan
    from bench_gpu_memory import predicted_bytes

    deg = Degrees(*map(int, plan_text.split("/")))
    return predicted_bytes(model_config(args), Plan(deg, deg, name="bench"), world, args.seq, args.micro,
                           args.window, param_bytes=4, device="cpu")


def run_plan(args, plan_text: str, tmp: Path) -> dict:
    result = tmp / plan_text.replace("/", "_")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    cmd = torchrun_cmd(args.ranks, [__file__, "--worker", "--plan", plan_text, "--result", str(result),
                                    *_shape_args(args)], str(tmp))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"plan {plan_text} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ranks = [json.loads(result.with_suffix(f".{r}.json").read_text()) for r in range(args.ranks)]
    measured = max(r["hwm_bytes"] - r["baseline_bytes"] for r in ranks)
    want, parts = predicted(args, plan_text, args.ranks)
    return {"plan": plan_text, "name": NAMES.get(plan_text, "hybrid"), "predicted_mib": want / MIB,
            "measured_mib": measured / MIB, "error_pct": 100 * (want - measured) / measured,
            "parts_mib": {k: round(v / MIB, 1) for k, v in parts.items()}, "seconds": time.perf_counter() - t0}


def _shape_args(args) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in ("dim", "layers", "vocab", "seq", "micro", "steps", "window",
                                                   "checkpointing")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--plans", default=PLANS)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--checkpointing", default="none")
    ap.add_argument("--out", default=None, help="write the table (markdown) and raw rows (.json) here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.out:  # before the runs: a missing folder must not lose ten minutes of measurements at the end
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    cfg = model_config(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for plan_text in args.plans.split(","):
            print(f"plan {plan_text} on {args.ranks} gloo ranks ...", flush=True)
            rows.append(run_plan(args, plan_text, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"{cfg.num_params() / 1e6:.0f}M parameters (dim {args.dim}, {args.layers} layers, vocab {args.vocab}), "
             f"seq {args.seq}, {args.micro} micro-batches of 1, fp32, {args.ranks} gloo ranks, spread window "
             f"{args.window}, activation checkpointing {args.checkpointing}; measured = max over ranks of VmHWM - "
             f"VmRSS before the engine", "",
             "| plan | p/g/os | predicted MiB (no reserve) | measured peak MiB | error |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['plan']} | {r['predicted_mib']:.0f} | {r['measured_mib']:.0f} | "
              f"{r['error_pct']:+.1f}% |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(table + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
