"""Per-rank memory and per-step time of a plan: the function the solver minimises.

Communication prices exactly the collectives of amsp.schedule (same phases, byte counts and call
counts; tests/planner compare the byte totals for every plan). The group layouts are derived
analytically here, so pricing 16384 ranks never builds rank lists; tests check them against
amsp.topology.

Time of one collective call (kind, bytes per rank, group of n = k members on each of m nodes):
comm_time.py. In short: ring (and, for all_reduce across nodes, NCCL's hierarchical tree when it is
faster), the bandwidth curves read at the per-step chunk bytes/n (so a 1024-rank ring of a 400 MB
block runs at the small-message end of the curve), n-1 ring steps of latency split into intra- and
inter-node hops, and a node's NICs shared by the R/k groups of the collective that cross them at
once (DESIGN.md §3): DDP's all_reduce of the full gradient (k = R, one group) and the all_reduce of
1/R shards among one rank per node (k = 1, R groups) load a node's NICs equally; what differs is the
intra-node work and how often each runs. One rank talks to nobody (no collective, no term); a
single node has no inter-node term.

Compute: F, B (one block's forward / backward of one micro-batch) and the head's and embedding's
seconds come from a measured ComputeProfile (Options.compute; recompute=full adds one forward to B,
selective the memory-bound re-run of the norms, rotary and SiLU it drops) or else from FLOPs at
Options.mfu of the cluster's peak.

Exposed time: the step is compute plus communication that compute cannot hide. Rules per unit, for
M micro-batches (F, B: forward / backward compute of one block; B includes recomputation):
  * forward all_gather of a unit overlaps the forward of the unit before it (one-unit prefetch):
    blocks and the head hide behind F, the embedding (first unit) behind nothing;
  * backward all_gather overlaps the backward of the unit after it, and the gradient
    reduce_scatter the backward of the unit before it: a block's gather + reduce-scatter share one
    window B; the head's gather (first in backward) is exposed, its reduce-scatter hides behind B;
    the embedding's gather hides behind B, its reduce-scatter (last in backward) is exposed;
  * the step-level reductions (grad_to_os, grad_replica) join the reduce-scatter's window in the
    last micro-batch ("bucket by bucket" under the remaining backward);
  * the parameter spread joins the forward gather's window in the first micro-batch when
    overlap_spread is on, else it is exposed;
  * the optimizer step over the OS shard is memory-bound and exposed (its rate timed at startup,
    compute_profile.time_optimizer; else the cluster's memory bandwidth; the bytes of the run's kernel,
    Options.optimizer_kernel, set the price: update_cost.adam_seconds_per_elem). With Options.overlap_update
    on a CUDA cluster each unit's update runs on a side stream in forward order and the unit's forward
    waits for it alone: the embedding's and the first block's updates are exposed (nothing before them
    to hide behind), every later unit's only beyond the forward of the unit before it (F, first
    micro-batch); the hidden part still costs UPDATE_HIDDEN_COST of itself (measured on an H200: the
    forward's matmuls fill every SM, so the update's kernels mostly wait for them).
Each unit's exposure depends only on its own degrees and on fixed compute windows, so the step time
is a constant plus a sum of per-group terms: the ILP optimises exactly this function (contention
between a boundary unit's traffic and its neighbouring block's is ignored, the one approximation
this buys).
Hidden communication is not free: NCCL kernels take SMs and memory bandwidth from the compute they
overlap (gloo takes CPU cores), so every hidden second slows compute by overlap_slowdown seconds:
Options.overlap_slowdown when given, else the compute profile's measurement, else the cluster
preset's figure. This also makes plans that hide their traffic equally well differ by how much
they move.

Memory per rank is the peak over two phases, not the sum of every part: the model states (P, G, OS
by their degrees) are held throughout; forward/backward adds the largest set of simultaneously
gathered units, the activations and the gradient buckets (a pair of units' flat reduce-scatter
buffers when g > 1, one parameter's autograd gradient when g = 1; or, where larger, the unfused loss
backward's transient on the last stage, which runs before any gradient exists); the optimizer step adds the OS-shard
gradients held from the sync to the update (grad_sync), when the activations are gone, and on CPU gloo's
copies of the two neighbouring G shards whose G->OS reduce-scatters are in flight (sync_copy_bytes); the
parameter spread's window joins forward/backward when it overlaps the next forward
(Options.overlap_spread), else it follows the update, which has freed the OS-shard gradients, so the
step phase is the larger of the two (evaluate() books both reuses as a negative step_reuse). A unit
whose gradient reduce-scatter is in flight while the next unit fills also holds the collective's
output (its G-shard slice) and, on CPU, gloo's own copy of the input (grad_inflight_bytes). On top, an explicit
reserve: Options.reserved_bytes for the runtime outside the allocator (CUDA context, kernels) plus
Options.memory_margin times the tensor peak for what the allocator holds beyond the live tensors (None:
the device's allocator's figure, amsp/planner/allocator.py). The spread window: at most
Options.spread_window units (capped at the number of units) have a spread in flight, each holding a
received S/p buffer in the compute dtype plus, when the master is a tensor of its own, its OS chunk
cast to the compute dtype (fp32 weights are the master: no cast); units with os = p gather nothing
and hold nothing. The term is the window times the largest such unit (amsp.flat_unit's
spread_transient_bytes). The optimizer step adds nothing: the fused AdamW kernel updates in place and
the clip scale is a scalar.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from amsp.plan import Degrees, Plan, UNIT_GROUPS, enumerate_degrees
from amsp.schedule import Unit, padded_numel

from .allocator import margin_for
from .cluster import ClusterSpec
from .comm_time import collective_seconds
from .compute_profile import ComputeProfile
from .memory_events import collectives_stage_copies, event_bytes, reduce_scatter_inflight_bytes, sync_copy_bytes
from .update_cost import (UPDATE_HIDDEN_COST, adam_bytes_per_elem, adam_seconds_per_elem, overlapped_update_exposed,
                          timed_and_priced)
from .workload import Workload

PHASES = ("forward", "backward", "grad", "grad_to_os", "grad_replica", "spread", "grad_norm")
# Per-unit memory that scales with the unit count: model states and the OS gradients the step holds.
STATE_PARTS = ("params", "grads", "optim", "grad_sync")


@dataclass(frozen=True)
class Options:
    mfu: float = 0.45
    # what the allocator holds beyond the live tensors, as a fraction of the peak tensor bytes
    memory_margin: float | None = None  # None: the cluster device's allocator's (planner/allocator.py)
    reserved_bytes: int = 1 << 30  # runtime outside the allocator: CUDA context, kernels, workspaces
    overlap_spread: bool = True
    spread_window: int = 2  # units whose parameter spread may be in flight at once (the engine's)
    # amsp.overlap_update: each unit's AdamW update waits for the unit's next forward; on a CUDA cluster it
    # runs on a side stream beside the forward before it (its hidden part at UPDATE_HIDDEN_COST), on CPU
    # inline (exposed)
    overlap_update: bool = False
    # compute seconds lost per second of hidden communication; None: the compute profile's
    # measurement, else the cluster preset's figure
    overlap_slowdown: float | None = None
    compute: ComputeProfile | None = None  # measured compute; None: FLOPs at `mfu` of the peak
    # "unit": one collective per flat unit and phase (this engine); "tensor": DeepSpeed ZeRO-3's, a what-if
    # for comparing with published systems: one parameter all-gather per submodule (each linear weight, the
    # embedding, the head) in the forward and the backward, parameters under its persistence threshold
    # (the norms) never gathered, gradients reduce-scattered in buckets (one collective per unit here)
    granularity: str = "unit"
    # amsp.optimizer_kernel: the AdamW kernel the run uses (update_cost.adam_bytes_per_elem prices its bytes)
    optimizer_kernel: str = "auto"
    # A cap on model states (params + grads + optimizer states, bytes per rank) besides the device
    # fit: a budget stated per parameter (the ZeRO papers' memory regime, the shoot-out's), or room
    # kept for something this model does not see. None: only the device memory binds.
    state_budget_bytes: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"assumed MFU (amsp.planner.mfu) must be in (0, 1], got {self.mfu}")
        if self.memory_margin is not None and not 0 <= self.memory_margin < 1:
            raise ValueError(f"allocator margin (amsp.planner.memory_margin) must be in [0, 1), "
                             f"got {self.memory_margin}")
        if self.granularity not in ("unit", "tensor"):
            raise ValueError(f"collective granularity {self.granularity!r} is not 'unit' or 'tensor'")
        if self.overlap_slowdown is not None and not 0 <= self.overlap_slowdown <= 1:
            raise ValueError(f"overlap slowdown (amsp.planner.overlap_slowdown) must be in [0, 1], "
                             f"got {self.overlap_slowdown}")
        if self.state_budget_bytes is not None and self.state_budget_bytes <= 0:
            raise ValueError(f"model-state budget (amsp.planner.state_budget_gib) must be > 0, "
                             f"got {self.state_budget_bytes} bytes")
        adam_bytes_per_elem(self.optimizer_kernel)  # a kernel it cannot price is an error here
        if self.spread_window < 1:
            raise ValueError(f"amsp.spread_window={self.spread_window} must be >= 1 (units whose parameter "
                             f"spread may be in flight at once)")


@dataclass(frozen=True)
class Priced:
    phase: str
    kind: str
    unit: str
    group_size: int
    members_per_node: int
    nodes: int
    bytes: int  # per call per rank (amsp.schedule convention)
    count: int  # calls per step
    seconds: float  # per call

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


def layout(key: str, deg: Degrees, r: int, n: int) -> tuple[int, int, int]:
    """(group size, members per node, nodes) of a group that amsp.topology builds, analytically."""
    def shard(d):
        k = min(d, r)
        return d, k, d // k

    def strided(outer, stride):  # ranks `stride` apart inside an `outer`-rank shard group
        size = outer // stride
        if outer <= r:
            return size, size, 1
        if stride < r:
            return size, r // stride, outer // r
        return size, 1, size

    if key == "p":
        return shard(deg.p)
    if key == "g":
        return shard(deg.g)
    if key == "g_to_os":
        return strided(deg.os, deg.g)
    if key == "spread":
        return strided(deg.os, deg.p)
    if key == "os_replica":
        return strided(n, deg.os)
    if key == "world":
        return shard(n)
    raise KeyError(key)


# DeepSpeed ZeRO-3's stage3_param_persistence_threshold default: smaller parameters are never partitioned
PERSISTENCE_THRESHOLD = 100_000

_PHASE_SPEC = (  # phase, kind, group key, elements divisor, dtype ('p' or 'g'), per micro-batch
    ("forward", "all_gather", "p", "1", "p", True),
    ("backward", "all_gather", "p", "1", "p", True),
    ("grad", "reduce_scatter", "g", "1", "g", True),
    ("grad_to_os", "reduce_scatter", "g_to_os", "g", "g", False),
    ("grad_replica", "all_reduce", "os_replica", "os", "g", False),
    ("spread", "all_gather", "spread", "p", "p", False),
)


@dataclass
class GroupCost:
    """The per-group terms the solver combines: exposed seconds, model-state bytes, gathered bytes."""
    exposed_s: float
    comm_s: float  # unhidden communication seconds per step (before overlap)
    state_bytes: int
    gathered_bytes: dict  # role -> bytes of one gathered unit (0 when p = 1)
    spread_bytes: dict  # role -> bytes one unit's in-flight parameter spread holds (0 when os = p)
    bucket_bytes: dict  # role -> bytes one unit's gradients hold on their way to the G shard
    fill_bytes: dict  # role -> bytes of the autograd gradient in copy while that unit's buffer fills
    inflight_bytes: dict  # role -> bytes a unit's reduce-scatter holds beyond its bucket while in flight
    parts: dict = field(default_factory=dict)  # params / grads / optim / grad_sync bytes
    exposed_by_phase: dict = field(default_factory=dict)
    sync_bytes: int = 0  # grad_sync: held at the optimizer step only (not in state_bytes)
    sync_copy_bytes: dict = field(default_factory=dict)  # role -> gloo's copy while its G->OS sync is in flight


def profile_origin(source: str) -> str:
    """Where a compute profile's figures came from, for the report: a --compute-profile file (its source
    is "file:PATH", compute_profile.load_profile) was not measured by this run's startup."""
    if source.startswith("file:"):
        return f"--compute-profile {source.removeprefix('file:')}"
    return "measured at startup"


def overlap_slowdown_of(options: Options, cluster: ClusterSpec) -> tuple[float, str]:
    """(the overlap slowdown the cost model prices with, where it comes from): the configured value, else
    the compute profile's measurement, else the cluster preset's figure."""
    if options.overlap_slowdown is not None:
        return options.overlap_slowdown, "amsp.planner.overlap_slowdown"
    if options.compute is not None and options.compute.overlap_slowdown is not None:
        return options.compute.overlap_slowdown, profile_origin(options.compute.source)
    return cluster.overlap_slowdown, "the preset's"


class CostModel:
    def __init__(self, workload: Workload, cluster: ClusterSpec, options: Options = Options()):
        self.w, self.c, self.o = workload, cluster, options
        tp, pp = workload.tp, workload.pp
        if cluster.ranks_per_node % tp:
            raise ValueError(f"tensor-parallel degree tp={tp} must divide ranks_per_node={cluster.ranks_per_node} "
                             f"(tensor parallelism stays inside a node)")
        if cluster.world % (tp * pp):
            raise ValueError(f"tp*pp={tp * pp} must divide the world size {cluster.world}")
        self.dp_world = cluster.world // (tp * pp)
        self.dp_per_node = min(cluster.ranks_per_node // tp, self.dp_world)
        if self.dp_world % self.dp_per_node:
            raise ValueError(f"data-parallel world {self.dp_world} is not a whole number of nodes of "
                             f"{self.dp_per_node} data-parallel ranks")
        self._set_compute(options.compute)
        self.overlap_slowdown = overlap_slowdown_of(options, cluster)[0]
        self.memory_margin = margin_for(options.memory_margin, cluster.device)
        self._pb = workload.precision.param_bytes
        self._optim_b = workload.precision.optim_bytes
        self._master_is_weights = workload.precision.master_is_weights
        self._gb = workload.precision.grad_bytes
        self._numel = workload.role_numel()
        # More than every unit cannot be in flight.
        self.spread_window = min(options.spread_window, len(workload.units()))
        self._cache: dict = {}
        self._seconds: dict = {}  # (kind, bytes, n, k, m, shares) -> seconds of one call

    # ---- candidates and constants ----
    def candidates(self) -> list[Degrees]:
        return enumerate_degrees(self.dp_world, self.dp_per_node)

    def _set_compute(self, prof: ComputeProfile | None) -> None:
        """F, B of one block and the head + embedding seconds of one micro-batch (B with recomputation)."""
        w = self.w
        if prof is None:
            rate = self.c.peak_flops * self.o.mfu
            self.F = w.block_forward_flops() / rate
            self.B = w.block_backward_flops() / rate  # includes full recomputation's extra forward
            self.edge_s = 3 * w.head_forward_flops() / rate  # embedding: no matmul FLOPs
            self.opt_s_per_elem = self.opt_kernel = None
            self.compute_source = f"FLOPs at {self.o.mfu:.0%} MFU of the {self.c.name} peak"
        else:
            for name in ("block_forward_s", "block_backward_s", "head_forward_backward_s", "embedding_s"):
                if not getattr(prof, name) >= 0:
                    raise ValueError(f"compute profile ({prof.source}): {name}={getattr(prof, name)} must be >= 0")
            self.F = prof.block_forward_s
            self.B = prof.block_backward_s + (prof.block_forward_s if w.recompute == "full" else 0.0)
            # a pipelined rank is priced as its slowest stage, the head's (Workload.unit_roles)
            self.edge_s = prof.head_forward_backward_s + (prof.embedding_s if w.pp == 1 else 0.0)
            self.opt_s_per_elem, self.opt_kernel = prof.optimizer_s_per_elem, prof.optimizer_kernel
            self.compute_source = prof.source
            timed, run = timed_and_priced(self.o.optimizer_kernel, prof.optimizer_kernel)
            if prof.optimizer_s_per_elem is not None and timed != run:  # said, as the rate is a guess then
                self.compute_source += f"; AdamW rate timed with {timed}, scaled by bytes to {run}"
        if w.recompute == "selective":
            self.B += self.selective_recompute_s()

    def selective_recompute_s(self) -> float:
        """Selective recomputation re-runs the memory-bound ops whose outputs it does not keep (norms,
        rotary, SiLU): about the dropped activation bytes read and written once more."""
        w = self.w
        dropped = w.layer_activation_bytes("none") - w.layer_activation_bytes("selective")
        return 2 * max(0.0, dropped) / (self.c.memory_bandwidth_gbs * 1e9)

    def compute_s(self) -> float:
        per_mb = self.w.layers * (self.F + self.B) + self.edge_s
        return per_mb * self.w.micro_batches * (1 + self.w.pipeline_bubble())

    def grad_norm(self) -> list[Priced]:
        if self.dp_world == 1:  # amsp.schedule: over the data-parallel world, when it has several ranks
            return []
        n, k, m = layout("world", Degrees(1, 1, 1), self.dp_per_node, self.dp_world)
        return [self.price("grad_norm", "all_reduce", "*", n, k, m, 4, 1)]

    def constant_time_s(self) -> float:
        return self.compute_s() + sum(x.seconds * x.count for x in self.grad_norm())

    def memory_budget(self) -> float:
        """Tensor bytes a rank may peak at: the device less the runtime's reserve, less the allocator's
        reserve on top of the tensors (tensors * (1 + margin) + runtime <= device)."""
        return (self.c.device_memory_bytes - self.o.reserved_bytes) / (1 + self.memory_margin)

    def reserve_bytes(self, tensor_peak: float) -> float:
        """The explicit reserve a plan's tensor peak needs on top: runtime plus allocator fragmentation."""
        return self.o.reserved_bytes + self.memory_margin * tensor_peak

    def buffer_pairs(self) -> list[tuple[str, ...]]:
        """Unit roles gathered at the same time (current + prefetched next, in forward order). A tied
        embedding+head unit stays gathered through the whole forward, next to two blocks."""
        two_blocks = ("block", "block") if self.w.layers >= 2 else ("block",)
        if "head" not in self._numel:
            return [("embedding",) + two_blocks]
        if "embedding" not in self._numel:  # a pipelined rank, priced as the head's stage (Workload.unit_roles)
            return [("block", "head")] + ([two_blocks] if self.w.layers >= 2 else [])
        return [("embedding", "block"), ("block", "head")] + ([two_blocks] if self.w.layers >= 2 else [])

    def grad_bucket_bytes(self, role: str, deg: Degrees) -> int:
        """What one unit's gradients hold on their way out of autograd (amsp.flat_unit take_grad): with
        g > 1 the unit's flat reduce-scatter buffer (in flight while the next unit's fills: pairs, as
        buffer_pairs); with g = 1 each gradient is added into the G shard in its own hook, so only one
        parameter's autograd gradient (compute dtype) at a time. The fused head's weight gradient is
        the d/dW its forward kept (priced with the head's activations)."""
        if deg.g > 1:
            return padded_numel(self._numel[role], deg) * self._gb
        return self.w.largest_param_numel(role) * self._pb

    def grad_fill_bytes(self, role: str, deg: Degrees) -> int:
        """With g > 1, the autograd gradient a unit's hook is copying into its flat buffer while the unit
        fills (amsp.flat_unit take_grad): its largest parameter's, compute dtype, beside the buffers.
        With g = 1 the bucket is that gradient already; the fused head's weight gradient is the d/dW its
        forward kept (priced with the head's activations)."""
        working = self.w.block_backward_transient_bytes() if role == "block" else 0
        if deg.g == 1 or (role == "head" and self.w.head_loss_fused):
            return working
        return self.w.largest_param_numel(role) * self._pb + working

    @property
    def collectives_stage_copies(self) -> bool:
        return collectives_stage_copies(self.c.device)

    def grad_inflight_bytes(self, role: str, deg: Degrees) -> float:
        """memory_events.reduce_scatter_inflight_bytes for one unit of `role` (the second role of a bucket
        event: its reduce-scatter is in flight while the first fills)."""
        return reduce_scatter_inflight_bytes(padded_numel(self._numel[role], deg), deg, self._gb, self._pb,
                                             self.collectives_stage_copies)

    def bucket_events(self) -> list[tuple[tuple[str, ...], str, float]]:
        """(units whose gradient buckets are held, the unit filling, bytes credited) where the buckets
        peak: a unit filling while the unit after it in forward order (before it in the backward) is in
        flight, as buffer_pairs with their offsets; and the head, first in the backward, filling alone."""
        events = [(pair[:2], pair[0], off) for pair, off in zip(self.buffer_pairs(), self.bucket_pair_offsets())]
        if "head" in self._numel:
            events.append((("head",), "head", self.w.activations_freed_before(("head",))))
        return events

    def bucket_pair_offsets(self) -> list[float]:
        """Per buffer_pairs entry, bytes to take off its gradient buckets before they join the
        activations. The (untied) embedding is the last unit of the backward: its gradient (vocab x dim)
        and the first block's arrive once the micro-batch's activations are gone, so that pair meets
        only what is still alive then (workload.activation_bytes_at_embedding_backward) and is charged
        against the full activations less that. A tied embedding+head unit starts its gradient with the
        head's, at the start of the backward: no offset."""
        pairs = self.buffer_pairs()
        credit = self.constant_memory()["activations"] - self.w.activation_bytes_at_embedding_backward()
        offsets = [credit if pair == ("embedding", "block") else 0.0 for pair in pairs]
        if "head" in self._numel:  # what the backward freed before each block pair (Workload's rule)
            offsets = [off + self.w.activations_freed_before(pair) for pair, off in zip(pairs, offsets)]
        return offsets

    def peak_grad_buckets(self, buckets: dict, fills: dict, inflight: dict) -> float:
        """The bucket term beside the full activations: the largest of the bucket events (held buckets
        plus the filling unit's gradient in copy and what the in-flight unit's reduce-scatter holds
        beyond its bucket, the embedding's pair less its offset), or on the last
        stage the unfused loss backward's transient where larger (it runs before any parameter gradient
        exists)."""
        events = [event_bytes(roles, filler, off, lambda r, table: table[r], buckets, fills, inflight)
                  for roles, filler, off in self.bucket_events()]
        return max(max(events), self.w.loss_backward_transient_bytes())

    def constant_memory(self) -> dict:
        """Activations (the loss's transients are in the bucket term: Workload.loss_backward_transient_bytes)."""
        return {"activations": self.w.activation_bytes()}

    # ---- pricing ----
    def price(self, phase, kind, unit, n, k, m, nbytes, count, shares=(1.0,)) -> Priced:
        """One collective call of `kind` moving nbytes per rank over n ranks, k on each of m nodes
        (issued as one collective per share of the bytes under Options.granularity='tensor')."""
        key = (kind, nbytes, n, k, m, shares)  # many triples share a group shape: price each once
        t = self._seconds.get(key)
        if t is None:
            t = self._seconds[key] = sum(collective_seconds(self.c, kind, nbytes * f, n, k, m) for f in shares)
        return Priced(phase, kind, unit, n, k, m, nbytes, count, t)

    def tensor_shares(self, role: str, phase: str = "forward") -> tuple[float, ...]:
        """How a unit's bytes split into collectives: (1.0,) for one flat unit; under granularity='tensor'
        (DeepSpeed ZeRO-3) the parameter gathers split by parameter tensor, the tensors under
        PERSISTENCE_THRESHOLD elements left out (DeepSpeed keeps them whole on every rank: the norms,
        whose bytes are negligible beside the matrices'), and the gradient reductions stay bucketed."""
        if self.o.granularity == "unit" or phase not in ("forward", "backward"):
            return (1.0,)
        m = self.w.model
        q, kv, ffn = m.dim * m.n_heads * m.head_dim, m.dim * m.n_kv_heads * m.head_dim, m.dim * m.ffn_hidden_dim
        head = [m.dim] + ([] if m.tie_embeddings else [m.vocab_size * m.dim])
        sizes = {"block": [q, q, kv, kv, ffn, ffn, ffn, m.dim, m.dim], "head": head,
                 "embedding": [m.vocab_size * m.dim] + (head if m.tie_embeddings else [])}[role]
        sizes = [x for x in sizes if x >= PERSISTENCE_THRESHOLD] or [sum(sizes)]
        return tuple(x / sum(sizes) for x in sizes)

    def unit_collectives(self, unit: Unit, deg: Degrees, role: str = "block") -> list[Priced]:
        """amsp.schedule.unit_collectives for this unit, priced."""
        s = padded_numel(unit.numel, deg)
        out = []
        for phase, kind, key, div, dt, per_mb in _PHASE_SPEC:
            n, k, m = layout(key, deg, self.dp_per_node, self.dp_world)
            if n > 1:
                elems = s // (1 if div == "1" else getattr(deg, div))
                nbytes = elems * (self._pb if dt == "p" else self._gb)
                out.append(self.price(phase, kind, unit.name, n, k, m, nbytes,
                                       self.w.micro_batches if per_mb else 1, self.tensor_shares(role, phase)))
        return out

    def _role_collectives(self, role: str, deg: Degrees) -> dict:
        key = (role, deg)
        if key not in self._cache:
            unit = Unit(role, "blocks" if role == "block" else "embed_head", self._numel[role])
            self._cache[key] = {x.phase: x for x in self.unit_collectives(unit, deg, role)}
        return self._cache[key]

    # ---- exposure ----
    def unit_exposure(self, role: str, deg: Degrees) -> dict:
        """Exposed seconds per step of one unit's communication and optimizer step, by phase."""
        cs = self._role_collectives(role, deg)

        def t(phase):
            return cs[phase].seconds if phase in cs else 0.0

        m = self.w.micro_batches
        ag_f, ag_b, rs, spread = t("forward"), t("backward"), t("grad"), t("spread")
        red = t("grad_to_os") + t("grad_replica")
        wf = 0.0 if role == "embedding" else self.F

        def fwd(extra):
            return max(0.0, ag_f + extra - wf)

        if self.o.overlap_spread:
            fwd_total, spread_exposed = (m - 1) * fwd(0.0) + fwd(spread), 0.0
        else:
            fwd_total, spread_exposed = m * fwd(0.0), spread

        def bwd(extra):
            if role == "block":  # the gather of the next block and this block's reduce share B
                return max(0.0, ag_b + rs + extra - self.B)
            if role == "head":  # first in backward: the gather is exposed
                return ag_b + max(0.0, rs + extra - self.B)
            return max(0.0, ag_b - self.B) + rs + extra  # embedding: last in backward

        bwd_last = bwd(red)
        s = padded_numel(self._numel[role], deg)
        # weights that are the master are updated in place: no separate compute-weight write
        weight_write = 0 if self._master_is_weights else self._pb
        # measured on fp32 masters (with the kernel the profile names); a separate weight copy writes more
        opt = s // deg.os * adam_seconds_per_elem(self.o.optimizer_kernel, weight_write, self.opt_s_per_elem,
                                                  self.opt_kernel, self.c.memory_bandwidth_gbs * 1e9)
        exposed = {"forward": fwd_total, "backward": (m - 1) * bwd(0.0) + bwd_last, "spread": spread_exposed}
        raw = sum(x.seconds * x.count for x in cs.values())
        hidden = max(0.0, raw - sum(exposed.values()))
        opt_exposed = self.update_exposed(role, opt)
        contention = self.overlap_slowdown * hidden + UPDATE_HIDDEN_COST * (opt - opt_exposed)
        return {**exposed, "contention": contention, "optimizer": opt_exposed}

    def update_exposed(self, role: str, opt: float) -> float:
        """Exposed seconds of one unit's optimizer update (`opt`): all of it unless it runs on a side stream
        (overlap_update on CUDA), where the embedding (first in the forward) and the first block wait for
        theirs and each later unit's hides behind the forward of the unit before it. The first block's
        exposure is spread over the blocks, which share one term (the sum over the layers is exact)."""
        if not (self.o.overlap_update and self.c.device == "cuda") or role == "embedding":
            return opt
        if role == "block":
            return overlapped_update_exposed(opt, [opt] * (self.w.layers - 1), self.F) / self.w.layers
        return overlapped_update_exposed(0.0, [opt], self.F)  # the head: last in the forward

    # ---- per-group terms (what the ILP combines) ----
    def roles_of(self, group: str) -> list[tuple[str, int]]:
        if group == "blocks":
            return [("block", self.w.layers)]
        if group == "embed_head":
            return [(r, 1) for r in ("embedding", "head") if r in self._numel]
        raise KeyError(f"unknown unit group {group!r}; expected one of {UNIT_GROUPS}")

    def state_parts(self, role: str, deg: Degrees) -> dict:
        s = padded_numel(self._numel[role], deg)
        return {"params": s // deg.p * self._pb, "grads": s // deg.g * 4, "optim": s // deg.os * self._optim_b,
                "grad_sync": self.grad_sync_bytes(s, deg)}

    def grad_sync_bytes(self, padded: int, deg: Degrees) -> int:
        """The fp32 OS-shard gradient every unit holds from the last micro-batch's sync to the optimizer
        step (the global norm needs all of them before any update): a buffer of its own when the
        G->OS reduce-scatter produces it (os > g) or bf16 traffic is widened back to fp32; a view of
        the fp32 G shard otherwise (amsp.flat_unit launch_os_reduce / finish_sync)."""
        own = deg.os > deg.g or self._gb != 4
        return padded // deg.os * 4 if own else 0

    def gathered_bytes(self, role: str, deg: Degrees) -> int:
        return padded_numel(self._numel[role], deg) * self._pb if deg.p > 1 else 0

    def spread_bytes(self, role: str, deg: Degrees) -> int:
        """Transient of one unit's parameter spread while in flight: the received S/p buffer in the
        compute dtype plus the master's cast to it (none when the weights are the master)."""
        if deg.os == deg.p:
            return 0
        s = padded_numel(self._numel[role], deg)
        cast = 0 if self._master_is_weights else s // deg.os
        return (s // deg.p + cast) * self._pb

    def sync_copy_bytes(self, role: str, deg: Degrees) -> float:
        """memory_events.sync_copy_bytes for one unit of `role` (neighbouring pairs: buffer_pairs)."""
        return sync_copy_bytes(padded_numel(self._numel[role], deg), deg, self._gb, self.collectives_stage_copies)

    def group_cost(self, group: str, deg: Degrees) -> GroupCost:
        exposed, parts, by_phase, gathered = 0.0, dict.fromkeys(STATE_PARTS, 0), {}, {}
        spread, buckets, fills, inflight, copies = {}, {}, {}, {}, {}
        comm = 0.0
        for role, count in self.roles_of(group):
            comm += count * sum(x.seconds * x.count for x in self._role_collectives(role, deg).values())
            for ph, sec in self.unit_exposure(role, deg).items():
                by_phase[ph] = by_phase.get(ph, 0.0) + count * sec
                exposed += count * sec
            for part, b in self.state_parts(role, deg).items():
                parts[part] += count * b
            gathered[role] = self.gathered_bytes(role, deg)
            spread[role] = self.spread_bytes(role, deg)
            buckets[role] = self.grad_bucket_bytes(role, deg)
            fills[role] = self.grad_fill_bytes(role, deg)
            inflight[role] = self.grad_inflight_bytes(role, deg)
            copies[role] = self.sync_copy_bytes(role, deg)
        resident = sum(v for k, v in parts.items() if k != "grad_sync")
        return GroupCost(exposed, comm, resident, gathered, spread, buckets, fills, inflight, parts, by_phase,
                         parts["grad_sync"], copies)

    def peak_pair(self, per_role: dict) -> float:
        """Largest sum over a pair of neighbouring units (buffer_pairs) of a per-unit quantity (role -> bytes
        of one unit): the gathered units, or gloo's copies in the G->OS sync."""
        return max(sum(per_role[r] for r in pair) for pair in self.buffer_pairs())

    # ---- whole plans (walks every unit; the reference the per-group terms must add up to) ----
    def evaluate(self, plan: Plan) -> "PlanCost":
        from .report import PlanCost  # the result type lives with its formatting

        collectives: list[Priced] = []
        exposed = {}
        parts = dict.fromkeys(STATE_PARTS, 0)
        gathered, buckets, fills, inflight, copies = {}, {}, {}, {}, {}
        spread = 0
        for unit, role in self.w.unit_roles():
            deg = plan.for_group(unit.group)
            collectives += self.unit_collectives(unit, deg, role)
            for ph, sec in self.unit_exposure(role, deg).items():
                exposed[ph] = exposed.get(ph, 0.0) + sec
            for part, b in self.state_parts(role, deg).items():
                parts[part] += b
            gathered[role] = self.gathered_bytes(role, deg)
            buckets[role] = self.grad_bucket_bytes(role, deg)
            fills[role] = self.grad_fill_bytes(role, deg)
            inflight[role] = self.grad_inflight_bytes(role, deg)
            copies[role] = self.sync_copy_bytes(role, deg)
            spread = max(spread, self.spread_bytes(role, deg))
        collectives += self.grad_norm()
        memory = dict(parts)
        memory["grad_sync"] += self.peak_pair(copies)  # gloo's copies in the sync (memory_events)
        memory["gathered"] = self.peak_pair(gathered)
        memory["spread"] = self.spread_window * spread
        memory["buckets"] = self.peak_grad_buckets(buckets, fills, inflight)
        memory.update(self.constant_memory())
        # The peak is the larger of two phases, not the sum of everything: forward/backward holds the
        # activations, gathered units and gradient buckets; the optimizer step holds the OS-shard
        # gradients (grad_sync) after they are freed. The spread's buffers are in flight in the next
        # forward when it overlaps it, else after the update, which has freed the OS-shard gradients.
        # step_reuse (<= 0) books both reuses, so the parts add up to the peak.
        spread_fb, spread_step = (memory["spread"], 0) if self.o.overlap_spread else (0, memory["spread"])
        transients = memory["gathered"] + memory["activations"] + memory["buckets"] + spread_fb
        step = max(memory["grad_sync"], spread_step)
        memory["step_reuse"] = max(transients, step) - transients - memory["grad_sync"] - spread_step
        memory["reserved"] = self.reserve_bytes(sum(memory.values()))
        exposed["grad_norm"] = sum(x.seconds * x.count for x in self.grad_norm())
        return PlanCost(plan=plan, compute_s=self.compute_s(), exposed_s=exposed, memory=memory,
                        collectives=collectives, device_memory=self.c.device_memory_bytes,
                        state_budget=self.o.state_budget_bytes,
                        tokens_per_step_per_rank=self.w.tokens_per_micro_batch * self.w.micro_batches,
                        model_flops_per_rank=self.w.model_flops_per_step(), peak_flops=self.c.peak_flops)
