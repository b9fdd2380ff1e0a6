"""Fused ops (csrc/) vs eager PyTorch vs torch.compile: forward + backward time and peak memory, on CPU
or (--device cuda) on a GPU.

LLaMA-7B-like shapes scaled to a CPU: dim 4096, SwiGLU hidden 11008, 32 heads of 128, vocab
32000, with few tokens. Each (op, variant) runs in its own subprocess so that peak memory is that
variant's alone: after a warm-up call (which also compiles), the kernel's peak-RSS mark is reset
(/proc/self/clear_refs = 5) and the peak RSS above the pre-call level is read back after one
forward + backward. That child runs with MALLOC_MMAP_THRESHOLD_=65536 so that glibc maps every
block over 64 KiB on its own and unmaps it when freed: RSS then follows the live tensors instead of
whatever the heap kept from the warm-up. Time is measured in a separate child with the default
allocator, as the best of --repeats forward + backward calls. Finishes with the model's forward + backward
tokens/s for model.fused=on and off, and the per-op decision for model.fused=auto
(>= 1.2x faster or >= 1.2x less peak memory than eager).

On CUDA (--device cuda; bf16 and a 4096-token micro-batch by default, the linear + cross-entropy at
LLaMA-2's dim 4096) time is the best wall time of --repeats synchronised forward + backward calls and
memory the allocator's peak above what was allocated before the call (torch.cuda.max_memory_allocated);
each (op, variant) still runs in its own process, so compile caches and peaks are its own. This is the
measurement that csrc/fused_cuda.cu's ops have not had yet on a GPU (models/llama/fused_ops.py).

The project's machines are shared (load averages far above the 2 cores are common), so by default
each run uses one thread and the comparison uses CPU time (time.process_time), which other
processes disturb far less than wall time; both are printed. --threads 2 measures the parallel
kernels when the machine is quiet.

    python scripts/bench/bench_fused.py            # everything, prints markdown for BENCHMARKS.md
    python scripts/bench/bench_fused.py --ops rms_norm --variants eager,fused
    python scripts/bench/bench_fused.py --device cuda     # on a GPU machine
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = ("rms_norm", "rope", "swiglu", "linear_cross_entropy")
VARIANTS = ("eager", "compile", "fused")
AUTO_THRESHOLD = 1.2
CE_DIM = 512  # hidden size of the linear + cross-entropy case (tokens default to 2 * CE_DIM)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _make_case(op: str, variant: str, tokens: int, dtype, device: str = "cpu"):
    """(callable doing one forward + backward, description of the shapes)."""
    import torch
    import torch.nn.functional as F

    from models.llama import fused
    from models.llama.backends import rms_norm_reference
    from models.llama.config import LlamaConfig
    from models.llama.model import apply_rope, lm_loss, rope_tables

    torch.manual_seed(0)
    dim, hidden, heads, head_dim, vocab = 4096, 11008, 32, 128, 32000
    leaf = lambda *shape, scale=1.0: (torch.randn(*shape) * scale).to(device, dtype).requires_grad_()  # noqa: E731
    if op == "rms_norm":
        x, w = leaf(tokens, dim), leaf(dim)
        eager = lambda: rms_norm_reference(x, w, 1e-5)  # noqa: E731
        fn = {"eager": eager, "compile": torch.compile(eager), "fused": lambda: fused.rms_norm(x, w, 1e-5)}[variant]
        params, desc = (x, w), f"x ({tokens}, {dim})"
    elif op == "rope":
        cos, sin = (t.to(device) for t in rope_tables(LlamaConfig(dim=dim, n_heads=heads, max_seq_len=tokens), tokens))
        x = leaf(1, tokens, heads, head_dim)
        eager = lambda: apply_rope(x, cos, sin)  # noqa: E731
        fn = {"eager": eager, "compile": torch.compile(eager),
              "fused": lambda: fused.apply_rope(x, cos, sin)}[variant]
        params, desc = (x,), f"q (1, {tokens}, {heads}, {head_dim})"
    elif op == "swiglu":
        a, b = leaf(tokens, hidden), leaf(tokens, hidden)
        eager = lambda: F.silu(a) * b  # noqa: E731
        fn = {"eager": eager, "compile": torch.compile(eager), "fused": lambda: fused.swiglu(a, b)}[variant]
        params, desc = (a, b), f"a, b ({tokens}, {hidden})"
    elif op == "linear_cross_entropy":
        # The head's memory story depends on tokens vs dim: logits are tokens x vocab, the weight
        # gradient vocab x dim. A 7B run's 8192-token micro-batch at dim 4096 has tokens = 2 * dim;
        # this keeps that ratio and vocab 32000 at a size a shared 2-core machine can time.
        dim = CE_DIM if device == "cpu" else dim  # a GPU takes LLaMA-2's own head
        h, w = leaf(tokens, dim), leaf(vocab, dim, scale=0.02)
        t = torch.randint(0, vocab, (tokens,)).to(device)
        eager = lambda: lm_loss(F.linear(h, w)[None], t[None])  # noqa: E731
        fn = {"eager": eager, "compile": torch.compile(eager),
              "fused": lambda: fused.linear_cross_entropy(h, w, t)}[variant]
        params, desc = (h, w), f"h ({tokens}, {dim}), W ({vocab}, {dim})"
    else:
        raise ValueError(f"unknown op {op!r}")
    if variant == "fused" and fused.load_ops() is None:
        raise SystemExit("the native extension could not be built")

    def step():
        for p in params:
            p.grad = None
        out = fn()
        out.backward(torch.ones_like(out) if out.dim() == 0 else grad_out.setdefault("g", torch.randn_like(out)))

    grad_out: dict = {}
    return step, desc


MODEL_DIM = 512  # whole-model case: 4 layers of head_dim 128 and LLaMA's 32000 vocabulary


def _model_case(fused_choice: str, tokens: int, batch: int, dtype, device: str = "cpu"):
    import torch

    from models.llama.config import LlamaConfig
    from models.llama.model import build_model

    cfg = LlamaConfig(dim=MODEL_DIM, n_layers=4, n_heads=MODEL_DIM // 128, vocab_size=32000, multiple_of=256,
                      max_seq_len=tokens, fused=fused_choice)
    model = build_model(cfg, dtype=dtype).to(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        model(x, y).backward()

    return step, (f"dim {MODEL_DIM}, 4 layers, {MODEL_DIM // 128} heads of 128, vocab 32000, "
                  f"batch {batch} x {tokens} tokens")


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.op == "model":
        step, desc = _model_case(args.variant, args.tokens, args.batch, dtype, args.device)
    else:
        step, desc = _make_case(args.op, args.variant, args.tokens, dtype, args.device)
    step()  # warm-up: compiles (torch.compile) and sizes the allocator
    if args.device == "cuda":
        print(json.dumps({**_cuda_measure(step, args.measure, args.repeats), "desc": desc}))
        return
    if args.measure == "memory":
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM)
        base = _rss_kib("VmRSS")
        step()
        print(json.dumps({"peak_mib": (_rss_kib("VmHWM") - base) / 1024, "desc": desc}))
        return
    walls, cpus = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    print(json.dumps({"time_s": min(cpus), "wall_s": min(walls), "desc": desc}))


def _cuda_measure(step, measure: str, repeats: int) -> dict:
    """Peak allocator memory above the call's start, or the best synchronised wall time (a GPU's time is
    not the process's CPU time; time_s and wall_s are both that)."""
    import torch

    torch.cuda.synchronize()
    if measure == "memory":
        gc.collect()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return {"peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    return {"time_s": min(walls), "wall_s": min(walls)}


def run_child(op: str, variant: str, args) -> dict:
    """Time and peak memory of one (op, variant), each from its own subprocess."""
    result = {}
    for measure in ("time", "memory"):
        result.update(_run_child(op, variant, args, measure))
    return result


def _run_child(op: str, variant: str, args, measure: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--measure", measure, "--op", op, "--variant", variant, "--tokens",
           str(args.ce_tokens if op == "linear_cross_entropy" else args.model_tokens if op == "model" else args.tokens),
           "--repeats", str(args.repeats), "--dtype", args.dtype, "--batch", str(args.batch),
           "--threads", str(args.threads), "--device", args.device]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    if measure == "memory" and args.device == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{op}/{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--op", default=None)
    p.add_argument("--variant", default=None)
    p.add_argument("--measure", default="time", choices=("time", "memory"), help=argparse.SUPPRESS)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--tokens", type=int, default=None, help="tokens for the elementwise ops (1024; 4096 on CUDA)")
    p.add_argument("--ce-tokens", type=int, default=None,
                   help=f"tokens for linear + cross-entropy ({2 * CE_DIM}; 4096 on CUDA)")
    p.add_argument("--model-tokens", type=int, default=512, help="sequence length of the model run")
    p.add_argument("--batch", type=int, default=1, help="batch of the model run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-model", action="store_true")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.tokens = args.tokens or (4096 if cuda else 1024)
    args.ce_tokens = args.ce_tokens or (4096 if cuda else 2 * CE_DIM)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.child:
        child(args)
        return
    results: dict[tuple[str, str], dict] = {}
    ops, variants = [o for o in args.ops.split(",") if o], args.variants.split(",")
    where = "CUDA" if cuda else f"{args.threads} thread(s)"
    clock = "GPU ms" if cuda else "CPU ms"
    print(f"| op | shapes ({args.dtype}, {where}) | variant | fwd+bwd {clock} | wall ms | peak MiB "
          "| time vs eager | memory vs eager |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for op in ops:
        for variant in variants:
            r = results[(op, variant)] = run_child(op, variant, args)
            e = results.get((op, "eager"))
            t_ratio = f"{e['time_s'] / r['time_s']:.2f}x" if e else "-"
            m_ratio = f"{e['peak_mib'] / max(r['peak_mib'], 1e-3):.2f}x" if e else "-"
            print(f"| {op} | {r['desc']} | {variant} | {r['time_s'] * 1e3:.1f} | {r['wall_s'] * 1e3:.1f} | "
                  f"{r['peak_mib']:.1f} | {t_ratio} | {m_ratio} |", flush=True)
    if ops and "eager" in variants and "fused" in variants:
        print("\nmodel.fused=auto decision (fused vs eager, threshold "
              f"{AUTO_THRESHOLD}x in time or memory):")
        for op in ops:
            e, f = results[(op, "eager")], results[(op, "fused")]
            t, m = e["time_s"] / f["time_s"], e["peak_mib"] / max(f["peak_mib"], 1e-3)
            verdict = "enable" if t >= AUTO_THRESHOLD or m >= AUTO_THRESHOLD else "keep eager"
            print(f"- {op}: time {t:.2f}x, memory {m:.2f}x -> {verdict}")
    if not args.no_model:
        print(f"\n| model fwd+bwd | model.fused | tokens/s ({clock[:3]} time) | {clock} | wall ms | peak MiB |")
        print("|---|---|---:|---:|---:|---:|")
        for choice in ("off", "on", "auto"):
            r = run_child("model", choice, args)
            tok = args.batch * args.model_tokens
            print(f"| {r['desc']} | {choice} | {tok / r['time_s']:.0f} | {r['time_s'] * 1e3:.0f} | "
                  f"{r['wall_s'] * 1e3:.0f} | {r['peak_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
