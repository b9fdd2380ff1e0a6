"""Re-planning from measurement: compare a run's measured step time and memory with its plan's
prediction, refit the cost model's constants, re-solve, and decide whether a switch is worth it.

Pure functions over the planner's types (no torch.distributed, no files, no engine):
amsp/replan_switch.py runs them on rank 0 during training and swaps the engine.

The refit corrects the model's inputs, not its outputs, so the re-solve prices every candidate plan
with the corrected constants, not only the one that ran:
  * compute_scale makes measured compute = predicted compute. Measured compute is the median step time
    minus the median exposed communication (the waits amsp.collectives books); predicted compute is
    compute_s plus the optimizer step and the overlap slowdown (the terms that are not waits). It
    multiplies the compute profile's seconds (the AdamW rate's too), or divides the peak FLOP/s when
    compute came from FLOPs, and divides the memory bandwidth either way (refitted_inputs).
  * comm_scale multiplies every latency and divides every bandwidth of the cluster. Exposed time is
    not linear in it (a collective hides until it outgrows its compute window), so it is found by
    bisection: the scale at which the plan's predicted exposed communication, with compute already
    refitted, equals the measured one. When neither side exposes more than 1% of the step the traffic
    was hidden and says nothing about the links: the scale stays 1. The overlap slowdown depends on
    both, so the two are fitted in turn (refit).
  * memory_scale is what the device held at its peak over the predicted tensor peak: the caching
    allocator's reserved peak on CUDA, the anonymous peak above the engine's start on CPU (glibc keeps
    freed blocks, and the runtime grows a little as it runs). The tensors are not rescaled (the
    prediction of every plan's tensors stays the model's); the allocator margin becomes at least
    memory_scale - 1 (at most MAX_MARGIN), so a plan the re-solve picks fits with the overhead this run
    showed. It is never lowered: one run's peak does not show what another plan's allocation pattern keeps.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from .allocator import margin_for
from .cluster import AlphaBeta, BandwidthCurve, ClusterSpec
from .cost_model import CostModel, Options
from .report import PlanCost
from .workload import Workload

NOT_WAITS = ("optimizer", "contention")  # exposed-time terms that are compute, not collective waits
_SCALE_RANGE = (1e-3, 1e3)
NOISE_FLOOR = 0.01  # exposed communication under 1% of the step on both sides says nothing about the links
MAX_MARGIN = 0.9  # Options.memory_margin must stay below 1


@dataclass(frozen=True)
class Measured:
    step_s: float  # median step time over the window (step 1 of the process excluded)
    exposed_comm_s: float  # median per-step time stalled in collective waits
    peak_bytes: float  # per-rank peak memory (the largest rank), baseline subtracted on CPU
    steps: int  # steps in the window
    held_bytes: float | None = None  # the peak the device held (CUDA: reserved); None: peak_bytes


@dataclass(frozen=True)
class Refit:
    compute_scale: float
    comm_scale: float
    memory_scale: float = 1.0  # held peak / predicted tensor peak (1.0: nothing measured)


@dataclass(frozen=True)
class Decision:
    switch: bool
    reason: str
    current: PlanCost  # the running plan, priced with the refitted constants
    best: PlanCost  # the re-solve's choice, priced with the refitted constants


def window_median(step_times: list[float], skip_first: bool = True) -> float:
    """Median of a window of per-step values; the process's first step (warm-up, allocation) is
    left out when it is in the window."""
    values = step_times[1:] if skip_first else step_times
    if not values:
        raise ValueError("a recheck needs at least one step after the first")
    return float(statistics.median(values))


def comm_exposed_s(cost: PlanCost) -> float:
    return sum(s for phase, s in cost.exposed_s.items() if phase not in NOT_WAITS)


def predicted_compute_s(cost: PlanCost) -> float:
    return cost.compute_s + sum(cost.exposed_s.get(phase, 0.0) for phase in NOT_WAITS)


def scaled_cluster(cluster: ClusterSpec, comm_scale: float, compute_scale: float = 1.0,
                   flops: bool = True) -> ClusterSpec:
    """The cluster with collectives comm_scale times slower (latency up, bandwidth down) and its compute
    compute_scale times slower: the memory bandwidth (it prices the AdamW step and selective
    recomputation's re-runs) and, when flops, the peak FLOP/s (it prices the matmuls when no profile was
    measured)."""
    if comm_scale <= 0 or compute_scale <= 0:
        raise ValueError(f"scales must be positive, got comm {comm_scale}, compute {compute_scale}")
    curves = {k: BandwidthCurve(tuple((size, bw / comm_scale) for size, bw in c.points))
              for k, c in cluster.curves.items()}
    fallback = {k: AlphaBeta(ab.latency_s * comm_scale, ab.gbps / comm_scale) for k, ab in cluster.fallback.items()}
    return replace(cluster, curves=curves, fallback=fallback,
                   peak_flops=cluster.peak_flops / compute_scale if flops else cluster.peak_flops,
                   memory_bandwidth_gbs=cluster.memory_bandwidth_gbs / compute_scale,
                   source=f"{cluster.source}, refitted")


def refitted_inputs(cluster: ClusterSpec, options: Options, refit: Refit) -> tuple[ClusterSpec, Options]:
    """Cost-model inputs with the refit applied. compute_scale slows every compute term alike: the
    measured profile's seconds (the AdamW rate included) when there is one, else the peak FLOP/s, and in
    both cases the memory bandwidth; communication through the cluster."""
    s = refit.compute_scale
    margin = margin_for(options.memory_margin, cluster.device)
    options = replace(options, memory_margin=refitted_margin(margin, refit.memory_scale))
    if options.compute is not None:
        p = options.compute
        opt = None if p.optimizer_s_per_elem is None else p.optimizer_s_per_elem * s
        profile = replace(p, block_forward_s=p.block_forward_s * s, block_backward_s=p.block_backward_s * s,
                          head_forward_backward_s=p.head_forward_backward_s * s, embedding_s=p.embedding_s * s,
                          optimizer_s_per_elem=opt, source=f"{p.source}, x{s:.3g} from the recheck")
        return scaled_cluster(cluster, refit.comm_scale, s, flops=False), replace(options, compute=profile)
    return scaled_cluster(cluster, refit.comm_scale, s), options


def refitted_margin(margin: float, memory_scale: float) -> float:
    """The allocator margin after a recheck: raised to the overhead measured (never lowered)."""
    return max(margin, min(MAX_MARGIN, memory_scale - 1.0))


def memory_scale(prior: PlanCost, measured: Measured) -> float:
    """What the device held at its peak over the predicted tensor peak; 1.0 when either is missing."""
    tensors = prior.memory_total - prior.memory.get("reserved", 0)
    held = measured.peak_bytes if measured.held_bytes is None else measured.held_bytes
    return held / tensors if held > 0 and tensors > 0 else 1.0


def _bisect_log(f, target: float) -> float:
    """The scale in _SCALE_RANGE at which the increasing function f reaches target (clamped to the range)."""
    lo, hi = _SCALE_RANGE
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(40):  # bisection in log space
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def refit(workload: Workload, cluster: ClusterSpec, options: Options, plan, measured: Measured) -> Refit:
    """The two scales that make the running plan's prediction match what was measured: its compute
    terms (compute, optimizer, contention) the measured step less its waits, its exposed communication
    the measured waits. The contention term (hidden communication slowing compute) couples the two, so
    they are fitted in turn until both hold."""
    prior = CostModel(workload, cluster, options).evaluate(plan)
    target_compute = max(1e-9, measured.step_s - measured.exposed_comm_s)
    target_comm = measured.exposed_comm_s

    def priced(compute_scale: float, comm_scale: float):
        c, o = refitted_inputs(cluster, options, Refit(compute_scale, comm_scale))
        return CostModel(workload, c, o).evaluate(plan)

    compute_scale = target_compute / max(1e-12, predicted_compute_s(prior))
    comm_scale = 1.0
    floor = NOISE_FLOOR * measured.step_s
    for _ in range(4):  # each round moves the other scale less; two or three settle it
        compute_scale = _bisect_log(lambda s: predicted_compute_s(priced(s, comm_scale)), target_compute)
        if comm_exposed_s(priced(compute_scale, 1.0)) <= floor and target_comm <= floor:
            comm_scale = 1.0  # (nearly) everything hidden on both sides: no information on the links
        elif comm_exposed_s(priced(compute_scale, _SCALE_RANGE[1])) <= floor:
            # The plan's collectives leave nothing exposed even on links 1000x slower (a data-parallel group
            # of one: a pipeline of pp ranks): the waits measured are not theirs, so they say nothing of the
            # links. Before, the scale ran to its clamp and the recheck deleted a good probe cache.
            comm_scale = 1.0
        else:
            comm_scale = _bisect_log(lambda c: comm_exposed_s(priced(compute_scale, c)), target_comm)
    return Refit(compute_scale, comm_scale, memory_scale(prior, measured))


def decide(current: PlanCost, best: PlanCost, user_named: bool, min_gain: float,
           joint: bool = False) -> Decision:
    """Switch when the re-solve's plan is predicted at least min_gain (amsp.planner.replan_min_gain: a switch
    costs a checkpoint and a reload) faster than the running one
    (both priced with the refitted constants) and the plan was the AMSP planner's own choice (not the
    user's, nor one stage's share of a joint plan, which the AMSP re-solve does not re-plan)."""
    same = (best.plan.blocks, best.plan.embed_head) == (current.plan.blocks, current.plan.embed_head)
    gain = 1.0 - best.step_time_s / current.step_time_s if current.step_time_s > 0 else 0.0
    if joint:
        return Decision(False, "the plan is the joint planner's (parallel.auto): re-planning switches amsp.plan=auto "
                               "plans only, so the recheck reports", current, best)
    if user_named:
        return Decision(False, "the plan was named by the user (amsp.plan or explicit degrees): the recheck "
                               "reports only", current, best)
    if same:
        return Decision(False, "the running plan is still the best after the refit", current, best)
    if gain < min_gain:
        return Decision(False, f"{best.plan} is predicted only {gain:.1%} faster (< {min_gain:.0%})", current, best)
    return Decision(True, f"{best.plan} is predicted {gain:.1%} faster than {current.plan} with the refitted "
                          f"constants (>= {min_gain:.0%})", current, best)


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured; None when nothing was measured."""
    return (predicted - measured) / measured if measured > 0 else None
