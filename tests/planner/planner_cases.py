"""Shared builders for the planner tests: clusters without Hydra, small workloads."""
from __future__ import annotations

from amsp.planner.cluster import KINDS, AlphaBeta, BandwidthCurve, ClusterSpec
from amsp.planner.workload import Workload
from amsp.schedule import Precision
from models.llama.config import LlamaConfig, get_preset


def flat_cluster(nodes: int, rpn: int, intra_gbps: float = 100.0, inter_gbps: float = 10.0, latency_us: float = 0.0,
                 memory_gib: float = 80.0, peak_tflops: float = 100.0, curves: bool = True) -> ClusterSpec:
    pts = {}
    if curves:
        for k in KINDS:
            pts[(k, "intra")] = BandwidthCurve(((2**20, intra_gbps * 0.5), (2**28, intra_gbps)))
            pts[(k, "inter")] = BandwidthCurve(((2**20, inter_gbps * 0.5), (2**28, inter_gbps)))
    return ClusterSpec("test", nodes, rpn, int(memory_gib * 2**30), peak_tflops * 1e12, 2000.0, "bf16", pts,
                       {"intra": AlphaBeta(latency_us * 1e-6, intra_gbps), "inter": AlphaBeta(latency_us * 1e-6, inter_gbps)})


def workload(model: str | LlamaConfig = "debug", seq_len: int = 64, mbs: int = 2, micro_batches: int = 2,
             precision: str = "bf16", recompute: str = "none", tp: int = 1, pp: int = 1,
             kernels=None, model_overrides: dict | None = None) -> Workload:
    cfg = get_preset(model) if isinstance(model, str) else model
    if model_overrides:
        cfg = cfg.with_overrides(**model_overrides)
    return Workload(cfg, seq_len, mbs, micro_batches, Precision.named(precision), recompute, tp, pp, kernels)


def saved_activation_bytes(model, batch: int, seq: int, tp: int = 1, dtype=None) -> int:
    """Bytes autograd keeps for the first block's forward of `model` (models.llama.model.Llama, TP-made or
    not): unique storages of the saved tensors (a DTensor's local shard), the model's own parameters and
    buffers left out. The input is this rank's slice of the residual stream (seq / tp positions under
    sequence parallelism)."""
    import torch

    def storage(t):
        return getattr(t, "_local_tensor", t).untyped_storage()

    owned = {storage(t).data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        st = storage(t)
        if st.data_ptr() not in owned:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(batch, seq // tp, model.cfg.dim, dtype=dtype or torch.float32, requires_grad=True)
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[0](x, cos, sin)
    return sum(seen.values())


def kept_per_layer_bytes(model, batch: int, seq: int, tp: int = 1) -> float:
    """Resident bytes a forward through all of `model`'s blocks keeps, per block: what autograd saves,
    recomputation's own caches included (selective recomputation keeps its tensors where saved-tensor
    hooks do not see them). glibc is set to serve blocks over 64 KiB by mmap and to trim at once (for
    the rest of this process), so the resident set follows the live tensors; a warm-up pass first."""
    import ctypes
    import gc

    import torch

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    x = torch.randn(batch, seq // tp, model.cfg.dim, requires_grad=True)
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]

    def forward():
        h = x
        for block in model.layers:
            h = block(h, cos, sin)
        return h

    out = forward()
    (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
    del out
    gc.collect()
    base = rss()
    out = forward()  # noqa: F841 (kept alive while measured)
    return (rss() - base) / len(model.layers)
