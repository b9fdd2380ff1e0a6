"""Measured peak GPU memory against the planner's prediction, per plan, as one rank of a pretend world.

One process poses as rank 0 of an N-rank world (AMSP_PRETEND_WORLD=N: torch's fake backend, whose
collectives return at once and move no data), so it allocates exactly what a rank of that world
allocates: its shards, the gathered units, the gradient buffers, the spread window, activations.
For each plan it trains a few steps and compares torch.cuda.max_memory_allocated with the cost
model's per-rank memory before its safety reserve (amsp/planner/cost_model.py `evaluate`). The
issue's acceptance: within 10% for at least four plans, and no plan predicted to fit runs out of
memory. The fake backend leaves received buffers uninitialised, so a step may see a non-finite
norm and be skipped (no spread then): the table says when that happened.

    AMSP_PRETEND_WORLD=8 python scripts/bench/bench_gpu_memory.py            # on one GPU
    AMSP_PRETEND_WORLD=8 python scripts/bench/bench_gpu_memory.py --plans 1/1/8,8/8/8 --layers 2 --seq 1024
    AMSP_PRETEND_WORLD=8 python scripts/bench/bench_gpu_memory.py --plans 1/1/8 --compile off,on   # compiled too
    AMSP_PRETEND_WORLD=8 python scripts/bench/bench_gpu_memory.py --allocator default,expandable

--allocator measures each plan under the caching allocator's default block pools and with
expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, switched between rows in the
same process after emptying the cache): what the allocator reserves above the live tensors is what
a run needs beyond the planner's tensor prediction, and what amsp.planner.memory_margin stands for.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from amsp.compile import apply_compile  # noqa: E402
from amsp.engine import AMSPEngine, EngineOptions  # noqa: E402
from amsp.launch import init_distributed  # noqa: E402
from amsp.metrics.peak_breakdown import format_breakdown, peak_breakdown, recorded_allocations  # noqa: E402
from amsp.plan import Degrees, Plan  # noqa: E402
from amsp.planner.cluster import cluster_from_config  # noqa: E402
from amsp.planner.cost_model import CostModel, Options  # noqa: E402
from amsp.planner.startup import kernels_for_model  # noqa: E402
from amsp.planner.workload import Workload  # noqa: E402
from amsp.schedule import Precision  # noqa: E402
from amsp.topology import Topology  # noqa: E402
from configs.schema import ClusterConfig  # noqa: E402
from models.llama import get_preset  # noqa: E402

GIB = 2**30


def cluster(world: int):
    preset = OmegaConf.load(ROOT / "configs/cluster/h100x8.yaml")
    preset.pop("defaults", None)
    return cluster_from_config(OmegaConf.merge(OmegaConf.structured(ClusterConfig), preset), nodes=1,
                               ranks_per_node=world)


def predicted_bytes(cfg, plan: Plan, world: int, seq: int, micro: int, window: int,
                    param_bytes: int = 2, device: str = "cuda", compiled: bool = False) -> tuple[float, dict]:
    """The cost model's per-rank tensor peak without the reserve (the larger phase; parts by name,
    step_reuse negative), for the kernels the model runs on `device`. Defaults: bf16 weights, fp32
    gradient reduction (the engine on CUDA); scripts/bench/bench_memory_fidelity.py asks for fp32
    weights on CPU."""
    kernels = kernels_for_model(cfg, device, "bf16" if param_bytes == 2 else "fp32", compiled=compiled)
    w = Workload(cfg, seq, 1, micro, Precision(param_bytes=param_bytes, grad_bytes=4), cfg.activation_checkpointing,
                 kernels=kernels)
    # the engine's default: the spread follows the update (EngineOptions.overlap_spread=False); the
    # device's backend (gloo on CPU stages collective copies) and allocator margin come with `device`
    spec = dataclasses.replace(cluster(world), device=device)
    cost = CostModel(w, spec, Options(spread_window=window, overlap_spread=False)).evaluate(plan)
    parts = {k: v for k, v in cost.memory.items() if k != "reserved"}
    return float(sum(parts.values())), parts


ALLOCATORS = {"default": "expandable_segments:False", "expandable": "expandable_segments:True"}


def use_allocator(name: str) -> None:
    """The caching allocator's segment mode for the next allocations (the cache emptied first, so no
    segment of the other mode is reused)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings(ALLOCATORS[name])


def measure(cfg, plan: Plan, world: int, seq: int, micro: int, steps: int, window: int,
            compiled: bool = False, breakdown: bool = False) -> dict:
    if not breakdown:
        return _measure(cfg, plan, world, seq, micro, steps, window, compiled)
    with recorded_allocations() as rec:
        got = _measure(cfg, plan, world, seq, micro, steps, window, compiled)
    peak, rows = peak_breakdown(rec.snapshot)
    print(f"plan {plan.blocks}: " + format_breakdown(peak, rows), flush=True)
    return {**got, "breakdown": [{"origin": o, "gib": b / GIB, "blocks": n} for o, b, n in rows]}


def _measure(cfg, plan: Plan, world: int, seq: int, micro: int, steps: int, window: int, compiled: bool) -> dict:
    device = torch.device("cuda", 0)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    eng = AMSPEngine(cfg, plan, Topology(world, world), rank=0, seed=0, device=device,
                     options=EngineOptions(precision="bf16", spread_window=window))
    if compiled:  # as train.py runs where compiled blocks measure faster (model.compile=auto)
        apply_compile(eng.model, "on", device)
    skipped = 0
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        for _ in range(steps):
            for m in range(micro):
                x = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen)
                eng.forward_backward(x[:, :-1], x[:, 1:], m, micro)
            skipped += eng.step(1e-4).skipped
        torch.cuda.synchronize()
        # reserved: what the caching allocator held from the device at its peak, fragmentation included;
        # its excess over the allocated peak is what amsp.planner.memory_margin stands for
        return {"peak": torch.cuda.max_memory_allocated() - base, "skipped": skipped,
                "reserved": torch.cuda.max_memory_reserved() - base_reserved, "seconds": time.perf_counter() - t0}
    finally:
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama2_7b")
    ap.add_argument("--layers", type=int, default=4)  # 1.07B parameters with llama2_7b
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--plans", default="1/1/8,2/8/8,8/8/8,1/8/8")
    ap.add_argument("--checkpointing", default="none,full", help="model.activation_checkpointing values")
    ap.add_argument("--compile", default="off", help="off, on or off,on: blocks compiled as train.py's default on "
                    "CUDA does (each compiled row adds the compilation's time)")
    ap.add_argument("--allocator", default="default", help="default, expandable or default,expandable: the "
                    "caching allocator's segment mode for each row (expandable = expandable_segments:True)")
    ap.add_argument("--breakdown", action="store_true", help="record every allocation and print, per plan, what "
                    "was alive at the peak by the code that allocated it (amsp/metrics/peak_breakdown.py)")
    ap.add_argument("--out", default=None, help="write the table (markdown) and raw rows (.json) here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_memory.py measures GPU memory: it needs CUDA")
    denv = init_distributed(timeout_s=60)
    world = denv.world_size
    if denv.launcher != "pretend":
        sys.exit("run it as one rank of a pretend world: AMSP_PRETEND_WORLD=N python scripts/bench/bench_gpu_memory.py")
    allocators = args.allocator.split(",")
    if not set(allocators) <= set(ALLOCATORS):
        sys.exit(f"--allocator takes {', '.join(ALLOCATORS)} (comma-separated), got {args.allocator!r}")
    rows = []
    for ckpt, comp, alloc in [(c, m, a) for c in args.checkpointing.split(",") for m in args.compile.split(",")
                              for a in allocators]:
        if comp not in ("on", "off"):
            sys.exit(f"--compile takes off, on or off,on, got {args.compile!r}")
        use_allocator(alloc)
        compiled = comp == "on"
        cfg = get_preset(args.preset).with_overrides(n_layers=args.layers, activation_checkpointing=ckpt)
        for text in args.plans.split(","):
            deg = Degrees(*map(int, text.split("/")))
            plan = Plan(deg, deg, name="bench")
            want, parts = predicted_bytes(cfg, plan, world, args.seq, args.micro, args.window, compiled=compiled)
            row = {"plan": text, "checkpointing": ckpt, "compiled": compiled, "allocator": alloc,
                   "predicted_gib": want / GIB,
                   "parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()}}
            try:
                got = measure(cfg, plan, world, args.seq, args.micro, args.steps, args.window, compiled,
                              args.breakdown)
                row.update(measured_gib=got["peak"] / GIB, reserved_gib=got["reserved"] / GIB,
                           skipped_steps=got["skipped"],
                           error_pct=100 * (want - got["peak"]) / got["peak"], seconds=got["seconds"])
                if "breakdown" in got:
                    row["breakdown"] = got["breakdown"]
            except torch.OutOfMemoryError as e:
                row.update(measured_gib=None, error=f"out of memory: {str(e).splitlines()[0]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_table(rows, args, world)
    print(write_table(rows, args, world))


def write_table(rows: list[dict], args, world: int) -> str:
    """The markdown table of the rows so far, written to --out (with the raw rows) after every row: a part cut
    by its time limit keeps what it measured."""
    lines = [f"{args.preset} x {args.layers} layers, seq {args.seq}, {args.micro} micro-batches of 1, rank 0 of a "
             f"pretend world of {world}, bf16, spread window {args.window}, {torch.cuda.get_device_name()}",
             "", "| plan | checkpointing | compiled | allocator | predicted GiB (no reserve) | measured peak GiB | "
             "prediction error | allocator reserved GiB (over the peak) | skipped steps |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("measured_gib") is None:
            lines.append(f"| {r['plan']} | {r['checkpointing']} | {r['compiled']} | {r['allocator']} | "
                         f"{r['predicted_gib']:.2f} | {r['error']} | | | |")
        else:
            lines.append(f"| {r['plan']} | {r['checkpointing']} | {r['compiled']} | {r['allocator']} | "
                         f"{r['predicted_gib']:.2f} | {r['measured_gib']:.2f} | {r['error_pct']:+.1f}% | "
                         f"{r['reserved_gib']:.2f} ({100 * (r['reserved_gib'] / r['measured_gib'] - 1):+.1f}%) | "
                         f"{r['skipped_steps']} |")
    table = "\n".join(lines)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(table + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return table

if __name__ == "__main__":
    main()
