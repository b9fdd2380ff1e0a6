"""Cost of checkpoint checksums: save the same state with and without them, alternating.

    python scripts/bench/bench_checkpoint.py --params-m 670 --repeats 3   # llama2_7b with 2 layers
    python scripts/bench/bench_checkpoint.py --params-m 200 --repeats 3   # what fits a small box

The state is what train.py saves per parameter: fp32 master weights plus the two AdamW moments
(3 x 4 bytes per parameter), split into tensors the size of a llama2_7b layer's matrices (4096 x
4096), one process. Each repeat saves once without checksums and once with (order alternating),
into a fresh directory, and drops the previous checkpoint so the page cache and disk see the same
load. Prints seconds per save and the ratio (acceptance: <= 1.05).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from amsp.checkpoint import CheckpointManager, Fragment  # noqa: E402


def state(params: int, chunk: int = 4096 * 4096) -> list[Fragment]:
    frags, left, i = [], params, 0
    while left > 0:
        n = min(chunk, left)
        for prefix in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
            frags.append(Fragment(f"{prefix}.p{i}", n, 0, torch.randn(n)))
        left, i = left - n, i + 1
    return frags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=float, default=670.0, help="parameters in millions (default 670: llama2_7b "
                                                                   "shapes with 2 layers)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    params = int(args.params_m * 1e6)
    frags = state(params)
    gb = params * 12 / 1e9
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.repeats):
        for checksums in ((False, True) if r % 2 == 0 else (True, False)):
            run = root / f"r{r}_{int(checksums)}"
            mgr = CheckpointManager(run, keep_last=1, checksums=checksums)
            t0 = time.perf_counter()
            mgr.save(1, frags, {}, {}, "")
            dt = time.perf_counter() - t0
            times[checksums].append(dt)
            print(f"repeat {r}: checksums={checksums!s:5} {dt:7.2f} s ({gb / dt:.2f} GB/s)", flush=True)
            shutil.rmtree(run)
    base, chk = statistics.median(times[False]), statistics.median(times[True])
    print(f"state {params / 1e6:.0f}M params, {gb:.2f} GB per save, {len(frags)} tensors, 1 process, "
          f"{torch.get_num_threads()} threads")
    print(f"median save: without checksums {base:.2f} s, with {chk:.2f} s, ratio {chk / base:.3f} "
          f"({(chk / base - 1) * 100:+.1f}%)")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
