"""Step time of the AMSP engine on CPU gloo ranks with each overlap switched on and off.

    .venv/bin/python scripts/bench/bench_overlap.py --world 4 --ranks-per-node 2 --plan 2/2/4 --steps 6 --rounds 3

Switches: prefetch (next unit's P all-gather), async_grad_reduce (gradient reduce-scatters and the
hierarchical sync in the background of backward), overlap_spread (parameter spread behind the next
forward). Every configuration runs in the same spawned group, interleaved round by round so a
shared machine's load drifts over all of them alike; the median step time per configuration is
reported with the exposed (blocked-in-wait) communication and the layout permutation copies.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CONFIGS = {
    "all on": dict(prefetch=True, async_grad_reduce=True, overlap_spread=True),
    "prefetch off": dict(prefetch=False, async_grad_reduce=True, overlap_spread=True),
    "async grad reduce off": dict(prefetch=True, async_grad_reduce=False, overlap_spread=True),
    "spread overlap off": dict(prefetch=True, async_grad_reduce=True, overlap_spread=False),
    "all off": dict(prefetch=False, async_grad_reduce=False, overlap_spread=False),
}


def _worker(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from amsp.engine import AMSPEngine, EngineOptions
    from amsp.plan import Degrees, Plan
    from amsp.topology import Topology
    from models.llama import LlamaConfig

    torch.set_num_threads(args["threads"])
    cfg = LlamaConfig(dim=args["dim"], n_layers=args["layers"], n_heads=4, n_kv_heads=2, vocab_size=args["vocab"],
                      multiple_of=64, max_seq_len=args["seq"])
    deg = Degrees(*args["plan"])
    topo = Topology(world, args["ranks_per_node"])
    engines = {name: AMSPEngine(cfg, Plan(deg, deg, "bench"), topo, rank, seed=1,
                                options=EngineOptions(precision="fp32", **sw)) for name, sw in CONFIGS.items()}
    g = torch.Generator().manual_seed(rank)
    samples = {name: [] for name in CONFIGS}
    for rnd in range(args["rounds"]):
        for name, eng in engines.items():
            for step in range(args["steps"] + (1 if rnd == 0 else 0)):  # one warm-up step the first round
                dist.barrier()
                t0 = time.perf_counter()
                for m in range(args["micro"]):
                    t = torch.randint(0, cfg.vocab_size, (args["mbs"], args["seq"] + 1), generator=g)
                    eng.forward_backward(t[:, :-1], t[:, 1:], m, args["micro"])
                eng.step(1e-4)
                dt = time.perf_counter() - t0
                st = eng.comm_stats()
                if not (rnd == 0 and step == 0):
                    samples[name].append((dt, st.exposed_s, st.permute_s, st.total_bytes))
    out = {}
    for name, rows in samples.items():
        # A step is as slow as its slowest rank: take the max over ranks of each sample.
        t = torch.tensor([r[0] for r in rows], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = {"step_s": statistics.median(t.tolist()),
                     "exposed_s": statistics.median(r[1] for r in rows),
                     "permute_s": statistics.median(r[2] for r in rows),
                     "bytes": rows[0][3]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--plan", default="2/2/4", help="p/g/os of every unit")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per configuration per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    from tests.distributed import run_distributed

    args = dict(vars(a), plan=tuple(int(x) for x in a.plan.split("/")), ranks_per_node=a.ranks_per_node)
    t0 = time.time()
    res = run_distributed(_worker, a.world, args, timeout=3600)[0]
    base = res["all on"]["step_s"]
    print(f"# bench_overlap: {a.world} ranks ({a.ranks_per_node} per node), plan p/g/os = {a.plan}, "
          f"dim {a.dim} x {a.layers} layers, vocab {a.vocab}, seq {a.seq}, {a.micro} micro-batches of {a.mbs}")
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
          f"{a.steps} steps x {a.rounds} rounds, {time.time() - t0:.0f}s")
    print("| configuration | median step (s) | vs all on | exposed comm (s) | permute copies (s) | bytes/step/rank |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / base:.2f}x | {r['exposed_s']:.3f} | "
              f"{r['permute_s'] * 1e3:.2f} ms | {r['bytes'] / 2**20:.1f} MiB |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": args, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
