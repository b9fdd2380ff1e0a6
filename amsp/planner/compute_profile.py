"""Measured compute of one rank at the run's shape: what the cost model uses instead of FLOPs at an
assumed MFU when it is given (cost_model.Options.compute).

The interface between the measurement (startup) and the cost model; every time is for one
micro-batch at the run's micro-batch size, sequence length and dtype. measure_profile builds one
block + head + embedding with the model code (models/llama/model.py) on the run's device, times them
(warm-up, median of a few repeats, synchronised on CUDA) and, with several ranks, how much a
concurrent data-plane all_reduce of one block's bytes slows the block's forward+backward. Cached on
disk keyed by device, model shape, sequence, micro-batch, dtype, recomputation, torch version and
world, so a restarted job skips it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import pathlib
import statistics
import time
from dataclasses import asdict, dataclass, replace
from dataclasses import field as dc_field

from .update_cost import adam_bytes_per_elem


@dataclass(frozen=True)
class ComputeProfile:
    block_forward_s: float  # one block, one micro-batch, at the run's shape and dtype
    block_backward_s: float  # without recomputation
    head_forward_backward_s: float  # final norm + output head + loss, forward+backward
    embedding_s: float  # forward+backward of the embedding (tiny)
    overlap_slowdown: float | None  # compute seconds lost per second of hidden comm; None: preset
    source: str  # "measured on <device>", "cache", "file:..."
    # one AdamW step (the engine's kernel) per optimizer element, every rank stepping at once; None: the
    # cluster's memory bandwidth prices it
    optimizer_s_per_elem: float | None = None
    # the AdamW kernel optimizer_s_per_elem timed (sharded_optim.resolve_kernel's name); None: fused, as
    # profiles stored before the field were timed
    optimizer_kernel: str | None = None
    # The cache file this profile was read from or written to (not stored in it): the recheck removes a
    # file whose profile the run's own steps contradict (cache_file.forget_if_stale).
    cache_file: str | None = dc_field(default=None, compare=False)
    # Under tensor parallelism the block, head and embedding times come from the TP units' cache file
    # (startup.tp_local_profile): the recheck removes that one too, or a TP run would plan from it forever.
    units_cache_file: str | None = dc_field(default=None, compare=False)

    def cache_files(self) -> list[str]:
        return [f for f in (self.cache_file, self.units_cache_file) if f]


# ---- measurement at startup -------------------------------------------------------------------

log = logging.getLogger(__name__)

FIELDS = ("block_forward_s", "block_backward_s", "head_forward_backward_s", "embedding_s")
OPTIMIZER_ELEMS = 2**22  # 64 MiB of fp32 master, grads and moments: past the caches, as a model's shard is


def default_cache_dir() -> pathlib.Path:
    from .probe import default_cache_dir as probe_dir

    return probe_dir().parent / "compute"


def device_name(device) -> str:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from amsp.metrics.peak import cpu_model_name

    return f"{cpu_model_name()} ({torch.get_num_threads()} threads)"


_REPO = pathlib.Path(__file__).resolve().parents[2]
# The code a timing runs, besides torch: a profile or compile choice timed with other kernels (a faster
# CUDA kernel, another rope formulation under torch.compile) must be measured again, not read.
TIMED_SOURCES = ("models/llama/*.py", "csrc/fused_cpu.cpp", "csrc/fused_cuda.cu", "csrc/*.h", "csrc/loader.py",
                 "amsp/compile.py", "amsp/sharded_optim.py", "amsp/grad_accumulate.py")


@functools.lru_cache(maxsize=1)
def timed_code_hash() -> str:
    """A hash of TIMED_SOURCES' contents (12 hex digits)."""
    h = hashlib.sha256()
    for pattern in TIMED_SOURCES:
        for path in sorted(_REPO.glob(pattern)):
            h.update(path.relative_to(_REPO).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


def cache_key(model_cfg, seq_len: int, micro_batch: int, dtype: str, recompute: str, device, world: int,
              backend: str | None, cores_shared: bool = False, layout: list | None = None,
              compiled: bool = False, ranks_per_node: int | None = None, optimizer_kernel: str = "fused") -> str:
    """layout: a mixed cluster's (node group, device name) of every rank; None keeps a uniform run's key.
    Everything that changes what is timed is in it: the kernels the block runs (fused ops, norm backend,
    compiled or not) and their code (timed_code_hash), the AdamW kernel timed (resolved: fused, foreach or
    csrc), and where the ranks sit (the overlap slowdown's all_reduce crosses nodes or not)."""
    import torch

    shape = {"device": device_name(device), "dim": model_cfg.dim, "ffn": model_cfg.ffn_hidden_dim,
             "heads": model_cfg.n_heads, "kv_heads": model_cfg.n_kv_heads, "vocab": model_cfg.vocab_size,
             "tie": model_cfg.tie_embeddings, "attention": str(model_cfg.attention), "seq": seq_len,
             "mbs": micro_batch, "dtype": dtype, "recompute": recompute, "torch": torch.__version__,
             "world": world, "backend": backend, "cores_shared": cores_shared, "optimizer": optimizer_kernel,
             "fused": str(model_cfg.fused), "norm": str(model_cfg.norm), "compiled": compiled,
             "ranks_per_node": ranks_per_node, "code": timed_code_hash()}
    if layout is not None:
        shape["layout"] = [list(x) for x in layout]
    return hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


MIN_SAMPLE_S = 0.2  # one timing sample spans at least this long (up to MAX_CALLS calls)
MAX_CALLS = 50


def sample_plan(first_call_s: float, repeats: int, budget_s: float) -> tuple[int, int]:
    """(calls per sample, samples) for a call that took first_call_s once. A sample spans >= MIN_SAMPLE_S:
    ranks that share CPU cores are scheduled in time slices of a few ms, and a single 20-50 ms call caught
    one rank running alone on a core or waiting for one (the same unit measured 30 to 77 ms from one
    startup to the next); averaged over 0.2 s the slices even out. Fewer samples when the calls are slow
    (a large block on a CPU), so the whole profile stays within a few seconds."""
    t = max(first_call_s, 1e-9)
    calls = max(1, min(MAX_CALLS, math.ceil(MIN_SAMPLE_S / t)))
    return calls, max(1, min(repeats, int(budget_s / (calls * t))))


def median_time(fn, device, repeats: int, budget_s: float = 1.0, agree: bool = False) -> float:
    """Median seconds of one call over `repeats` samples of several calls (sample_plan), after a warm-up.
    agree: `fn` runs collectives, so every rank must call it as often: the plan follows the slowest rank's
    warm-up (collective over the world)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()  # warm-up: allocation, kernel selection, connections
    _sync(device)
    first = time.perf_counter() - t0
    if agree:
        from amsp import control

        first = control.all_reduce_max_floats([first])[0]
    calls, repeats = sample_plan(first, repeats, budget_s)
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _one_block_model(model_cfg, device, dtype):
    """The model code with one block (build_model: meta-built, seeded init): the block, head and embedding
    at the run's width. No recomputation: the cost model adds it (Options.compute's convention)."""
    from models.llama.model import build_model

    return build_model(replace(model_cfg, n_layers=1, activation_checkpointing="none"), device, dtype)


def one_block_inputs(model_cfg, seq_len: int, micro_batch: int, dtype_name: str, device, compiled: bool):
    """(one-block model, tokens, x, cos, sin, output gradient) at the run's shape on `device`, the block
    compiled as model.compile=on compiles it when `compiled`; seeded, so every timing sees the same data."""
    import torch

    if seq_len > model_cfg.max_seq_len:  # train.py's config check refuses this too; a direct caller gets it here
        raise ValueError(f"sequence length {seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}: the "
                         "block's rotary tables have only that many positions")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = _one_block_model(model_cfg, device, dtype)
    if compiled:
        from amsp.compile import apply_compile

        apply_compile(model, "on", device)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len), generator=g).to(device)
    x = (torch.randn(micro_batch, seq_len, model_cfg.dim, generator=g) * 0.5).to(device, dtype).requires_grad_()
    return model, tokens, x, model.rope_cos[:seq_len], model.rope_sin[:seq_len], torch.ones_like(x)


# A backward does twice its forward's matmul work: a difference below half the forward is the noise of a
# busy machine (a forward median above the forward + backward one gave a backward of 0 s under load).
PLAUSIBLE_BACKWARD = 0.5
BACKWARD_ATTEMPTS = 3


def _compiled_block_times(block, x, cos, sin, grad, device, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of a compiled block, the backward as (forward + backward) - forward,
    timed again while that difference is implausible; still implausible, it is priced at twice the
    forward, said in a warning."""
    for _ in range(BACKWARD_ATTEMPTS):
        fwd = median_time(lambda: block(x, cos, sin), device, repeats)
        bwd = median_time(lambda: block(x, cos, sin).backward(grad), device, repeats) - fwd
        if bwd >= PLAUSIBLE_BACKWARD * fwd:
            return fwd, bwd
    log.warning("compute profile: the compiled block's backward timed %.2f ms beside a %.2f ms forward in %d "
                "tries (a busy machine?); priced at twice the forward", bwd * 1e3, fwd * 1e3, BACKWARD_ATTEMPTS)
    return fwd, 2 * fwd


def time_compute(model_cfg, seq_len: int, micro_batch: int, dtype_name: str, device, repeats: int = 3,
                 compiled: bool = False):
    """({field: seconds} for one micro-batch on this process's device, the parts the overlap
    measurement reuses). compiled: the run compiles its blocks (model.compile; amsp/compile.py), so the
    block timed is compiled the same way: an inductor block runs at another speed than the eager one."""
    import torch

    device = torch.device(device)
    model, tokens, x, cos, sin, grad = one_block_inputs(model_cfg, seq_len, micro_batch, dtype_name, device, compiled)
    block, head, emb = model.layers[0], model.head, model.tok_embeddings
    tied = emb.weight if model_cfg.tie_embeddings else None

    if compiled:
        # Compile outside the timing (median_time sizes its samples from its warm-up call, which would
        # then be the compilation), and time the forward with autograd on, as training runs it: under
        # no_grad dynamo would compile a second, inference graph. A compiled backward donates its
        # buffers, so it cannot run twice on one graph (retain_graph): forward + backward is timed
        # whole and the forward taken off.
        block(x, cos, sin).backward(grad)
        _sync(device)
        fwd, bwd = _compiled_block_times(block, x, cos, sin, grad, device, repeats)
    else:
        with torch.no_grad():
            fwd = median_time(lambda: block(x, cos, sin), device, repeats)
        out = block(x, cos, sin)  # one graph, its backward timed repeatedly (retain_graph)
        bwd = median_time(lambda: out.backward(grad, retain_graph=True), device, repeats)
        del out
    head_s = median_time(lambda: head(x, tied, tokens).backward(), device, repeats)
    emb_s = median_time(lambda: emb(tokens).backward(grad), device, repeats)
    return {"block_forward_s": fwd, "block_backward_s": bwd,
            "head_forward_backward_s": head_s, "embedding_s": emb_s}, (block, x, cos, sin, grad)


def time_optimizer(device, elems: int = OPTIMIZER_ELEMS, repeats: int = 3, kernel: str = "auto") -> float:
    """Seconds per element of one AdamW step on fp32 master weights, with the kernel ShardedAdamW runs for
    amsp.optimizer_kernel=`kernel` on this device (sharded_optim.resolve_kernel: auto is
    torch._fused_adamw_, else torch._foreach_*), called as the engine calls it with gradient clipping on
    (the default): the clip scale as grad_scale, so the fused kernel writes each gradient back divided by
    it and csrc's one pass does not (update_cost.ADAM_BYTES_PER_ELEM). A memory-bound pass whose rate a
    preset's memory bandwidth only guesses (on CPU the ranks also share the cores)."""
    import torch

    from amsp.sharded_optim import resolve_kernel

    device = torch.device(device)
    kernel, _ = resolve_kernel(kernel, device)
    g = torch.Generator(device="cpu").manual_seed(0)
    p, grad = (torch.randn(elems, generator=g).to(device) for _ in range(2))
    m, v = torch.zeros(elems, device=device), torch.zeros(elems, device=device)
    step = torch.zeros((), device=device)
    scale = torch.ones((), device=device)  # the clip scale (sharded_optim.ShardedAdamW.prepare)
    if kernel == "fused":
        def run():
            torch._fused_adamw_([p], [grad], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False, grad_scale=scale)
    elif kernel == "csrc":  # fp32 masters: no compute weights written in the pass (an empty out)
        no_out = torch.empty(0, device=device)

        def run():
            torch.ops.amsp_fused.adamw_update(p, grad, m, v, no_out, scale, 1e-4, 0.1, 0.9, 0.95, 1e-8, 1e-3, 0.5)
    else:
        def run():  # the foreach path's passes (sharded_optim.ShardedAdamW._foreach)
            torch._foreach_div_([grad], scale)
            torch._foreach_mul_([p], 1 - 1e-5)
            torch._foreach_lerp_([m], [grad], 0.1)
            torch._foreach_mul_([v], 0.95)
            torch._foreach_addcmul_([v], [grad], [grad], 0.05)
            denom = torch._foreach_sqrt([v])
            torch._foreach_div_(denom, 0.5)
            torch._foreach_add_(denom, 1e-8)
            torch._foreach_addcdiv_([p], [m], denom, -1e-4)
    seconds = median_time(run, device, repeats)
    del p, grad, m, v
    return seconds / elems


def measure_overlap_slowdown(parts, device, comm_bytes: int, repeats: int = 3) -> float:
    """Compute seconds lost per second of communication hidden behind it, on this rank: a block's
    forward+backward alone vs while an all_reduce of comm_bytes (a block's gradients) runs on the
    data plane (every rank calls this at once; collective)."""
    import torch
    import torch.distributed as dist

    from amsp import control
    from amsp.routing_check import data_plane

    block, x, cos, sin, grad = parts
    buf = torch.ones(max(1, comm_bytes // 4), device=device)

    def compute():
        block(x, cos, sin).backward(grad)

    def comm_alone():
        with data_plane():
            dist.all_reduce(buf)

    def together():
        with data_plane():
            work = dist.all_reduce(buf, async_op=True)
        compute()
        _sync(device)
        t_compute = time.perf_counter()
        with data_plane():
            work.wait()
        return t_compute

    alone = median_time(compute, device, repeats)
    control.barrier()
    comm = median_time(comm_alone, device, repeats, agree=True)
    slowed = []
    together()  # warm-up
    for _ in range(repeats):
        control.barrier()
        _sync(device)
        t0 = time.perf_counter()
        slowed.append(together() - t0)
    with_comm = statistics.median(slowed)
    hidden = min(comm, with_comm)
    return max(0.0, with_comm - alone) / hidden if hidden > 0 else 0.0


def measure_profile(model_cfg, seq_len: int, micro_batch: int, dtype_name: str, recompute: str, device,
                    world: int, rank: int, cache_dir: pathlib.Path | None = None, use_cache: bool = True,
                    overlap_fallback: float | None = None, cores_shared: bool = False, compiled: bool = False,
                    ranks_per_node: int | None = None, optimizer_kernel: str = "auto") -> ComputeProfile:
    """The run's ComputeProfile: cached, else measured on every rank at once (the ranks of a machine
    share it, as in training) with the median over ranks kept. Collective when world > 1.

    cores_shared: this machine's ranks oversubscribe its CPU cores (from_config.cpu_shared_cores). No
    core is then idle to run the communication, so its CPU time is taken from compute one for one: the
    overlap slowdown is 1 by construction (measured there it read anything from 0.2 to 1.0 from one run
    to the next, the difference of two noisy timings), and it is not measured.
    compiled: time a compiled block (the run's model.compile resolved). ranks_per_node: part of the key.
    optimizer_kernel: the run's amsp.optimizer_kernel, the AdamW kernel timed."""
    return _measure(model_cfg, seq_len, micro_batch, dtype_name, recompute, device, world, rank, cache_dir,
                    use_cache, overlap_fallback, cores_shared, None, compiled, ranks_per_node,
                    optimizer_kernel)[ALL_RANKS]


def measure_group_profiles(model_cfg, seq_len: int, micro_batch: int, dtype_name: str, recompute: str, device,
                           world: int, rank: int, rank_groups: list[str], cache_dir: pathlib.Path | None = None,
                           use_cache: bool = True, cores_shared: bool = False,
                           optimizer_kernel: str = "auto") -> dict[str, ComputeProfile]:
    """One ComputeProfile per node group of a mixed cluster (rank_groups[r]: rank r's group): measured
    as measure_profile measures, every rank at once, each group keeping the median of its own ranks, so
    a slower kind of node is priced at its own speed. Cached under the groups and every rank's device.
    Collective (world > 1)."""
    return _measure(model_cfg, seq_len, micro_batch, dtype_name, recompute, device, world, rank, cache_dir,
                    use_cache, None, cores_shared, list(rank_groups), optimizer_kernel=optimizer_kernel)


ALL_RANKS = "all ranks"


def medians_by_group(rows: list[list[float]], rank_groups: list[str]) -> dict[str, list[float]]:
    """{group: column-wise median of its ranks' rows}, groups in order of their first rank."""
    out: dict[str, list] = {}
    for row, g in zip(rows, rank_groups, strict=True):
        out.setdefault(g, []).append(row)
    return {g: [statistics.median(col) for col in zip(*members)] for g, members in out.items()}


def _measure(model_cfg, seq_len, micro_batch, dtype_name, recompute, device, world, rank, cache_dir, use_cache,
             overlap_fallback, cores_shared, rank_groups: list[str] | None, compiled: bool = False,
             ranks_per_node: int | None = None, optimizer_kernel: str = "auto") -> dict[str, ComputeProfile]:
    import torch
    import torch.distributed as dist

    from amsp import control
    from amsp.sharded_optim import resolve_kernel

    from .cache_file import read_shared, write_atomic

    device = torch.device(device)
    optimizer_kernel, _ = resolve_kernel(optimizer_kernel, device)
    distributed = world > 1 and dist.is_initialized()
    backend = dist.get_backend() if distributed else None
    layout = None
    if rank_groups is not None:  # a mixed cluster: which group each rank is in and what it runs on
        if len(rank_groups) != world or not distributed:
            raise ValueError(f"measure_group_profiles: {len(rank_groups)} rank groups for a world of {world}"
                             f"{'' if distributed else ' without a process group'}")
        layout = rank_layout(rank_groups, device)
    key = cache_key(model_cfg, seq_len, micro_batch, dtype_name, recompute, device, world, backend, cores_shared,
                    layout, compiled, ranks_per_node, optimizer_kernel)
    path = (cache_dir or default_cache_dir()) / f"compute-{key}.json"
    field = "profile" if layout is None else "profiles"
    cached = read_shared(path, field, use_cache, rank, distributed, "compute profile")
    if cached is not None:
        got = {ALL_RANKS: cached} if layout is None else cached
        profiles = {g: ComputeProfile(**{**v, "source": f"cache ({v['source']})", "cache_file": str(path)})
                    for g, v in got.items()}
        if rank == 0:
            for g, prof in profiles.items():
                log.info("compute profile%s: cached %s: %s", _of(g), path, describe(prof))
        return profiles

    if rank == 0:
        log.info("compute profile: timing one %sblock (dim %d, micro-batch %d x %d, %s) forward/backward, the head "
                 "and the embedding on %s%s%s", "compiled " if compiled else "", model_cfg.dim, micro_batch, seq_len,
                 dtype_name, device_name(device),
                 ", then with a concurrent all_reduce" if distributed else "",
                 "; each node group keeps its own ranks' median" if layout is not None else "")
    t0 = time.perf_counter()
    times, parts = time_compute(model_cfg, seq_len, micro_batch, dtype_name, device, compiled=compiled)
    # every rank at once, as the engine's step runs
    times["optimizer_s_per_elem"] = time_optimizer(device, kernel=optimizer_kernel)
    fields = list(times)
    if distributed:
        block_bytes = sum(p.numel() * p.element_size() for p in parts[0].parameters())
        mine = 1.0 if cores_shared else measure_overlap_slowdown(parts, device, block_bytes)
        rows = control.all_gather_object([times[f] for f in fields] + [mine])
        if cores_shared and rank == 0:
            log.info("compute profile: the ranks share this machine's cores, so hidden communication takes its "
                     "CPU time from compute one for one: overlap slowdown 1 (not measured)")
    else:
        rows = [[times[f] for f in fields] + [None]]
        if rank == 0:
            log.info("compute profile: a single process has no concurrent communication to measure; overlap "
                     "slowdown from %s", "the cluster preset" if overlap_fallback is None else "the config")
    del parts  # the one-block model: freed before the engine allocates, and kept out of the run's peak
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    where = dict(layout) if layout is not None else {ALL_RANKS: device_name(device)}
    groups = rank_groups or [ALL_RANKS] * len(rows)
    profiles = {}
    for g, med in medians_by_group([r[:-1] for r in rows], groups).items():
        slow = [r[-1] for r, rg in zip(rows, groups) if rg == g and r[-1] is not None]
        profiles[g] = ComputeProfile(**dict(zip(fields, med)),
                                     overlap_slowdown=min(1.0, statistics.median(slow)) if slow else None,
                                     optimizer_kernel=optimizer_kernel,
                                     source=f"measured on {where[g]}{', compiled' if compiled else ''}",
                                     cache_file=str(path))
    if rank == 0:
        for g, prof in profiles.items():
            log.info("compute profile%s (%.2f s to measure): %s", _of(g), time.perf_counter() - t0, describe(prof))
        payload = _stored(profiles[ALL_RANKS]) if layout is None else {g: _stored(v) for g, v in profiles.items()}
        # "shape": what was timed, readable (the key is a hash), so `--compute-profile FILE` can refuse the
        # file for another model or device; the key and the field train.py reads are unchanged
        shape = measured_shape(model_cfg, seq_len, micro_batch, dtype_name, device.type, device_name(device))
        write_atomic(path, {"key": key, "shape": shape, field: payload})
    return profiles


def _stored(profile: ComputeProfile) -> dict:
    return {k: v for k, v in asdict(profile).items() if k not in ("cache_file", "units_cache_file")}


def rank_layout(rank_groups: list[str], device) -> list[tuple[str, str]]:
    """(node group, device name) of every rank: part of a mixed cluster's cache keys. Collective."""
    from amsp import control

    return list(zip(rank_groups, control.all_gather_object(device_name(device)), strict=True))


def _of(group: str) -> str:
    return "" if group == ALL_RANKS else f" of node group {group}"


def describe(p: ComputeProfile) -> str:
    slow = "preset" if p.overlap_slowdown is None else f"{p.overlap_slowdown:.3f} s/s"
    opt = ("" if p.optimizer_s_per_elem is None else
           f", AdamW step {p.optimizer_s_per_elem * 1e9:.2f} ns/element ({p.optimizer_kernel or 'fused'})")
    return (f"block fwd {p.block_forward_s * 1e3:.2f} ms, bwd {p.block_backward_s * 1e3:.2f} ms, head fwd+bwd "
            f"{p.head_forward_backward_s * 1e3:.2f} ms, embedding {p.embedding_s * 1e3:.2f} ms{opt}, overlap "
            f"slowdown {slow} ({p.source})")


def _read_json_object(path: str) -> dict:
    from amsp.errors import InputError

    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--compute-profile {path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise InputError(f"--compute-profile {path}: expected a JSON object of {', '.join(FIELDS)}, got "
                         f"{type(data).__name__}")
    return data


def _profile_from(data, path: str, what: str = "") -> ComputeProfile:
    from amsp.errors import InputError

    where = f"--compute-profile {path}{what}"
    if not isinstance(data, dict):
        raise InputError(f"{where}: not a JSON object")
    missing = [f for f in FIELDS if f not in data]
    if missing:
        raise InputError(f"{where}: missing {', '.join(missing)} (need {', '.join(FIELDS)})")
    try:
        prof = ComputeProfile(**{f: float(data[f]) for f in FIELDS},
                              overlap_slowdown=None if data.get("overlap_slowdown") is None
                              else float(data["overlap_slowdown"]), source=f"file:{path}{what}",
                              optimizer_s_per_elem=None if data.get("optimizer_s_per_elem") is None
                              else float(data["optimizer_s_per_elem"]),
                              optimizer_kernel=data.get("optimizer_kernel"))
        if prof.optimizer_kernel is not None:
            adam_bytes_per_elem(prof.optimizer_kernel)  # a kernel the price cannot scale from: an error
    except (TypeError, ValueError) as e:
        raise InputError(f"{where}: {e}") from e
    bad = [f for f in FIELDS if not (0 < getattr(prof, f) < math.inf)]
    if bad:  # a unit measured at no time would price compute as free (MFU above 100%)
        raise InputError(f"{where}: {', '.join(bad)} must be finite seconds > 0")
    if prof.overlap_slowdown is not None and not 0 <= prof.overlap_slowdown <= 1:
        raise InputError(f"{where}: overlap_slowdown={prof.overlap_slowdown:g} must be in [0, 1] (compute seconds "
                         f"lost per second of hidden communication)")
    rate = prof.optimizer_s_per_elem
    if rate is not None and not 0 < rate < math.inf:  # a step per element at no time would be a free update
        raise InputError(f"{where}: optimizer_s_per_elem={rate:g} must be finite seconds > 0")
    return prof


# The recorded shape's fields a profile's times depend on (a block, the head and the embedding at one
# micro-batch): n_layers is recorded too but not compared, as no timed unit depends on it.
SHAPE_CHECKED = ("dim", "ffn", "heads", "kv_heads", "vocab", "seq_len", "micro_batch", "dtype", "device")


def measured_shape(model_cfg, seq_len: int, micro_batch: int, dtype: str, device_kind: str, device: str) -> dict:
    """What a compute profile was measured for, as its cache file records it ("shape")."""
    return {"dim": model_cfg.dim, "n_layers": model_cfg.n_layers, "ffn": model_cfg.ffn_hidden_dim,
            "heads": model_cfg.n_heads, "kv_heads": model_cfg.n_kv_heads, "vocab": model_cfg.vocab_size,
            "seq_len": seq_len, "micro_batch": micro_batch, "dtype": dtype, "device": device_kind,
            "device_name": device}


def check_profile_shape(path: str, planned: dict, compare: tuple = SHAPE_CHECKED,
                        cluster_name: str | None = None) -> str:
    """How far the file at `path` describes the `planned` shape (measured_shape's fields): refused
    (InputError naming both) when its recorded shape differs in one of `compare`, or when its GPU is one
    another cluster preset than `cluster_name` describes (an A100's times priced as an H100's); a file
    without the record (written before it, or by hand) cannot be checked: a warning is logged. Returns
    what the planner's header says of the file's shape."""
    from amsp.errors import InputError

    from .device_preset import DEVICE_PRESETS, preset_for_device

    recorded = _read_json_object(path).get("shape")
    if recorded is None:
        log.warning("--compute-profile %s records no model shape (a file written before the record, or by hand): "
                    "it cannot be checked against the planned model (%s)", path, _shape_text(planned))
        return "shape not recorded: not checked"
    if not isinstance(recorded, dict):
        raise InputError(f"--compute-profile {path}: \"shape\" must be a JSON object, got {recorded!r}")
    differ = [k for k in compare if k in recorded and recorded[k] != planned.get(k)]
    if differ:
        raise InputError(f"--compute-profile {path}: measured for {_shape_text(recorded, differ)}, the planned run "
                         f"is {_shape_text(planned, differ)}; time this model (train.py's startup writes the "
                         f"file) or drop --compute-profile")
    measured_on = preset_for_device(str(recorded.get("device_name", "")))
    if cluster_name in {preset for _, preset in DEVICE_PRESETS} and measured_on not in (None, cluster_name):
        raise InputError(f"--compute-profile {path}: measured on {recorded['device_name']} (cluster={measured_on}), "
                         f"the planned cluster is {cluster_name}; time the compute there or drop --compute-profile")
    return f"measured for {_shape_text(recorded)}"


def _shape_text(shape: dict, keys=None) -> str:
    keys = [k for k in (keys or shape) if k in shape]
    return ", ".join(f"{k} {shape[k]}" for k in keys)


def load_profile(path: str) -> ComputeProfile:
    """A ComputeProfile from a JSON file ({field: value}, the cache's "profile" or a bare object)."""
    data = _read_json_object(path)
    return _profile_from(data.get("profile", data), path)


def load_profiles(path: str) -> dict:
    """{node group: ComputeProfile} from a mixed cluster's cache file ({"profiles": {group: {...}}}), or
    {None: profile} (every group) from a single profile (load_profile's forms)."""
    data = _read_json_object(path)
    if "profiles" not in data:
        return {None: _profile_from(data.get("profile", data), path)}
    groups = data["profiles"]
    if not isinstance(groups, dict) or not groups:
        from amsp.errors import InputError

        raise InputError(f"--compute-profile {path}: \"profiles\" must map node groups to profiles")
    return {g: _profile_from(v, path, f" (group {g})") for g, v in groups.items()}
