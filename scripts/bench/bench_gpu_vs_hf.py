"""One GPU: this project's training step against transformers' LlamaForCausalLM, eager and compiled.

Variants, all on the same model shape, random token batch, global batch and optimizer settings:
  ours           AMSPEngine built as train.py builds it (amsp/build.py engine_from_config), one rank,
                 plan 1/1/1, bf16 weights with fp32 master, the model's own kernel options (attention
                 auto, norm auto, fused auto: what they resolve to is in the log).
  ours_compiled  the same with the project's compile switch on, when the project has one (detected;
                 otherwise the variant is skipped and the table says why).
  ours_overlap_update
                 ours with amsp.overlap_update=true: each unit's AdamW update runs on a side CUDA stream
                 beside the next forward (amsp/overlapped_update.py); step() keeps only the global norm.
  ours_fuse_wgrad
                 ours with amsp.fuse_wgrad=true: each linear layer's weight gradient is accumulated by its
                 own GEMM into the fp32 gradient buffer (amsp/wgrad_fusion.py), no separate accumulation pass.
  ours_adamw_csrc
                 ours with amsp.optimizer_kernel=csrc: one pass of csrc's AdamW per run, which also writes the
                 bf16 weights and does not write the clip-scaled gradient back.
  ours_fast      ours with both of the above.
  ours_no_optimizer
                 ours with the optimizer taken out (norm, update and spread skipped: every step counts as
                 skipped): the floor the optimizer's cost is read against. Exposed optimizer share of a
                 variant = 1 - its step time / this one's, measured in the same rounds. The CUDA-event share
                 brackets engine.step() only, which says nothing once the update runs inside the forward.
  hf             LlamaForCausalLM(attn_implementation="sdpa") from the same config, fp32 weights, bf16
                 autocast, torch.optim.AdamW(fused=True) and clip_grad_norm_(1.0) (ours clips too).
  hf_compiled    the same model object under torch.compile.

Memory. At the default 1.88B shape, ours holds ~18 bytes/parameter of model state (bf16 weights, fp32
gradient accumulator, fp32 master + Adam moments: 34 GB) and HF 16 (fp32 weights, gradients and
moments: 30 GB) plus autocast's bf16 weight copies; each also needs ~5-10 GB of activations at seq 4096.
Together that is ~80 GB: two do not fit beside each other on an 80 GB H100 with any margin, so every
round builds each variant, measures it and frees it before the next one (construction is part of what
is measured anyway). Rounds still alternate the variants, so a drift in clocks or temperature spreads
over all of them, and each variant's peak memory is its own window (reset before it is built).

Per variant and round: construction -> end of the first optimizer step (includes compilation), then
warm-up steps (not timed), then timed steps. Reported: tokens/s (median over rounds), step time, MFU
(flops_per_token: 6N' + 12*L*H*d*s per token, against the device's datasheet bf16 peak or
--peak-tflops; the measured bf16 matmul rate is printed next to it), the optimizer's share of the step
(CUDA events around the optimizer, no extra synchronisation), peak allocated memory of the steady
steps and of the whole window, and the construction-to-first-step time of round 1 (cold caches).

    python scripts/bench/bench_gpu_vs_hf.py --markdown scripts/gpu/results/gpu_bench.md
    python scripts/bench/bench_gpu_vs_hf.py --tiny --device cpu       # seconds; checks the code path
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from models.llama import LlamaConfig, flops_per_token, get_preset  # noqa: E402
from models.llama.model import lm_loss  # noqa: E402

log = logging.getLogger("bench_gpu_vs_hf")

VARIANTS = ("ours", "ours_compiled", "ours_overlap_update", "ours_fuse_wgrad", "ours_adamw_csrc", "ours_fast",
            "ours_no_optimizer", "hf", "hf_compiled")
FLOOR = "ours_no_optimizer"
LR = 1e-4
# Optimizer settings shared by both sides (configs/schema.py OptimConfig defaults).
BETAS, EPS, WEIGHT_DECAY, GRAD_CLIP = (0.9, 0.95), 1e-8, 0.1, 1.0


class VariantSkipped(Exception):
    """The variant cannot run in this checkout (the message says why); not a failure."""


# ---------------------------------------------------------------- timing


class Clock:
    """Marks on the device's timeline: CUDA events (no synchronisation) or host time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


# ---------------------------------------------------------------- the variants


def our_compile_switch() -> tuple[str, str] | None:
    """Where this checkout takes the model.compile switch, as (place, field), or None. Looked up rather
    than assumed because the switch is newer than this benchmark."""
    from amsp import build

    from configs.schema import AMSPConfig

    for place, names in (("model", LlamaConfig.field_names()),
                         ("amsp", [f.name for f in dataclasses.fields(AMSPConfig)]),
                         ("engine_from_config", _signature_params(build.engine_from_config))):
        if "compile" in names:
            return place, "compile"
    return None


def _apply_compile_fn():
    """amsp.compile.apply_compile(model, setting, device) where this checkout has it, else None."""
    try:
        from amsp.compile import apply_compile
    except ImportError:
        return None
    return apply_compile


def our_compile_route() -> str | None:
    """How ours_compiled gets compiled here, in words (None: it cannot be)."""
    switch = our_compile_switch()
    if switch:
        return f"switch {switch[0]}.{switch[1]}=on at construction"
    if _apply_compile_fn():
        return "amsp.compile.apply_compile(engine.model, 'on') after construction (no config switch found)"
    return None


def _signature_params(fn) -> list[str]:
    import inspect

    return list(inspect.signature(fn).parameters)


def _switch_value(current, on: bool):
    # The switch is auto|on|off (a string) or a bool, whichever the checkout defines.
    if isinstance(current, bool):
        return on
    return "on" if on else "off"


def blocks_compiled(model) -> bool:
    """True when any transformer block runs through torch.compile: its forward replaced on the
    instance (amsp/compile.py) or the block wrapped as an OptimizedModule."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any("forward" in vars(b) or isinstance(b, OptimizedModule) for b in model.layers)


def build_ours(cfg: LlamaConfig, device: torch.device, dtype_name: str, compiled: bool, seed: int,
               overlap_update: bool = False, optimizer: bool = True, fuse_wgrad: bool = False,
               optimizer_kernel: str = "auto"):
    from amsp.build import engine_from_config
    from amsp.launch import DistEnv
    from amsp.sharded_optim import PreparedStep, StepResult
    from configs.schema import AMSPConfig, OptimConfig

    amsp_cfg = AMSPConfig(plan="ddp", overlap_update=overlap_update, fuse_wgrad=fuse_wgrad,  # one rank: 1/1/1
                          optimizer_kernel=optimizer_kernel)
    optim_cfg = OptimConfig(weight_decay=WEIGHT_DECAY, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, grad_clip=GRAD_CLIP)
    extra = {}
    switch = our_compile_switch()
    if switch is None and compiled and _apply_compile_fn() is None:
        raise VariantSkipped("this checkout has no model.compile switch (looked for a `compile` field in "
                             "LlamaConfig and AMSPConfig, an engine_from_config parameter, amsp.compile.apply_compile)")
    if switch is not None:  # set explicitly both ways: its default (auto) would compile on CUDA
        place, name = switch
        if place == "model":
            cfg = cfg.with_overrides(**{name: _switch_value(getattr(cfg, name), compiled)})
        elif place == "amsp":
            setattr(amsp_cfg, name, _switch_value(getattr(amsp_cfg, name), compiled))
        else:
            import inspect

            default = inspect.signature(engine_from_config).parameters[name].default
            extra[name] = _switch_value(default, compiled)
    denv = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")
    engine = engine_from_config(amsp_cfg, optim_cfg, dtype_name, cfg, denv, device, seed, **extra)
    if fuse_wgrad and not engine.fused_linears:
        raise VariantSkipped("amsp.fuse_wgrad could not be applied here (the engine's warning in the log says why)")
    if compiled and not blocks_compiled(engine.model):
        if switch is not None:
            raise RuntimeError(f"{switch[0]}.{switch[1]} was set on but no transformer block is compiled")
        _apply_compile_fn()(engine.model, "on", device)
    if not compiled and blocks_compiled(engine.model):
        raise RuntimeError("the engine compiled the transformer blocks although the eager variant was asked for: "
                           "this benchmark does not know this checkout's compile switch")
    if not optimizer:  # every step skipped before its norm: no update, no spread, gradients dropped
        engine.optim.prepare = lambda lr: PreparedStep(StepResult(float("nan"), True, lr), None)

    def step(batch, clock: Clock):
        xs, ys = batch
        for i in range(len(xs)):
            engine.forward_backward(xs[i], ys[i], i, len(xs))
        before_optim = clock.mark()
        result = engine.step(LR)
        return before_optim, result.skipped

    return engine, step


def hf_config(cfg: LlamaConfig):
    from transformers import LlamaConfig as HFLlamaConfig

    from models.llama.hf import to_hf_config

    hf = HFLlamaConfig.from_dict(to_hf_config(cfg))
    hf.use_cache = False
    hf._attn_implementation = "sdpa"
    return hf


def _hf_rope_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None)  # transformers >= 5
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf.rope_theta)


def check_same_config(cfg: LlamaConfig, hf) -> None:
    pairs = {"vocab": (cfg.vocab_size, hf.vocab_size), "hidden": (cfg.dim, hf.hidden_size),
             "heads": (cfg.n_heads, hf.num_attention_heads), "kv heads": (cfg.n_kv_heads, hf.num_key_value_heads),
             "intermediate": (cfg.ffn_hidden_dim, hf.intermediate_size), "layers": (cfg.n_layers, hf.num_hidden_layers),
             "rope theta": (cfg.rope_theta, _hf_rope_theta(hf)), "norm eps": (cfg.norm_eps, hf.rms_norm_eps),
             "tied embeddings": (cfg.tie_embeddings, hf.tie_word_embeddings)}
    wrong = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if wrong:
        raise SystemExit(f"transformers config differs from ours (ours, theirs): {wrong}")


def build_hf(cfg: LlamaConfig, device: torch.device, autocast: bool, compiled: bool, seed: int,
             compile_backend: str = "inductor"):
    from transformers import LlamaForCausalLM

    hf = hf_config(cfg)
    check_same_config(cfg, hf)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised on the device: no host-side init of 1.9B parameters
        model = LlamaForCausalLM(hf)
    model.train()
    n = sum(p.numel() for p in model.parameters())
    if n != cfg.num_params():
        raise SystemExit(f"parameter counts differ: ours {cfg.num_params()}, transformers {n}")
    params = [p for p in model.parameters()]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            fused=fused, foreach=None if fused else True)
    run = torch.compile(model, backend=compile_backend) if compiled else model

    def step(batch, clock: Clock):
        xs, ys = batch
        for i in range(len(xs)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = run(input_ids=xs[i]).logits
            (lm_loss(logits, ys[i]) / len(xs)).backward()
        before_optim = clock.mark()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return before_optim, False

    return (model, opt, run), step


# ---------------------------------------------------------------- one measurement window


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure(name: str, args, cfg: LlamaConfig, device: torch.device, batch) -> dict:
    clock = Clock(device)
    free_memory(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    left_before = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    if name.startswith("ours"):
        holder, step = build_ours(cfg, device, args.dtype, name == "ours_compiled", args.seed,
                                  overlap_update=name == "ours_overlap_update", optimizer=name != FLOOR,
                                  fuse_wgrad=name in ("ours_fuse_wgrad", "ours_fast"),
                                  optimizer_kernel="csrc" if name in ("ours_adamw_csrc", "ours_fast") else "auto")
    else:
        holder, step = build_hf(cfg, device, autocast=args.dtype == "bf16", compiled=name == "hf_compiled",
                                seed=args.seed, compile_backend=args.compile_backend)
    clock.sync()
    built = time.perf_counter() - t0
    step(batch, clock)  # the first step: lazy state (optimizer moments), compilation, autotuning
    clock.sync()
    first = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        step(batch, clock)
    clock.sync()
    # Peaks are of this variant's own window: whatever an earlier variant left allocated is taken off.
    peak_window = torch.cuda.max_memory_allocated() - left_before if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    marks, skipped = [], 0
    w0 = time.perf_counter()
    for _ in range(args.steps):
        start = clock.mark()
        before_optim, was_skipped = step(batch, clock)
        marks.append((start, before_optim, clock.mark()))
        skipped += bool(was_skipped)
    clock.sync()
    wall = time.perf_counter() - w0
    peak_steady = torch.cuda.max_memory_allocated() - left_before if cuda else None
    if args.profile:  # after the timed steps and the peak: the profiler's own cost stays out of both
        profile_step(name, args.profile, step, batch, clock, device)
    step_s = [clock.seconds(a, c) for a, _, c in marks]
    optim_s = [clock.seconds(b, c) for _, b, c in marks]
    del holder, step
    free_memory(device)
    left_after = torch.cuda.memory_allocated() if cuda else 0
    if left_after - left_before > 256 * 2**20:
        from amsp.metrics.peak_breakdown import live_cuda_tensors

        log.warning("%s: still alive after it was freed:\n%s", name, live_cuda_tensors())
    return {"build_s": built, "first_step_s": first, "wall_s": wall, "step_s": step_s,
            "optimizer_share": sum(optim_s) / sum(step_s), "peak_steady": peak_steady, "peak_window": peak_window,
            "skipped_steps": skipped, "allocated_before": left_before, "allocated_after": left_after}


def profile_step(name: str, path: str, step, batch, clock: Clock, device: torch.device) -> None:
    """One more steady step under torch.profiler; its kernels by self time go to `path` (appended,
    one section per variant and round): where a variant's step goes, side by side with the others."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(batch, clock)
        clock.sync()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=90)
    with open(path, "a") as f:
        f.write(f"==== {name} (one steady step, sorted by {key}) ====\n{table}\n")


# ---------------------------------------------------------------- report


def peak_flops(args, device: torch.device) -> tuple[float | None, str]:
    from amsp.metrics import resolve_peak

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cpu" and args.peak_tflops is None:
        os.environ.setdefault("AMSP_CACHE_DIR", os.path.join(REPO, ".cache", "amsp"))
    p = resolve_peak(device, dtype, args.peak_tflops)
    return (p.flops, p.source) if p is not None else (None, "unknown device: pass --peak-tflops")


def measured_matmul_tflops(device: torch.device) -> float | None:
    """Best of a few bf16 8192^3 products: the rate this card really reaches for dense GEMMs."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        best = max(best, 2 * n ** 3 / (s.elapsed_time(e) / 1e3))
    del a, b
    free_memory(device)
    return best / 1e12


def _gib(value: int, measured) -> float | None:
    return None if measured is None else value / 2**30


def summarise(results: dict[str, list[dict]], tokens_per_step: int, fpt: float, peak: float | None) -> dict:
    out = {}
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r and "skipped" not in r]
        if not ok:
            reason = next((r.get("skipped") or r.get("error") for r in runs), "not run")
            out[name] = {"status": reason}
            continue
        tps = [tokens_per_step * len(r["step_s"]) / r["wall_s"] for r in ok]
        med = statistics.median(tps)
        out[name] = {
            "status": "ok" if len(ok) == len(runs) else f"{len(runs) - len(ok)} of {len(runs)} rounds failed",
            "tokens_per_s": med, "tokens_per_s_rounds": tps,
            "step_ms": tokens_per_step / med * 1e3,
            "mfu": med * fpt / peak if peak else None,
            "optimizer_share": statistics.median(r["optimizer_share"] for r in ok),
            "peak_steady_gib": _gib(max((r["peak_steady"] or 0) for r in ok), ok[0]["peak_steady"]),
            "peak_window_gib": _gib(max((r["peak_window"] or 0) for r in ok), ok[0]["peak_window"]),
            "build_s_round1": ok[0]["build_s"], "first_step_s_round1": ok[0]["first_step_s"],
            "first_step_s_later": [r["first_step_s"] for r in ok[1:]],
            "skipped_steps": sum(r["skipped_steps"] for r in ok),
        }
    floor = out.get(FLOOR, {}).get("step_ms")
    for name, s in out.items():
        if floor and "step_ms" in s and name.startswith("ours") and name != FLOOR:
            s["exposed_optimizer_share"] = 1 - floor / s["step_ms"]
    return out


def _fmt(v, spec: str, missing: str = "n/a") -> str:
    return missing if v is None else format(v, spec)


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def markdown(meta: dict, summary: dict) -> str:
    lines = [f"# GPU benchmark: this project vs transformers ({meta['date']})", "",
             f"- device: {meta['device_name']}; torch {meta['torch']}, transformers {meta['transformers']}, "
             f"CUDA {meta['cuda']}, cuDNN {meta['cudnn']}",
             f"- shape: {meta['shape']}; {_count(meta['params'])} parameters; seq {meta['seq']}, "
             f"{meta['micro_batches']} micro-batches of {meta['micro_batch']} per step "
             f"({meta['tokens_per_step']} tokens/step); dtype {meta['dtype']}",
             f"- FLOPs/token {meta['flops_per_token']:.4g} (6N' + 12*L*H*d*s); MFU peak "
             f"{_fmt(meta['peak_tflops'], '.4g')} TFLOP/s ({meta['peak_source']}); measured bf16 8192^3 matmul "
             f"{_fmt(meta['matmul_tflops'], '.0f')} TFLOP/s",
             f"- {meta['rounds_done']} rounds x {meta['steps']} timed steps after {meta['warmup']} warm-up steps per "
             f"variant and round; {meta['memory_plan']}",
             f"- ours compiled: {meta['ours_compile']}", ""]
    head = ("| variant | tokens/s | step ms | MFU | optimizer share (events in step()) | optimizer share (exposed, "
            f"vs {FLOOR}) | peak GiB (steady) | peak GiB (incl. first step) | build s | build + first step s (round 1) "
            "| status |")
    lines += [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in VARIANTS:
        if name not in summary:
            continue
        s = summary[name]
        if "tokens_per_s" not in s:
            lines.append(f"| {name} | | | | | | | | | | {s['status']} |")
            continue
        lines.append(
            f"| {name} | {s['tokens_per_s']:,.0f} | {s['step_ms']:.1f} | {_pct(s['mfu'])} "
            f"| {100 * s['optimizer_share']:.1f}% | {_pct(s.get('exposed_optimizer_share'))} "
            f"| {_fmt(s['peak_steady_gib'], '.2f')} | "
            f"{_fmt(s['peak_window_gib'], '.2f')} | {s['build_s_round1']:.1f} | {s['first_step_s_round1']:.1f} "
            f"| {s['status']} |")
    ref = summary.get("hf", {}).get("tokens_per_s")
    best_hf = max((summary.get(n, {}).get("tokens_per_s") or 0) for n in ("hf", "hf_compiled")) or None
    lines.append("")
    for name in ("ours", "ours_compiled", "ours_overlap_update", "ours_fuse_wgrad", "ours_adamw_csrc", "ours_fast"):
        t = summary.get(name, {}).get("tokens_per_s")
        if t and ref and best_hf:
            lines.append(f"- {name}: {t / ref:.2f}x transformers eager, {t / best_hf:.2f}x the faster transformers "
                         f"variant")
    lines.append("")
    lines.append("Per-round tokens/s: " + "; ".join(
        f"{n} " + ", ".join(f"{v:,.0f}" for v in s["tokens_per_s_rounds"])
        for n, s in summary.items() if "tokens_per_s_rounds" in s))
    later = {n: s["first_step_s_later"] for n, s in summary.items() if s.get("first_step_s_later")}
    if later:
        lines.append("Build + first step in later rounds (warm compile caches), s: " + "; ".join(
            f"{n} " + ", ".join(f"{v:.1f}" for v in vs) for n, vs in later.items()))
    if meta.get("notes"):
        lines += [""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def next_round_estimate(results: dict[str, list[dict]], round_times: list[float], args) -> float:
    """Seconds the next round should take. After round 1 (cold: compilation, autotuning, kernel
    builds) the caches are warm, so it is built from round 1's parts without the first step's
    excess over a steady step; from round 2 on, the last round's time."""
    if len(round_times) >= 2:
        return round_times[-1]
    total = 0.0
    for runs in results.values():
        last = runs[-1] if runs else {}
        if "step_s" in last:
            step = statistics.median(last["step_s"])
            total += last["build_s"] + (args.warmup + args.steps) * step + 5.0  # + freeing, allocator warm-up
    return total


def write_markdown(path: str | None, meta: dict, summary: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(markdown(meta, summary))
    os.replace(tmp, path)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama2_7b")
    ap.add_argument("--layers", type=int, default=8, help="n_layers override (8: 1.88B parameters for llama2_7b)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4, help="per optimizer step (gradient accumulation)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant and round (>= 1)")
    # The default keeps a check.sh call within its minutes: the opt-in fast paths together (ours_fast), the
    # floor, both baselines; any of VARIANTS on request.
    ap.add_argument("--variants", default="ours,ours_fast,ours_no_optimizer,hf,hf_compiled",
                    help=f"comma-separated, from {','.join(VARIANTS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of our model config, e.g. --set fused=off (repeatable)")
    ap.add_argument("--peak-tflops", type=float, help="MFU peak per device (default: datasheet bf16 peak)")
    ap.add_argument("--time-budget-s", type=float, help="start no round that would end after this many seconds")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of hf_compiled (eager: tracing only, for quick code-path checks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch threads on CPU")
    ap.add_argument("--markdown", help="write the table here (rewritten after every variant)")
    ap.add_argument("--json", help="write the raw numbers here")
    ap.add_argument("--profile", help="append a torch.profiler table of one more steady step per variant and round "
                    "(kernels by self time) to this file")
    ap.add_argument("--tiny", action="store_true",
                    help="debug preset, seq 64, 2 micro-batches, 1 round of 2 steps: checks the code path in seconds")
    args = ap.parse_args(argv)
    if args.tiny:
        args.preset, args.layers, args.seq, args.micro_batches = "debug", None, 64, 2
        args.rounds, args.steps, args.warmup = 1, 2, 1
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the first step compiles and allocates)")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    return args


def model_config(args) -> LlamaConfig:
    cfg = get_preset(args.preset)
    over: dict = {"max_seq_len": max(cfg.max_seq_len, args.seq)}
    if args.layers:
        over["n_layers"] = args.layers
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in LlamaConfig.field_names():
            raise SystemExit(f"--set {item}: {key!r} is not a model config field")
        current = getattr(cfg, key)
        over[key] = type(current)(value) if isinstance(current, (int, float)) and not isinstance(current, bool) \
            else (value.lower() in ("1", "true", "on") if isinstance(current, bool) else value)
    return cfg.with_overrides(**over)


def memory_plan(cfg: LlamaConfig, device: torch.device) -> str:
    n = cfg.num_params()
    ours, hf = 18 * n, 16 * n  # model state bytes/parameter, see the module docstring
    if device.type != "cuda":
        return "CPU: variants built and freed one at a time"
    total = torch.cuda.get_device_properties(device).total_memory
    return (f"model states alone: ours {ours / 1e9:.1f} GB + transformers {hf / 1e9:.1f} GB = "
            f"{(ours + hf) / 1e9:.1f} GB of {total / 1e9:.1f} GB before activations, so each variant is built, "
            f"measured and freed in turn, every round")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu with --tiny)")
    cfg = model_config(args)
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    tokens_per_step = args.seq * args.micro_batch * args.micro_batches
    fpt = flops_per_token(cfg, args.seq)
    peak, peak_source = peak_flops(args, device)
    matmul = measured_matmul_tflops(device)
    route = our_compile_route()
    ours_compile = route or "skipped: this checkout has no model.compile switch"
    import transformers

    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
            "shape": f"{args.preset}" + (f" with n_layers={cfg.n_layers}" if args.layers else ""),
            "params": cfg.num_params(), "seq": args.seq, "micro_batch": args.micro_batch,
            "micro_batches": args.micro_batches, "tokens_per_step": tokens_per_step, "dtype": args.dtype,
            "flops_per_token": fpt, "peak_tflops": peak / 1e12 if peak else None, "peak_source": peak_source,
            "matmul_tflops": matmul, "steps": args.steps, "warmup": args.warmup, "rounds_done": 0,
            "memory_plan": memory_plan(cfg, device), "ours_compile": ours_compile,
            "model_overrides": args.set, "notes": []}
    log.info("%s", json.dumps({k: v for k, v in meta.items() if k != "notes"}, default=str))

    g = torch.Generator(device="cpu").manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batches, args.micro_batch, args.seq + 1), generator=g)
    batch = (tokens[..., :-1].contiguous().to(device), tokens[..., 1:].contiguous().to(device))

    results: dict[str, list[dict]] = {v: [] for v in variants}
    started, round_times = time.perf_counter(), []
    failed = False
    for r in range(args.rounds):
        elapsed = time.perf_counter() - started
        estimate = next_round_estimate(results, round_times, args)
        if args.time_budget_s and r and elapsed + estimate > args.time_budget_s:
            meta["notes"].append(f"stopped after {r} of {args.rounds} rounds: another (~{estimate:.0f} s) would pass "
                                 f"the {args.time_budget_s:.0f} s budget ({elapsed:.0f} s used)")
            log.warning("%s", meta["notes"][-1])
            break
        order = variants if r % 2 == 0 else list(reversed(variants))
        t_round = time.perf_counter()
        meta["rounds_done"] = f"{r} (+ round {r + 1} in progress)"
        for name in order:
            log.info("round %d: %s", r + 1, name)
            try:
                res = measure(name, args, cfg, device, batch)
                log.info("round %d: %s %.0f tokens/s, optimizer %.1f%%, build + first step %.1f s", r + 1, name,
                         tokens_per_step * len(res["step_s"]) / res["wall_s"], 100 * res["optimizer_share"],
                         res["first_step_s"])
            except VariantSkipped as e:
                res = {"skipped": f"skipped: {e}"}
                log.warning("%s %s", name, res["skipped"])
            except torch.cuda.OutOfMemoryError as e:
                res = {"error": f"out of memory: {str(e).splitlines()[0]}"}
                failed = True
                log.error("%s: %s", name, res["error"])
            except Exception as e:  # keep measuring the others; the exit status reports it
                res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                failed = True
                log.error("%s failed:\n%s", name, traceback.format_exc())
            free_memory(device)
            if device.type == "cuda" and "allocated_after" in res and res["allocated_after"] > 256 * 2**20:
                note = (f"{name} left {res['allocated_after'] / 2**20:.0f} MiB allocated after it was freed; later "
                        f"variants' peaks include it")
                meta["notes"].append(note)
                log.warning("%s", note)
            results[name].append(res)
            # Rewritten after every variant: a run stopped from outside still leaves what it measured.
            write_markdown(args.markdown, meta, summarise(results, tokens_per_step, fpt, peak))
        round_times.append(time.perf_counter() - t_round)
        meta["rounds_done"] = r + 1
        write_markdown(args.markdown, meta, summarise(results, tokens_per_step, fpt, peak))
    summary = summarise(results, tokens_per_step, fpt, peak)
    text = markdown(meta, summary)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "rounds": results}, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
