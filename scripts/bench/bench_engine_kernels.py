"""The engine's two opt-in GPU paths timed op by op against what they replace, side by side in one process.

  wgrad   a linear layer's weight gradient into its fp32 buffer (amsp.fuse_wgrad): autograd's bf16 GEMM then
          csrc's accumulate_grad pass (the default path) against one cuBLAS GEMM adding into the buffer
          (amsp_fused::wgrad_accumulate, csrc/wgrad_gemm_cuda.cu); LLaMA-2-7B's three linear shapes.
  adamw   AdamW over an OS shard with a bf16 weight copy (amsp.optimizer_kernel=csrc): torch._fused_adamw_
          with the clip scale, then the spread's cast (the default) against amsp_fused::adamw_update, one pass.

Per case the best of --repeats synchronised calls after a warm-up, alternating the two variants, and the bytes
each moves at least (effective GB/s). On CPU (--device cpu, small shapes) the numbers only show that the
script runs: there the mixed-dtype GEMM is a widening reference and the step the vectorised loop.

    python scripts/bench/bench_engine_kernels.py                       # on a GPU: markdown table
    python scripts/bench/bench_engine_kernels.py --device cpu --small --json /tmp/k.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# (tokens, in, out) of LLaMA-2-7B's projections at a 4096-token micro-batch: q/k/v/o, gate/up, down
WGRAD_SHAPES = [(4096, 4096, 4096), (4096, 4096, 11008), (4096, 11008, 4096)]
ADAMW_ELEMS = 256 * 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: library loads, cuBLAS heuristics, allocator
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


class WgradUnavailable(RuntimeError):
    """The weight-gradient GEMM's library or build is missing on this machine."""


def wgrad_cases(device: torch.device, shapes, repeats: int) -> list[dict]:
    from csrc.loader import load_cuda_extension, load_extension
    from amsp.grad_accumulate import accumulate, native_available
    from amsp.wgrad_fusion import mixed_gemm_unavailable, wgrad_into

    load_extension()
    if device.type == "cuda":
        load_cuda_extension()
    why = mixed_gemm_unavailable(device)
    if why is not None:  # main() still measures AdamW, then fails: one missing library must not cost both
        raise WgradUnavailable(f"the mixed-dtype weight-gradient GEMM is unavailable on {device}: {why}")
    native = native_available(device)
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for tokens, d_in, d_out in shapes:
        x = torch.randn(tokens, d_in, generator=g).to(device, torch.bfloat16)
        gy = torch.randn(tokens, d_out, generator=g).to(device, torch.bfloat16)
        acc = torch.zeros(d_out, d_in, device=device)

        def unfused():
            gw = gy.t() @ x  # what autograd's linear backward writes
            accumulate(acc.view(-1), gw, False, native)

        def fused():
            wgrad_into(acc, gy, x, overwrite=False)

        times = {"unfused": [], "fused": []}
        for _ in range(2):  # alternate, so a drift in clocks spreads over both
            for name, fn in (("unfused", unfused), ("fused", fused)):
                times[name].append(_best(fn, device, repeats))
        flops = 2 * tokens * d_in * d_out
        rows.append({"case": f"wgrad {tokens}x{d_in} -> {d_out}", "default_ms": 1e3 * min(times["unfused"]),
                     "ours_ms": 1e3 * min(times["fused"]), "tflops_default": flops / min(times["unfused"]) / 1e12,
                     "tflops_ours": flops / min(times["fused"]) / 1e12})
    return rows


def adamw_case(device: torch.device, elems: int, repeats: int) -> dict:
    from amsp.sharded_optim import native_adamw_unavailable

    why = native_adamw_unavailable(device)
    if why is not None:
        raise SystemExit(f"amsp_fused::adamw_update is unavailable on {device}: {why}")
    g = torch.Generator(device="cpu").manual_seed(1)
    master, grad, avg = (torch.randn(elems, generator=g).to(device) for _ in range(3))
    sq = torch.rand(elems, generator=g).to(device) * 1e-2
    weights = torch.empty(elems, dtype=torch.bfloat16, device=device)
    scale = torch.tensor(1.3, device=device)
    step = torch.tensor(3.0, device=device)
    b1, b2, lr = 0.9, 0.95, 1e-5  # a small lr: the repeats leave the values in range

    def default():
        torch._fused_adamw_([master], [grad], [avg], [sq], [], [step], lr=lr, beta1=b1, beta2=b2, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
        weights.copy_(master)  # the spread's cast (FlatUnit.launch_spread, os = p)

    def ours():
        torch.ops.amsp_fused.adamw_update(master, grad, avg, sq, weights, scale, lr, 0.1, b1, b2, 1e-8,
                                          lr / (1 - b1 ** 3), math.sqrt(1 - b2 ** 3))

    times = {"default": [], "ours": []}
    for _ in range(2):
        for name, fn in (("default", default), ("ours", ours)):
            times[name].append(_best(fn, device, repeats))
    t_d, t_o = min(times["default"]), min(times["ours"])
    # bytes each must move: torch's kernel reads 4 and writes 4 fp32 tensors (the scaled gradient back), the
    # cast reads the master and writes bf16; ours reads 4, writes 3 and the bf16 weights
    return {"case": f"adamw {elems / 2**20:.0f}M elements + bf16 weights", "default_ms": 1e3 * t_d,
            "ours_ms": 1e3 * t_o, "gbs_default": elems * 38 / t_d / 1e9, "gbs_ours": elems * 30 / t_o / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="shapes a CPU runs in seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(2)
    shapes = [(256, 256, 512), (256, 512, 256)] if args.small else WGRAD_SHAPES
    elems = 2**20 if args.small else ADAMW_ELEMS
    try:
        rows, missing = wgrad_cases(device, shapes, args.repeats), None
    except Exception as e:  # noqa: BLE001 - a failed build or load of the CUDA extension too
        rows, missing = [], f"wgrad cases not measured: {type(e).__name__}: {e}"
        print(missing, file=sys.stderr, flush=True)
    rows.append(adamw_case(device, elems, args.repeats))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"{name}, torch {torch.__version__}, best of {args.repeats} calls, two alternating passes", "",
             "| case | default ms | ours ms | ours / default | default | ours |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        unit = ("TFLOP/s", "tflops") if r["case"].startswith("wgrad") else ("GB/s", "gbs")
        ratio = r["ours_ms"] / r["default_ms"]
        lines.append(f"| {r['case']} | {r['default_ms']:.3f} | {r['ours_ms']:.3f} | {ratio:.2f} "
                     f"| {r[unit[1] + '_default']:.1f} {unit[0]} | {r[unit[1] + '_ours']:.1f} {unit[0]} |")
    table = "\n".join(lines)
    print(table)
    if missing:
        table += f"\n\n{missing}"
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows, "missing": missing}, indent=1))
    if missing:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
