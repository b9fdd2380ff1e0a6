"""Engine construction time (build on meta, initialise the rank's shards) on one process, CPU.

Times AMSPEngine(...) for a larger model under plan 1/1/1 and reports the peak resident memory of
the process. To compare with another version of the engine, point --repo at a checkout of it
(e.g. `git archive HEAD | tar -x -C /tmp/head`): its amsp/ and models/ are imported instead.

    .venv/bin/python scripts/bench/bench_init.py [--preset llama2_7b] [--layers 1] [--precision fp32] \\
        [--repo /tmp/head]
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama2_7b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(HERE)),
                    help="checkout whose amsp/ and models/ are measured (default: this one)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.repo))
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    import torch

    from amsp.engine import AMSPEngine, EngineOptions
    from amsp.plan import Degrees, Plan
    from amsp.topology import Topology
    from models.llama import get_preset

    cfg = get_preset(args.preset).with_overrides(n_layers=args.layers, fused="off")
    plan = Plan(Degrees(1, 1, 1), Degrees(1, 1, 1))
    t0 = time.perf_counter()
    eng = AMSPEngine(cfg, plan, Topology(1, 1), 0, seed=0, options=EngineOptions(precision=args.precision))
    seconds = time.perf_counter() - t0
    params = sum(u.layout.numel for u in eng.units)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
    print(f"repo {os.path.abspath(args.repo)}: {args.preset} x {args.layers} layers, {params / 1e9:.3f}B parameters, "
          f"plan 1/1/1 {args.precision}, {torch.get_num_threads()} threads: construction {seconds:.2f} s, "
          f"peak RSS {peak_gib:.2f} GiB")


if __name__ == "__main__":
    main()
