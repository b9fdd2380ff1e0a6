"""What one pipeline stage costs on its kind of node: per-unit compute with tensor-parallel collectives,
its AMSP communication and optimizer step over its data-parallel group, and its memory.

Units are the engine's (embedding, each block, head). Compute of a block per micro-batch comes from its
FLOPs (models/llama/flops.py convention, amsp/planner/workload.py) at the node's peak times an efficiency
(the planner's MFU, or a measured profile per node type), divided by tp; with tensor + sequence
parallelism a block runs 2 all-gathers and 2 reduce-scatters of its activations forward and again
backward (Megatron-SP), priced with the node's intra-node curves; full recomputation runs the forward
(and its collectives) once more. The embedding costs its TP collectives; the head 3x its projection.
Where the units were timed at startup on this kind of node (Setting.unit_times: the block, head and
embedding forward + backward at this tp, amsp/parallel/tp_profile.py for tp > 1), those times replace
the FLOPs estimate: they include what the bytes-only TP model leaves out (per-collective dispatch,
narrower matmuls), and recomputation adds a third of the block (its forward).

AMSP on the stage's DP group prices each unit's collectives as amsp/schedule.py issues them
(cost_model.layout gives the group shapes): the P all-gathers (forward and backward) and the G
reduce-scatter per micro-batch, hidden behind that micro-batch's compute as far as it lasts; the G->OS
reduce-scatter, the OS-replica all-reduce and the spread once per step, hidden behind the pipeline drain
(the backward of the stages before this one, which finish after it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from amsp.plan import Degrees, enumerate_degrees
from amsp.schedule import Precision
from models.llama.config import LlamaConfig

from ..allocator import margin_for
from ..comm_time import collective_seconds
from ..cost_model import layout
from ..memory_events import collectives_stage_copies, reduce_scatter_inflight_bytes, sync_copy_bytes
from ..update_cost import UPDATE_HIDDEN_COST, adam_seconds_per_elem, overlapped_update_exposed
from ..workload import Kernels, Workload
from .hetero import HeteroCluster, NodeGroup, group_as_cluster


@dataclass(frozen=True)
class Setting:
    """What every stage shares: model, sequence, precision, degrees, micro-batch shape."""
    model: LlamaConfig
    seq_len: int
    precision: Precision
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    micro_batches: int  # per step per DP rank
    efficiency: dict  # node preset name -> fraction of peak the compute reaches
    memory_margin: float | None = None  # None: the node group's allocator's (planner/allocator.py)
    reserved_bytes: float = 2**30
    # compute seconds lost per second of communication hidden behind it (measured at startup by
    # compute_profile.py, as for the AMSP planner); None: each node group's preset figure
    overlap_slowdown: float | None = None
    # (node preset name, tp, micro-batch size) -> (block, head, embedding) forward + backward seconds
    # of one micro-batch, measured at startup; missing entries are priced from FLOPs
    unit_times: dict = field(default_factory=dict)
    # the engine's parameter spread (amsp.overlap_spread, amsp.spread_window): where its buffers peak
    overlap_spread: bool = False
    spread_window: int = 2
    # node preset name -> seconds of one AdamW step of the run's kernel per OS element on fp32 masters,
    # measured at startup (compute_profile.time_optimizer; joint_inputs.joint_compute scales a rate timed
    # with another kernel by bytes); missing: the node's memory bandwidth prices it
    optimizer_s_per_elem: dict = field(default_factory=dict)
    # what the run's device executes (Workload.kernels; None: every op model.fused enables, fused)
    kernels: Kernels | None = None
    sequence_parallel: bool = True  # parallel.sequence_parallel
    # amsp.overlap_update: on a CUDA node group each unit's update hides behind the forward before it
    # (cost_model.CostModel.update_exposed's rule and UPDATE_HIDDEN_COST, per stage); on CPU it runs inline
    overlap_update: bool = False
    optimizer_kernel: str = "auto"  # amsp.optimizer_kernel: the bytes its AdamW moves (update_cost.py)
    # parallel.loss_parallel: off, a tp > 1 head all-gathers the full logits on every TP rank (their
    # memory, Workload.loss_vocab, and the gather's time)
    loss_parallel: bool = True

    def workload(self, recompute: str = "none") -> Workload:
        # pp = 1: a stage's own layers, priced as one stage of the pipeline when pp > 1
        return Workload(self.model, self.seq_len, self.micro_batch_size, self.micro_batches, self.precision,
                        recompute=recompute, tp=self.tp, pp=1, kernels=self.kernels,
                        sequence_parallel=self.sequence_parallel, pipeline_stage=self.pp > 1,
                        loss_parallel=self.loss_parallel)


def _adjacent_pairs(sizes: list) -> list:
    """Sums of neighbouring units in forward order (one unit alone when the stage has one)."""
    return [sizes[i] + sizes[i + 1] for i in range(len(sizes) - 1)] or [sizes[0]]


@dataclass(frozen=True)
class UnitCosts:
    """Per-unit compute seconds of one micro-batch (forward + backward) on one kind of node."""
    embed: float
    block: float
    block_full: float  # with full recomputation
    head: float
    tp_comm_block: float  # the TP collectives inside `block` (for the report)


def unit_costs(s: Setting, g: NodeGroup) -> UnitCosts:
    w = s.workload()
    rate = g.spec.peak_flops * s.efficiency.get(g.name, 0.45)
    act = s.micro_batch_size * s.seq_len * s.model.dim * s.precision.param_bytes  # full activation bytes
    tp = s.tp
    one = 0.0
    if tp > 1:  # one all-gather + one reduce-scatter of the activations inside the node
        one = (collective_seconds(g.spec, "all_gather", act, tp, tp, 1)
               + collective_seconds(g.spec, "reduce_scatter", act, tp, tp, 1))
    measured = measured_units(s, g.name)
    if measured is not None:
        block, head, embed = measured
        return UnitCosts(embed=embed, block=block, block_full=block * 4 / 3, head=head, tp_comm_block=4 * one)
    f = w.block_forward_flops() / rate
    block = 3 * f + 4 * one  # forward + backward (2x), 2 AG + 2 RS each way
    block_full = block + f + 2 * one  # the forward again before the backward
    # without loss_parallel the head's output is all-gathered to the full logits on every TP rank (its
    # backward only slices the gradient); measured units above were timed that way (tp_profile)
    gather = 0.0
    if tp > 1 and not s.loss_parallel:
        logits = s.micro_batch_size * s.seq_len * s.model.vocab_size * s.precision.param_bytes
        gather = collective_seconds(g.spec, "all_gather", logits, tp, tp, 1)
    head = 3 * w.head_forward_flops() / rate + one + gather
    return UnitCosts(embed=one, block=block, block_full=block_full, head=head, tp_comm_block=4 * one)


def measured_units(s: Setting, node: str) -> tuple[float, float, float] | None:
    """(block, head, embedding) seconds per micro-batch measured for this node type and tp: at this
    micro-batch size; else, with two or more sizes measured, on the line through the two nearest (a fixed
    cost per micro-batch, launches and small-matrix inefficiency, plus a cost per sample; never below
    zero); with one size, in proportion to it. None: not measured."""
    sizes = sorted(m for (n, tp, m) in s.unit_times if n == node and tp == s.tp)
    if not sizes:
        return None
    want = s.micro_batch_size
    if want in sizes:
        return tuple(s.unit_times[(node, s.tp, want)])
    if len(sizes) == 1:
        (m,) = sizes
        return tuple(t * want / m for t in s.unit_times[(node, s.tp, m)])
    lo = max([m for m in sizes if m < want] or sizes[:1])  # the bracketing pair, or the two nearest at an end
    hi = min([m for m in sizes if m > want] or sizes[-1:])
    if lo == hi:
        lo, hi = (sizes[-2], sizes[-1]) if want > sizes[-1] else (sizes[0], sizes[1])
    a, b = s.unit_times[(node, s.tp, lo)], s.unit_times[(node, s.tp, hi)]
    return tuple(max(0.0, x + (y - x) * (want - lo) / (hi - lo)) for x, y in zip(a, b))


def unit_params(s: Setting) -> tuple[int, int, int]:
    """TP-local parameters of the embedding, one block, the head (its norm only when tied)."""
    w = s.workload()
    return w.embedding_numel, w.block_numel, w.head_numel


@dataclass(frozen=True)
class StageChoice:
    degrees: Degrees
    recompute: bool
    compute_s: float  # per micro-batch, TP collectives included
    exposed_mb_s: float  # AMSP per-micro-batch communication left exposed, per micro-batch
    sync_s: float  # AMSP once-per-step communication (before the drain hides part of it)
    optim_s: float
    memory_bytes: float  # peak, reserve included
    memory_parts: dict


class StagePricer:
    """Prices one stage (index, units, node group) for any AMSP degrees and recomputation."""

    def __init__(self, s: Setting, cluster: HeteroCluster, stage: int, group: NodeGroup,
                 comm_cache: dict | None = None):
        self.s, self.stage, self.g = s, stage, group
        self._comm = {} if comm_cache is None else comm_cache  # (group, numel, degrees) -> seconds
        gpn = cluster.ranks_per_node
        self.dp_per_node = min(s.dp, gpn // s.tp)
        nodes = max(1, s.dp // self.dp_per_node)
        self.spec = group_as_cluster(group, nodes, gpn)
        self.costs = unit_costs(s, group)
        self.params = unit_params(s)
        self.budget = group.spec.device_memory_bytes
        self.margin = margin_for(s.memory_margin, group.spec.device)
        self.staged = collectives_stage_copies(group.spec.device)  # gloo's copies (cost_model)
        self.candidates = enumerate_degrees(s.dp, self.dp_per_node)
        # activation bytes per micro-batch (the DP over splits asks for them thousands of times)
        w, wf = s.workload("none"), s.workload("full")
        self.layer_act = {False: w.layer_activation_bytes(), True: wf.layer_activation_bytes()}
        self.head_act = w.head_activation_bytes()
        self.loss_backward = w.loss_backward_transient_bytes()
        # the pipeline's receive buffers of one direction (workload.pipeline_buffer_bytes): a stage
        # without the embedding receives activations, one without the head output gradients
        self.recv_buffers = w.pipeline_buffer_bytes(first=True, last=False, stages=s.pp)
        # one parameter's autograd gradient per unit when g = 1 (cost_model.grad_bucket_bytes)
        self.largest = {role: w.largest_param_numel(role) for role in ("embedding", "block", "head")}
        self.head_fused = w.head_loss_fused
        # activations freed before a gradient bucket peaks (Workload.activations_freed_before), per
        # recomputation, and a block's backward working tensors beside its filling buffer
        # (cost_model.grad_fill_bytes)
        self.freed = {rc: {roles: wk.activations_freed_before(roles)
                           for roles in (("head",), ("block", "head"), ("block", "block"))}
                      for rc, wk in ((False, w), (True, wf))}
        self.block_working = w.block_backward_transient_bytes()
        # one AdamW element's update with the run's kernel, the compute-weight write included where the
        # weights are a separate copy (as CostModel prices a role's)
        weight_write = 0 if s.precision.master_is_weights else s.precision.param_bytes
        self.optimizer_per_elem = adam_seconds_per_elem(s.optimizer_kernel, weight_write,
                                                        s.optimizer_s_per_elem.get(group.name), s.optimizer_kernel,
                                                        group.spec.memory_bandwidth_gbs * 1e9)

    # ---- compute ----
    def update_s(self, n_blocks: int, embed: bool, head: bool, per_elem: float) -> float:
        """The stage's optimizer update in the step time: all of it, or with amsp.overlap_update on a CUDA
        node group the updates of the stage's first unit (and the embedding's) plus what each later
        unit's exceeds the forward before it (a block's forward taken as a third of its forward +
        backward), and the hidden rest at UPDATE_HIDDEN_COST (measured: the update hides poorly)."""
        pe, pb, ph = self.params
        units = ([pe] if embed else []) + [pb] * n_blocks + ([ph] if head and ph else [])
        whole = sum(units) * per_elem
        if not (self.s.overlap_update and self.g.spec.device == "cuda") or not units:
            return whole
        waits = ([pe] if embed else []) + ([pb] if n_blocks else [])  # nothing before them to hide behind
        exposed = overlapped_update_exposed(sum(waits) * per_elem, [u * per_elem for u in units[len(waits):]],
                                            self.costs.block / 3)
        return exposed + UPDATE_HIDDEN_COST * (whole - exposed)

    def compute_s(self, n_blocks: int, embed: bool, head: bool, recompute: bool) -> float:
        c = self.costs
        return (n_blocks * (c.block_full if recompute else c.block) + (c.embed if embed else 0.0)
                + (c.head if head else 0.0))

    # ---- memory ----
    def memory(self, n_blocks: int, embed: bool, head: bool, deg: Degrees, recompute: bool,
               in_flight: int) -> tuple[float, dict]:
        """Peak bytes of one rank of the stage, the AMSP planner's accounting (cost_model.py) over the
        stage's units: model states throughout, then the larger of two phases. Forward/backward: the
        largest pair of units gathered together (current + prefetched, forward order), a pair's flat
        gradients on their way to the reduce-scatter with the gradient being copied into the filling
        one and what the other's reduce-scatter holds in flight (g = 1: one parameter's gradient per
        unit; on the last stage the loss backward's transient where that is larger), the activations
        of the micro-batches in flight (1F1B). The optimizer step: the OS-shard gradients held from the
        sync to the update; a spread that follows the update comes after them (the larger counts),
        one that overlaps the next forward joins forward/backward."""
        s, prec = self.s, self.s.precision
        pe, pb, ph = self.params
        tied_here = embed and head and not ph  # one embedding+head unit, gathered through the whole forward
        order = ([pe] if embed else []) + [pb] * n_blocks + ([ph] if head and ph else [])
        params = sum(order)
        states = params * (prec.param_bytes / deg.p + 4 / deg.g + prec.optim_bytes / deg.os)
        pairs = _adjacent_pairs(order)
        gathered_units = pe + 2 * pb if tied_here and n_blocks >= 2 else max(pairs)
        gathered = gathered_units * prec.param_bytes if deg.p > 1 else 0.0
        # the gradient pair (g = 1: one parameter's autograd gradient per unit), or on the last stage
        # the loss backward's transient if larger (it runs before any gradient exists)
        lb, le, lh = self.largest["block"], self.largest["embedding"], self.largest["head"]
        one = ([le] if embed else []) + [lb] * n_blocks + ([lh] if head and ph else [])
        roles = (["embedding"] if embed else []) + ["block"] * n_blocks + (["head"] if head and ph else [])
        working = [self.block_working if r == "block" else 0.0 for r in roles]  # beside a filling block
        separate_head = head and ph and len(order) > 1
        if deg.g > 1:
            # a unit's flat buffer filling (and the gradient in copy) while the next unit's is in flight
            # (cost_model.bucket_events); the head, first in the backward, alone; the fused head's
            # gradient is the d/dW its forward kept
            fill = [x * prec.param_bytes for x in one]
            if head and ph and self.head_fused:
                fill[-1] = 0.0
            fill = [f + w for f, w in zip(fill, working)]
            grad_pairs = [x * prec.grad_bytes + f for x, f in zip(pairs, fill)]
            # the unit after the filling one (forward order) has its reduce-scatter in flight
            for i, nxt in enumerate(order[1:]):
                grad_pairs[i] += reduce_scatter_inflight_bytes(nxt, deg, prec.grad_bytes, prec.param_bytes,
                                                               self.staged)
            if separate_head:
                grad_pairs.append(order[-1] * prec.grad_bytes + fill[-1])
        else:
            grad_pairs = [x * prec.param_bytes + w for x, w in zip(_adjacent_pairs(one), working)]
            if separate_head:
                grad_pairs.append(lh * prec.param_bytes)
        if separate_head:  # what is freed before each bucket event (as cost_model.bucket_events)
            freed = self.freed[recompute]
            for i in range(len(roles) - 1):
                grad_pairs[i] -= freed.get((roles[i], roles[i + 1]), 0.0)
            grad_pairs[-1] -= freed[("head",)]
        # the untied embedding's pair arrives last in the backward, beside only the other micro-batches
        # in flight and the receive buffers (Workload.activation_bytes_at_embedding_backward)
        last = embed and not tied_here and len(order) > 1
        emb_pair = grad_pairs.pop(0) if last else None
        buckets = max(grad_pairs + [self.loss_backward if head else 0.0])
        own_sync = deg.os > deg.g or prec.grad_bytes != 4  # else the OS gradient is a view of the G shard
        grad_sync = params / deg.os * 4 if own_sync else 0.0
        grad_sync += sync_copy_bytes(max(pairs), deg, prec.grad_bytes, self.staged)  # gloo's, neighbours in flight
        cast = 0.0 if prec.master_is_weights else 1 / deg.os
        spread = 0.0 if deg.os == deg.p else \
            min(s.spread_window, len(order)) * max(order) * (1 / deg.p + cast) * prec.param_bytes
        per_mb = n_blocks * self.layer_act[recompute] + (self.head_act if head else 0.0)
        acts = (in_flight * per_mb + (self.layer_act[False] if recompute else 0.0)
                + self.recv_buffers * ((not embed) + (not head)))
        transient = buckets + acts
        if emb_pair is not None:
            transient = max(transient, emb_pair + (in_flight - 1) * per_mb + self.recv_buffers * (not head))
        fwd_bwd = gathered + transient + (spread if s.overlap_spread else 0.0)
        step = max(grad_sync, 0.0 if s.overlap_spread else spread)  # a spread after the update: grad_sync freed
        tensors = states + max(fwd_bwd, step)
        total = tensors * (1 + self.margin) + s.reserved_bytes
        # parts add up to the tensor peak: what the step needs beyond forward/backward is its own part
        return total, {"states": states, "buffers": fwd_bwd - acts, "activations": acts,
                       "step_extra": max(0.0, step - fwd_bwd), "reserve": total - tensors}

    def fits(self, n_blocks: int, embed: bool, head: bool, recompute: bool, in_flight: int) -> bool:
        """With the most sharded AMSP degrees: can this range live on the stage at all?"""
        full = Degrees(self.s.dp, self.s.dp, self.s.dp)
        return self.memory(n_blocks, embed, head, full, recompute, in_flight)[0] <= self.budget

    # ---- AMSP communication ----
    def _unit_comm(self, numel: int, deg: Degrees) -> tuple[float, float]:
        """(per micro-batch, once per step) seconds of one unit's collectives."""
        if numel <= 0 or self.s.dp == 1:
            return 0.0, 0.0
        key = (self.g.name, numel, deg)
        if key not in self._comm:
            self._comm[key] = self._price_unit(numel, deg)
        return self._comm[key]

    def _price_unit(self, numel: int, deg: Degrees) -> tuple[float, float]:
        prec, r, n = self.s.precision, self.dp_per_node, self.s.dp

        def t(kind, key, nbytes):
            size, k, m = layout(key, deg, r, n)
            return collective_seconds(self.spec, kind, nbytes, size, k, m) if size > 1 else 0.0

        per_mb = (2 * t("all_gather", "p", numel * prec.param_bytes)
                  + t("reduce_scatter", "g", numel * prec.grad_bytes))
        once = (t("reduce_scatter", "g_to_os", numel // deg.g * prec.grad_bytes)
                + t("all_reduce", "os_replica", numel // deg.os * prec.grad_bytes)
                + t("all_gather", "spread", numel // deg.p * prec.param_bytes))
        return per_mb, once

    def choose(self, n_blocks: int, embed: bool, head: bool, in_flight: int, drain_s: float,
               degrees: Degrees | None = None, recompute_options=(False, True)) -> StageChoice | None:
        """The fastest (AMSP degrees, recomputation) that fits, or None; `degrees` / `recompute_options`
        restrict the choice (pricing a plan someone named)."""
        pe, pb, ph = self.params
        best = None
        for recompute in recompute_options:
            compute = self.compute_s(n_blocks, embed, head, recompute)
            for deg in ([degrees] if degrees is not None else self.candidates):
                mem, parts = self.memory(n_blocks, embed, head, deg, recompute, in_flight)
                if mem > self.budget:
                    continue
                mb_b, once_b = self._unit_comm(pb, deg)
                mb_e, once_e = self._unit_comm(pe, deg) if embed else (0.0, 0.0)
                mb_h, once_h = self._unit_comm(ph, deg) if head else (0.0, 0.0)
                per_mb = n_blocks * mb_b + mb_e + mb_h
                once = n_blocks * once_b + once_e + once_h
                params = n_blocks * pb + (pe if embed else 0) + (ph if head else 0)
                per_elem = self.optimizer_per_elem / deg.os
                # what the compute cannot hide, plus what hiding the rest costs the compute
                slowdown = self.s.overlap_slowdown if self.s.overlap_slowdown is not None \
                    else self.g.spec.overlap_slowdown
                optim = self.update_s(n_blocks, embed, head, per_elem)
                exposed_mb = max(0.0, per_mb - compute) + slowdown * min(per_mb, compute)
                c = StageChoice(deg, recompute, compute, exposed_mb, once, optim, mem, parts)
                key = (compute + exposed_mb) * self.s.micro_batches + max(0.0, once - drain_s) + optim
                if best is None or key < best[0]:
                    best = (key, c)
        return None if best is None else best[1]
