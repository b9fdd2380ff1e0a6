"""What the planner knows about the machines: shape, memory, peak FLOP/s, collective bandwidths and
how much hidden communication slows compute.

Bandwidths follow the NCCL-tests "bus bandwidth" convention, so one number per point describes a
collective independently of the group size:
  time = bytes * factor(n) / busbw,  factor = (n-1)/n for all_gather (bytes = gathered output) and
  reduce_scatter (bytes = input), 2(n-1)/n for all_reduce.
Two scopes per collective kind:
  * intra: per-rank bus bandwidth of a collective whose group lies inside one node;
  * inter: bus bandwidth through one node's network interfaces (all NICs together), the resource
    that every group crossing that node's boundary shares (DESIGN.md §3; see comm_time.py).

Lookup convention (presets, the probe and the cost model agree on it): a curve's points are
(per-rank chunk bytes -> GB/s), where the chunk is the message of one ring step, bytes / n for a
collective of `bytes` (the convention above) over n ranks: the all_gather send count, the
reduce_scatter receive count, 1/n of an all_reduce buffer. An NCCL-tests line of size S measured on
a group of n ranks is the point (S / n, busbw) — a ring moves S / n per step whatever n is, so the
small-message fall-off of a 2-node measurement is what a 1024-rank ring of a 400 MB block sees
(400 KB steps). BandwidthCurve.from_totals converts measured (S, busbw) pairs. Points are
interpolated linearly in log(chunk) and clamped at the ends; they are pure bandwidth: the cost model
adds the per-step latencies (steps * alpha + bytes * factor / beta, the alpha-beta model with a
size-dependent beta). A kind/scope without points uses the alpha-beta fallback's bandwidth, and
that use is logged once, so a missing measurement never goes unnoticed. The latency of a scope is
per ring step (NCCL's own tuning model, src/graph/tuning.cc, charges per-step hop latencies the same
way).

overlap_slowdown: compute seconds lost per second of communication hidden behind it (NCCL kernels
take SMs and memory bandwidth from the GEMMs they overlap; gloo takes CPU cores). A property of the
machine, so it lives in the preset; a startup measurement (amsp/planner/compute_profile.py) or an
explicit amsp.planner.overlap_slowdown replaces it.
"""
from __future__ import annotations

import bisect
import logging
import math
import re
from dataclasses import dataclass, field, replace
from typing import Mapping

log = logging.getLogger(__name__)

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
SCOPES = ("intra", "inter")
_UNITS = {"B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
_warned: set = set()


def parse_size(text: str | int | float) -> int:
    """'64KiB' / '16MiB' / 1048576 -> bytes."""
    if isinstance(text, (int, float)):
        if not math.isfinite(text):  # int() of inf is an OverflowError, of NaN a ValueError naming neither
            raise ValueError(f"cannot read message size {text!r}; write e.g. 64KiB, 16MiB, 1GiB or a byte count")
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or (m.group(2).upper() or "B") not in _UNITS:
        raise ValueError(f"cannot read message size {text!r}; write e.g. 64KiB, 16MiB, 1GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper() or "B"])


def format_size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}B"


def ring_factor(kind: str, n: int) -> float:
    if kind not in KINDS:
        raise KeyError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


@dataclass(frozen=True)
class BandwidthCurve:
    """Effective bus bandwidth (GB/s) against message size, interpolated in log(size)."""

    points: tuple[tuple[int, float], ...]  # sorted (bytes, GB/s)

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a bandwidth curve needs at least one point")
        # written as a range so NaN fails it too (NaN <= 0 is False): a NaN or infinite bandwidth reaches the
        # ILP's coefficients and the solver dies with a traceback instead of a one-line error
        if any(not (0 < bw < math.inf) or size <= 0 for size, bw in self.points):
            raise ValueError(f"bandwidth points must be positive finite GB/s at positive sizes: {self.points}")
        # the lookup runs for every priced collective (thousands of candidates at 16384 ranks)
        object.__setattr__(self, "_sizes", tuple(size for size, _ in self.points))
        object.__setattr__(self, "_logs", tuple(math.log(size) for size, _ in self.points))

    @classmethod
    def from_mapping(cls, m: Mapping) -> "BandwidthCurve":
        """{per-rank chunk size: GB/s} as the cluster presets write them."""
        return cls(tuple(sorted((parse_size(k), float(v)) for k, v in m.items())))

    @classmethod
    def from_totals(cls, points, ranks: int) -> "BandwidthCurve":
        """From (collective bytes, busbw) pairs measured on a group of `ranks` ranks (an NCCL-tests
        table, a probe): each point moves to its per-rank chunk, bytes / ranks."""
        if ranks < 1:
            raise ValueError(f"a measured curve needs its group size, got {ranks} ranks")
        return cls(tuple(sorted((max(1, int(s) // ranks), float(b)) for s, b in points)))

    def gbps(self, size: float) -> float:
        sizes = self._sizes
        if size <= sizes[0]:
            return self.points[0][1]
        if size >= sizes[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(sizes, size)
        b0, b1 = self.points[i - 1][1], self.points[i][1]
        w = (math.log(size) - self._logs[i - 1]) / (self._logs[i] - self._logs[i - 1])
        return b0 + w * (b1 - b0)


@dataclass(frozen=True)
class AlphaBeta:
    latency_s: float  # per ring step
    gbps: float  # bus bandwidth in the same convention as the curves


def alpha_beta_check(cluster: str, scope: str, ab: AlphaBeta) -> None:
    """A scope's latency and bandwidth as the config keys that set them name them: a collective's time
    divides by the bandwidth (0 is a ZeroDivisionError deep in the pricing, a negative one a negative
    time) and adds the latency per ring step (a negative one would make communication gain time)."""
    if not (0 < ab.gbps < math.inf):
        raise ValueError(f"cluster {cluster}: cluster.{scope}_bandwidth_gbs={ab.gbps:g} must be a finite number of "
                         f"GB/s > 0")
    if not (0 <= ab.latency_s < math.inf):
        raise ValueError(f"cluster {cluster}: cluster.{scope}_latency_us={ab.latency_s * 1e6:g} must be a finite "
                         f"number of microseconds >= 0")


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: int
    ranks_per_node: int
    device_memory_bytes: int
    peak_flops: float  # dense FLOP/s per device in the training dtype
    memory_bandwidth_gbs: float  # device memory bandwidth: prices the memory-bound optimizer step
    dtype: str  # training dtype this cluster runs by default: bf16 on GPUs, fp32 on CPUs
    curves: Mapping[tuple[str, str], BandwidthCurve] = field(default_factory=dict)  # (kind, scope)
    fallback: Mapping[str, AlphaBeta] = field(default_factory=dict)  # scope -> alpha-beta
    source: str = "preset"  # preset | probe | cache: where the curves came from
    overlap_slowdown: float = 0.1  # compute seconds lost per second of hidden communication
    # CPU ranks sharing one machine's cores: (ranks per machine, the time a rank computing alone takes
    # as a fraction of its time while all of them compute). None: ranks never slow each other (GPUs).
    # The compute profile is timed with every rank busy; a pipeline stage idle in the bubble hands its
    # cores to the busy ones (amsp/planner/joint/search.py prices that).
    shared_cores: tuple[int, float] | None = None
    # cpu | cuda: CUDA streams run an overlapped optimizer update beside the forward; CPU ranks run it inline
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"cluster {self.name}: nodes={self.nodes} and ranks_per_node={self.ranks_per_node} "
                             f"must be positive")
        if self.device_memory_bytes <= 0 or self.peak_flops <= 0:
            raise ValueError(f"cluster {self.name}: device memory and peak FLOP/s must be positive")
        if self.shared_cores is not None and not (self.shared_cores[0] >= 1 and 0 < self.shared_cores[1] <= 1):
            raise ValueError(f"cluster {self.name}: shared_cores={self.shared_cores} must be (ranks >= 1, "
                             f"lone-rank time fraction in (0, 1])")
        if not (0 < self.memory_bandwidth_gbs < math.inf):  # the optimizer step's time divides by it
            raise ValueError(f"cluster {self.name}: cluster.memory_bandwidth_gbs={self.memory_bandwidth_gbs:g} must be "
                             f"a finite number of GB/s > 0")
        for scope, ab in self.fallback.items():
            alpha_beta_check(self.name, scope, ab)
        if not 0 <= self.overlap_slowdown <= 1:
            raise ValueError(f"cluster {self.name}: overlap_slowdown={self.overlap_slowdown} must be in [0, 1] "
                             f"(compute seconds lost per second of hidden communication)")
        for scope in SCOPES:
            if scope not in self.fallback and any((k, scope) not in self.curves for k in KINDS):
                raise ValueError(f"cluster {self.name}: scope {scope!r} has neither bandwidth points for every "
                                 f"collective nor an alpha-beta fallback")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def with_shape(self, nodes: int, ranks_per_node: int) -> "ClusterSpec":
        return replace(self, nodes=nodes, ranks_per_node=ranks_per_node)

    def busbw_gbps(self, kind: str, scope: str, chunk_bytes: float) -> float:
        """Bus bandwidth (GB/s) of `kind` at this scope for ring steps of chunk_bytes per rank."""
        curve = self.curves.get((kind, scope))
        if curve is not None:
            return curve.gbps(chunk_bytes)
        ab = self.fallback[scope]
        if (self.name, kind, scope) not in _warned:
            _warned.add((self.name, kind, scope))
            log.info("cluster %s: no %s bandwidth points for %s; using the alpha-beta bandwidth %.2f GB/s",
                     self.name, scope, kind, ab.gbps)
        return ab.gbps

    def latency_s(self, scope: str) -> float:
        """Seconds per ring step at this scope."""
        return self.fallback[scope].latency_s

    def describe(self, overlap: tuple[float, str] | None = None) -> str:
        """The cluster's figures, one line and the curves. overlap: (the overlap slowdown priced with, its
        source) when it is not the preset's (cost_model.overlap_slowdown_of)."""
        slowdown, source = overlap or (self.overlap_slowdown, "the preset's")
        lines = [f"cluster {self.name}: {self.nodes} node(s) x {self.ranks_per_node} ranks, "
                 f"{self.device_memory_bytes / 2**30:.1f} GiB/device, peak {self.peak_flops / 1e12:.4g} TFLOP/s "
                 f"({self.dtype}), bandwidths from {self.source} (bus GB/s by per-rank chunk; inter = per node), "
                 f"hidden communication slows compute by {slowdown:.2f} s/s ({source})"
                 + (f"; {self.shared_cores[0]} ranks share a machine's cores (a rank alone computes in "
                    f"{self.shared_cores[1]:.2f}x the time it takes when all are busy)" if self.shared_cores else "")]
        for scope in SCOPES:
            for kind in KINDS:
                c = self.curves.get((kind, scope))
                if c is not None:
                    pts = "  ".join(f"{format_size(s)}:{bw:.3g}" for s, bw in c.points)
                else:
                    ab = self.fallback[scope]
                    pts = f"alpha-beta {ab.gbps:.3g} GB/s"
                lines.append(f"  {scope:5s} {kind:14s} {pts}")
            lines.append(f"  {scope:5s} latency per ring step {self.fallback[scope].latency_s * 1e6:.1f} us")
        return "\n".join(lines)


def curves_from_config(tables: Mapping | None, scope: str) -> dict[tuple[str, str], BandwidthCurve]:
    """cluster.<scope>_node: {collective kind: {per-rank chunk size: GB/s}}. A bad entry is a ValueError naming
    its own key (cluster.intra_node.all_gather) and what it should be, not the whole table or a Python error
    (a scalar where a mapping belongs has no .items())."""
    key = f"cluster.{scope}_node"
    if tables is not None and not isinstance(tables, Mapping):
        raise ValueError(f"{key}={tables!r}: expected a mapping of collective kind ({', '.join(KINDS)}) to a "
                         f"table of message size to GB/s")
    out = {}
    for kind, pts in (tables or {}).items():
        if kind not in KINDS:
            raise ValueError(f"{key} names unknown collective {kind!r}; expected one of {KINDS}")
        if not pts:
            continue
        if not isinstance(pts, Mapping):
            raise ValueError(f"{key}.{kind}={pts!r}: expected a mapping of message size to GB/s, "
                             f"e.g. {{1MiB: 130, 64MiB: 185}}")
        points = []
        for size, gbs in pts.items():
            try:
                bw = float(gbs)
            except (TypeError, ValueError):
                bw = math.nan
            if not (0 < bw < math.inf):  # a range, so NaN fails it too
                raise ValueError(f"{key}.{kind}: {size}: {gbs!r} must be a finite bandwidth in GB/s > 0")
            try:
                nbytes = parse_size(size)
            except ValueError as e:
                raise ValueError(f"{key}.{kind}: {e}") from None
            if nbytes <= 0:
                raise ValueError(f"{key}.{kind}: message size {size!r} must be > 0 bytes")
            points.append((nbytes, bw))
        out[(kind, scope)] = BandwidthCurve(tuple(sorted(points)))
    return out


def cluster_from_config(c, nodes: int | None = None, ranks_per_node: int | None = None) -> ClusterSpec:
    """A ClusterSpec from the Hydra `cluster` node (configs/schema.py ClusterConfig).

    nodes / ranks_per_node from the launcher take precedence over the preset's shape."""
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(c, resolve=True) if not isinstance(c, dict) else dict(c)
    curves = curves_from_config(d.get("intra_node"), "intra")
    curves.update(curves_from_config(d.get("inter_node"), "inter"))
    fallback = {
        "intra": AlphaBeta(d["intra_latency_us"] * 1e-6, d["intra_bandwidth_gbs"]),
        "inter": AlphaBeta(d["inter_latency_us"] * 1e-6, d["inter_bandwidth_gbs"]),
    }
    if d.get("peak_tflops") is None:
        raise ValueError(f"cluster {d['name']}: peak_tflops is unset; it is measured only at run time "
                         f"(cluster=cpu inside train.py) or must be given (cluster.peak_tflops=...)")
    if d.get("device_memory_gib") is None:
        raise ValueError(f"cluster {d['name']}: device_memory_gib is unset; give cluster.device_memory_gib=...")
    return ClusterSpec(
        name=d["name"], nodes=nodes or d["nodes"], ranks_per_node=ranks_per_node or d["ranks_per_node"],
        device_memory_bytes=int(d["device_memory_gib"] * 2**30), peak_flops=d["peak_tflops"] * 1e12,
        memory_bandwidth_gbs=d["memory_bandwidth_gbs"], dtype=d["dtype"], curves=curves, fallback=fallback,
        source="preset" if curves else "alpha-beta", overlap_slowdown=d.get("overlap_slowdown", 0.1),
        device=d.get("device", "cpu"))
