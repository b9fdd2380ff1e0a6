"""Dataset index builders: numpy/Python reference (data/index_builders.py) vs C++ (data/native_index.py).

A synthetic corpus of about 1 billion tokens (document lengths uniform in [1, 2*mean_doc_len)),
indexed as the data pipeline does for one epoch: doc_index, sample_index, shuffle_index, and a
blending index over three such datasets. Prints a markdown table for BENCHMARKS.md; each time is the
best of --repeats runs (references included). The machines are shared (load averages far above 2
cores are common), so the headline speedup is on CPU time (time.process_time) with --threads 1 by
default, which compares algorithms rather than core counts (numpy's sort is single-threaded); wall
times are printed too.

    python scripts/bench/bench_index.py --tokens 1e9 --seq-len 2048
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def best_time(fn, repeats: int) -> tuple[float, float, object]:
    """(best CPU seconds, best wall seconds, last output)."""
    cpu, wall, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - t0)
    return cpu, wall, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--mean-doc-len", type=int, default=1000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--datasets", type=int, default=3, help="datasets in the blend")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="threads of the native builders")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)

    from data import index_builders as ref
    from data import native_index

    ref._native = lambda: None  # the public builders dispatch to C++ when built; time the numpy ones
    nat = native_index.native()
    if nat is None:
        raise SystemExit("the native extension could not be built; see the warning above")
    rng = np.random.default_rng(args.seed)
    num_docs = int(args.tokens / args.mean_doc_len)
    lengths = rng.integers(1, 2 * args.mean_doc_len, num_docs).astype(np.int32)
    total = int(lengths.sum(dtype=np.int64))
    num_samples = (total - 1) // args.seq_len
    weights = rng.random(args.datasets) + 0.5
    print(f"# {num_docs} documents, {total / 1e9:.3f}B tokens, {num_samples} samples of {args.seq_len}, "
          f"blend of {args.datasets} datasets; native threads {torch.get_num_threads()}")

    steps = [
        ("build_doc_index", lambda m: m.build_doc_index(num_docs, 1, args.seed)),
        ("build_sample_index", lambda m: m.build_sample_index(lengths, doc_index, args.seq_len, num_samples)),
        ("build_shuffle_index", lambda m: m.build_shuffle_index(num_samples, args.seed)),
        ("build_blending_index", lambda m: m.build_blending_index(weights, num_samples)),
    ]
    doc_index = ref.build_doc_index(num_docs, 1, args.seed)
    rows, t_ref_total, t_nat_total, w_ref_total, w_nat_total = [], 0.0, 0.0, 0.0, 0.0
    for name, fn in steps:
        t_ref, w_ref, out_ref = best_time(lambda: fn(ref), args.repeats)
        t_nat, w_nat, out_nat = best_time(lambda: fn(nat), args.repeats)
        outs_ref = out_ref if isinstance(out_ref, tuple) else (out_ref,)
        outs_nat = out_nat if isinstance(out_nat, tuple) else (out_nat,)
        same = all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(outs_ref, outs_nat))
        if not same:
            raise SystemExit(f"{name}: native output differs from the reference")
        t_ref_total += t_ref
        t_nat_total += t_nat
        w_ref_total += w_ref
        w_nat_total += w_nat
        rows.append((name, t_ref, t_nat, w_ref, w_nat))
    print("| step | reference CPU s | native CPU s | speedup (CPU) | reference wall s | native wall s | speedup (wall) "
          "| identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, t_ref, t_nat, w_ref, w_nat in rows:
        print(f"| {name} | {t_ref:.3f} | {t_nat:.4f} | {t_ref / t_nat:.1f}x | {w_ref:.3f} | {w_nat:.4f} "
              f"| {w_ref / w_nat:.1f}x | yes |")
    print(f"| **all four** | {t_ref_total:.3f} | {t_nat_total:.4f} | **{t_ref_total / t_nat_total:.1f}x** "
          f"| {w_ref_total:.3f} | {w_nat_total:.4f} | **{w_ref_total / w_nat_total:.1f}x** | yes |")


if __name__ == "__main__":
    main()
