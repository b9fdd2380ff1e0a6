"""Sharded AdamW step on CPU: the fused multi-tensor step (amsp/sharded_optim.py) against the
algorithm it replaced (a faithful copy of that step() below: per-unit float64 norms with a .cpu()
each, then ~10 passes over every OS shard), on the same flat shards.

The shards are N units shaped like LLaMA blocks (attention and FFN matrices decay, the two norm
gains do not; GQA with half the heads for k and v), fp32, one process, no collective (world 1: the
norm's all_reduce is the same single call in both). Gradients are refreshed from a fixed random
source before every step, outside the timed region; their norm is far above the clip threshold, so
clipping is active every step (the old code then also allocates a scaled copy of each gradient).
Variants run in alternating order, round after round, and each reports its median time per step
over all rounds; at the end the masters of all variants are compared (they took the same steps).

The project's machines are shared, so by default one thread and CPU time (time.process_time) as
well as wall time; --threads 2 measures the parallel kernels when the machine is quiet.

    python scripts/bench/bench_optimizer.py                    # 8 units of ~3.9M, 5 rounds of 3 steps
    python scripts/bench/bench_optimizer.py --units 4 --rounds 3 --variants old,fused
    python scripts/bench/bench_optimizer.py --variants fused,csrc,foreach   # the kernels amsp.optimizer_kernel picks
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from amsp.sharded_optim import AdamWSettings, ShardedAdamW, StepResult  # noqa: E402

SETTINGS = AdamWSettings(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
VARIANTS = ("old", "fused", "foreach", "csrc")


class OldShardedAdamW:
    """amsp/sharded_optim.py's ShardedAdamW before the fused step (git show 2961e8e:amsp/sharded_optim.py),
    global_grad_norm and step copied verbatim."""

    def __init__(self, units, settings: AdamWSettings, comm):
        self.units, self.s, self.comm = units, settings, comm
        self.steps = 0

    def global_grad_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float64)
        for u in self.units:
            sq = u.os_grad.double().pow(2).sum().cpu()
            local += sq / u.replicas
        total = local.float().reshape(1).to(self.units[0].device)
        if self.comm.topo.world > 1:
            self.comm.all_reduce(total, tuple(range(self.comm.topo.world)), "grad_norm").wait()
        return math.sqrt(max(float(total.item()), 0.0)) if math.isfinite(total.item()) else float("nan")

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        norm = self.global_grad_norm()
        if not math.isfinite(norm):
            return StepResult(norm, True, lr)
        clip = 1.0
        if self.s.grad_clip > 0:
            clip = min(1.0, self.s.grad_clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
        self.steps += 1
        b1, b2 = self.s.betas
        bc1 = 1 - b1 ** self.steps
        bc2_sqrt = math.sqrt(1 - b2 ** self.steps)
        for u in self.units:
            g = u.os_grad
            if clip != 1.0:
                g = g * clip
            if self.s.weight_decay:
                for lo, hi in u.decay_segments:
                    u.master[lo:hi].mul_(1 - lr * self.s.weight_decay)
            u.exp_avg.lerp_(g, 1 - b1)
            u.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (u.exp_avg_sq.sqrt() / bc2_sqrt).add_(self.s.eps)
            u.master.addcdiv_(u.exp_avg, denom, value=-lr / bc1)
        return StepResult(norm, False, lr)


def block_segments(dim: int, ffn: int) -> tuple[int, list[tuple[int, int]]]:
    """(numel, decay segments) of one LLaMA block's flat buffer in module order."""
    sizes = [(dim, False), (dim * dim, True), (dim * dim // 2, True), (dim * dim // 2, True), (dim * dim, True),
             (dim, False), (ffn * dim, True), (dim * ffn, True), (ffn * dim, True)]
    segs, pos = [], 0
    for n, decays in sizes:
        if decays:
            segs.append((pos, pos + n))
        pos += n
    return pos, segs


def make_units(n: int, numel: int, segs: list, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [types.SimpleNamespace(device=torch.device("cpu"), layout=types.SimpleNamespace(chunk=numel),
                                  decay_segments=segs, norm_excluded=[], master_is_weights=True,
                                  master=torch.randn(numel, generator=g) * 0.02,
                                  exp_avg=torch.zeros(numel), exp_avg_sq=torch.zeros(numel), replicas=1,
                                  os_grad=torch.empty(numel))
            for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--ffn", type=int, default=1664)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    bad = set(variants) - set(VARIANTS)
    if bad:
        raise SystemExit(f"unknown variants {sorted(bad)}; choose from {VARIANTS}")
    numel, segs = block_segments(args.dim, args.ffn)
    comm = types.SimpleNamespace(topo=types.SimpleNamespace(world=1), rank=0)
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(100 + i)) for i in range(args.units)]
    opts = {}
    for v in variants:
        units = make_units(args.units, numel, segs, seed=0)  # the same initial masters for every variant
        opts[v] = OldShardedAdamW(units, SETTINGS, comm) if v == "old" else ShardedAdamW(units, SETTINGS, comm, v)
    print(f"{args.units} units x {numel / 1e6:.2f}M fp32 elements ({len(segs)} decay segments each), "
          f"{args.rounds} rounds x {args.steps} steps, torch {torch.__version__}, {args.threads} thread(s)")
    wall = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    lr = 1e-3
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            opt = opts[v]
            for _ in range(args.steps):
                for u, g in zip(opt.units, grads):
                    u.os_grad.copy_(g)
                w0, c0 = time.perf_counter(), time.process_time()
                res = opt.step(lr)
                wall[v].append(time.perf_counter() - w0)
                cpu[v].append(time.process_time() - c0)
                assert not res.skipped
    print(f"{'variant':<10} {'wall ms/step':>13} {'cpu ms/step':>12} {'old/this (wall)':>16} {'old/this (cpu)':>15}")
    med = {v: (statistics.median(wall[v]) * 1e3, statistics.median(cpu[v]) * 1e3) for v in variants}
    for v in variants:
        ratio = (f"{med['old'][0] / med[v][0]:16.2f} {med['old'][1] / med[v][1]:15.2f}" if "old" in med else "")
        print(f"{v:<10} {med[v][0]:13.1f} {med[v][1]:12.1f} {ratio}")
    base = variants[0]
    for v in variants[1:]:
        err = max(((a.master - b.master).norm() / a.master.norm()).item()
                  for a, b in zip(opts[base].units, opts[v].units))
        print(f"masters after {opts[v].steps} steps: {v} vs {base} max rel diff {err:.1e}")


if __name__ == "__main__":
    main()
