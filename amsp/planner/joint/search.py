"""Search of the joint space: (tp, pp, dp, micro-batch size) enumerated, the layer split by dynamic
programming, then per stage the AMSP degrees and recomputation.

For one (tp, pp, micro-batch size) the split minimises the slowest stage's per-micro-batch time over
contiguous ranges of units [embedding, block 0 .. block L-1, head] (stage 0 starts with the embedding,
the last ends with the head, every stage holds a block), each range priced on the node group its stage
lives on and infeasible (inf) when it does not fit even fully sharded with recomputation:
    f[i][k] = min over j of max(f[i-1][j], T_i(j, k))
f[i-1][.] grows with j and T_i(., k) shrinks with j, so the best j is where they cross: a binary search,
O(pp * L * log L) per candidate instead of O(pp * L^2). The step is then the 1F1B pipeline
    (B - 1) * max_i t_i + sum_i t_i      (t_i: stage i's micro-batch time, boundary sends included)
plus the slowest stage's exposed once-per-step AMSP sync and optimizer step. Plans that do not fit are
never returned.
"""
from __future__ import annotations

import dataclasses
import math
import time
from bisect import bisect_left
from dataclasses import dataclass, field

from amsp.errors import InputError
from amsp.parallel.mesh import stage_layout_problem
from amsp.parallel.micro_batches import micro_batch_problem
from amsp.schedule import Precision
from models.llama.config import LlamaConfig

from ..workload import Kernels
from .hetero import HeteroCluster, NodeGroup
from .stage_cost import Setting, StageChoice, StagePricer, unit_costs

INF = float("inf")


@dataclass
class JointPlan:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_micro: int  # micro-batches per step per DP rank
    layer_split: list[int]  # blocks per stage
    recompute: list[bool]  # full recomputation per stage
    stage_plans: list[tuple[int, int, int]]  # AMSP (p, g, os) of each stage's DP group
    stage_nodes: list[str]  # node group each stage runs on
    schedule: str
    step_s: float
    # seconds: pipeline_compute, bubble, boundary_sends, tp_comm, amsp_exposed, optimizer. tp_comm is not
    # added to the step: the TP collectives run inside each block, so pipeline_compute already holds them
    terms: dict
    stage_memory_gib: list[float]
    stage_budget_gib: list[float]
    decided_by: str = ""
    mfu: float = 0.0
    notes: list[str] = field(default_factory=list)

    def key(self) -> str:
        return f"tp{self.tp} pp{self.pp} dp{self.dp} mbs{self.micro_batch_size}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_candidates(model: LlamaConfig, ranks_per_node: int, seq_len: int, sequence_parallel: bool = True,
                  loss_parallel: bool = True) -> list[int]:
    """The tensor-parallel degrees the search considers (ascending, 1 first): they divide the ranks per
    node (TP stays inside a node) and every dimension TP splits (tensor_parallel.check_divisible): the
    sequence only when sequence parallelism splits it (without it every TP rank holds the whole sequence).
    Tied embeddings with loss_parallel off: tp 1 only (parallelize_llama refuses a tied head whose logits
    would be gathered)."""
    if model.tie_embeddings and not loss_parallel:
        return [1]
    dims = (model.n_heads, model.n_kv_heads, model.vocab_size, model.ffn_hidden_dim) + \
        ((seq_len,) if sequence_parallel else ())
    return [t for t in _divisors(ranks_per_node) if all(d % t == 0 for d in dims)]


# The settings that fix the joint planner's tp x pp (fixed_layout): the planner CLI's what-if degrees
FIXED_LAYOUT_KEYS = ("amsp.planner.tp", "amsp.planner.pp")


def fixed_layout(tp: int, pp: int, model: LlamaConfig, world: int, ranks_per_node: int, seq_len: int,
                 sequence_parallel: bool = True, loss_parallel: bool = True) -> tuple[int, int] | None:
    """The (tp, pp) amsp.planner.tp / amsp.planner.pp fix for the joint planner (the CLI's --joint and
    train.py's parallel.auto=true read them alike), or None at their default 1 x 1, which leaves both to
    the search. A layout the search could never choose on this cluster is a one-line InputError naming the
    setting (what is left to the search, batch and memory, is plan_joint's to explain)."""
    if (tp, pp) == (1, 1):
        return None
    given = f"amsp.planner.tp={tp}, amsp.planner.pp={pp}"
    tps = tp_candidates(model, ranks_per_node, seq_len, sequence_parallel)
    if tp not in tps:
        why = (" (model.tie_embeddings=true with parallel.loss_parallel=false keeps tp 1)"
               if model.tie_embeddings and not loss_parallel else "")
        raise InputError(f"{given}: the joint planner cannot run tp={tp} on this cluster{why}; the degrees it can "
                         f"take divide the {ranks_per_node} GPUs per node and the model's heads, kv heads, "
                         f"vocabulary and MLP width{' and data.seq_len' if sequence_parallel else ''}: "
                         f"{', '.join(map(str, tps))}")
    if tp not in tp_candidates(model, ranks_per_node, seq_len, sequence_parallel, loss_parallel):
        raise InputError(f"{given}: tp > 1 with model.tie_embeddings=true needs parallel.loss_parallel=true (the "
                         f"tied head's logits are vocabulary-sharded)")
    if world % (tp * pp) or pp > model.n_layers:
        raise InputError(f"{given}: tp x pp must divide the {world} GPUs and pp at most model.n_layers="
                         f"{model.n_layers}")
    if pp > 1 and model.tie_embeddings:
        raise InputError(f"{given}: pp > 1 with model.tie_embeddings=true (the embedding and the head share one "
                         f"table, which training keeps on one stage)")
    if problem := stage_layout_problem(world, ranks_per_node, tp, pp):
        raise InputError(f"{given} on {world} GPUs: {problem}")
    return tp, pp


class _Candidate:
    """One (tp, pp, mbs): stage pricers, the split DP, the per-stage choices and the step time."""

    def __init__(self, s: Setting, cluster: HeteroCluster):
        self.s, self.cluster = s, cluster
        per_stage = s.tp * s.dp
        # The stage pricer's DP shape (dp / dp-per-node) is exact only for stages that fit inside a node or
        # fill whole nodes, the layouts the mesh accepts (amsp/parallel/mesh.stage_layout_problem).
        problem = stage_layout_problem(cluster.world, cluster.ranks_per_node, s.tp, s.pp)
        if problem:
            raise InputError(f"tp={s.tp} pp={s.pp} on {cluster.world} GPUs: {problem}")
        self.pricers, by_group, comm_cache = [], {}, {}
        for i in range(s.pp):
            g = stage_group(s, cluster.groups_of_ranks(i * per_stage, (i + 1) * per_stage))
            key = (g.name, g.spec.device_memory_bytes)  # a stage across kinds may have the smaller memory
            if key not in by_group:  # stages on the same kind of node price alike: build once
                by_group[key] = StagePricer(s, cluster, i, g, comm_cache)
            self.pricers.append(by_group[key])
        self.L = s.model.n_layers
        self._times: dict = {}

    def in_flight(self, i: int) -> int:
        return min(self.s.pp - i, self.s.micro_batches)  # 1F1B: stage i holds pp - i micro-batches

    def stage_time(self, i: int, j: int, k: int) -> float:
        """Per-micro-batch compute of stage i holding units [j, k), or inf when it cannot fit."""
        L = self.L
        embed, head = j == 0, k == L + 2
        blocks = min(k, L + 1) - max(j, 1)
        if blocks < 1:
            return INF
        key = (i, blocks, embed, head)  # the time depends on the count, not on which blocks
        t = self._times.get(key)
        if t is None:
            t, p = INF, self.pricers[i]
            for recompute in (False, True):
                if p.fits(blocks, embed, head, recompute, self.in_flight(i)):
                    t = p.compute_s(blocks, embed, head, recompute)
                    break
            self._times[key] = t
        return t

    def shortfall(self) -> float:
        """Bytes the tightest stage of an even split lacks, fully sharded with recomputation."""
        pp, per = self.s.pp, -(-self.L // self.s.pp)
        return max(p.memory(per, i == 0, i == pp - 1, _full(self.s.dp), True, self.in_flight(i))[0] - p.budget
                   for i, p in enumerate(self.pricers))

    def split(self) -> list[int] | None:
        """Boundaries b_0=0 < b_1 < ... < b_pp = L+2 minimising the slowest stage (None: nothing fits)."""
        pp, n = self.s.pp, self.L + 2
        f = [[INF] * (n + 1) for _ in range(pp)]
        arg = [[-1] * (n + 1) for _ in range(pp)]
        for k in range(2, n + 1):
            f[0][k] = self.stage_time(0, 0, k)
        for i in range(1, pp):
            for k in range(i + 2, n + 1):
                # j: stage i-1 ends (exclusive) at j, stage i holds [j, k) with at least one block, so that
                # T_i(j, k) only shrinks as j grows (a head-only range would be inf at the top)
                lo, hi = i + 1, min(k, self.L + 1) - 1
                if lo > hi:
                    continue
                # smallest j with f[i-1][j] >= T_i(j, k): the optimum is there or one before
                js = list(range(lo, hi + 1))
                pos = bisect_left(js, True, key=lambda j: f[i - 1][j] >= self.stage_time(i, j, k))
                best, best_j = INF, -1
                for j in (js[pos - 1] if pos > 0 else None, js[pos] if pos < len(js) else None):
                    if j is None:
                        continue
                    v = max(f[i - 1][j], self.stage_time(i, j, k))
                    if v < best:
                        best, best_j = v, j
                f[i][k], arg[i][k] = best, best_j
        if f[pp - 1][n] == INF:
            return None
        bounds = [n]
        for i in range(pp - 1, 0, -1):
            bounds.append(arg[i][bounds[-1]])
        return [0] + bounds[::-1][:-1] + [n] if pp > 1 else [0, n]

    def evaluate(self, bounds: list[int], degrees=None, recompute=None) -> tuple[float, list[StageChoice], dict] | None:
        """Step time of this split; `degrees` (one Degrees for every stage) and `recompute` (bool) fix
        what is otherwise chosen per stage."""
        return self._evaluate(bounds, degrees, recompute)

    def _evaluate(self, bounds: list[int], degrees, recompute) -> tuple[float, list[StageChoice], dict] | None:
        s, L = self.s, self.L
        act = s.micro_batch_size * s.seq_len * s.model.dim * s.precision.param_bytes / s.tp  # one boundary send
        stages, sends = [], []
        times = [self.stage_time(i, bounds[i], bounds[i + 1]) for i in range(s.pp)]
        drains = [sum(2 / 3 * t for t in times[:i]) for i in range(s.pp)]  # earlier stages' backward
        for i in range(s.pp):
            j, k = bounds[i], bounds[i + 1]
            blocks = min(k, L + 1) - max(j, 1)
            c = self.pricers[i].choose(blocks, j == 0, k == L + 2, self.in_flight(i), drains[i] * s.micro_batches,
                                       degrees, (False, True) if recompute is None else (recompute,))
            if c is None:
                return None
            stages.append(c)
            if i + 1 < s.pp:  # activations forward and their gradients back, per micro-batch
                a, b = self.pricers[i].g, self.pricers[i + 1].g
                same_node = ((i + 1) * s.tp * s.dp) % self.cluster.ranks_per_node != 0
                gbs = (a.spec.fallback["intra"].gbps if same_node
                       else self.cluster.link_gbs(a, b) / self.cluster.ranks_per_node)
                sends.append(2 * act / (gbs * 1e9))
        t = []
        for i, c in enumerate(stages):
            boundary = (sends[i - 1] if i > 0 else 0.0) + (sends[i] if i < len(sends) else 0.0)
            t.append(c.compute_s + c.exposed_mb_s + boundary)
        B = s.micro_batches
        pipe = (B - 1) * max(t) + sum(t)
        busy_pipe = pipe
        shared = self.pricers[0].g.spec.shared_cores
        if shared is not None and s.pp > 1:
            pipe = shared_core_pipeline(pipe, t, B, s.tp * s.dp, *shared)
        tail = max(max(0.0, c.sync_s - drains[i] * B) + c.optim_s for i, c in enumerate(stages))
        ideal = B * sum(c.compute_s for c in stages) / s.pp  # perfectly balanced, no bubble
        terms = {
            "pipeline_compute_s": B * max(c.compute_s for c in stages),
            "bubble_s": max(0.0, pipe - B * max(t)),
            "idle_cores_reused_s": pipe - busy_pipe,
            "imbalance_s": B * max(c.compute_s for c in stages) - ideal,
            "boundary_sends_s": B * max(sends, default=0.0),
            "tp_comm_s": B * max((min(bounds[i + 1], L + 1) - max(bounds[i], 1)) * p.costs.tp_comm_block
                                 for i, p in enumerate(self.pricers)),
            "amsp_exposed_s": B * max(c.exposed_mb_s for c in stages)
                              + max(max(0.0, c.sync_s - drains[i] * B) for i, c in enumerate(stages)),
            "optimizer_s": max(c.optim_s for c in stages),
        }
        return pipe + tail, stages, terms


def shared_core_pipeline(pipe: float, t: list[float], B: int, stage_ranks: int, machine_ranks: int,
                         alone: float) -> float:
    """1F1B step seconds on machines whose ranks share cores (CPU). `t`: per-micro-batch seconds of
    each stage timed with every rank busy; a stage idle in the bubble gives its cores to the others on
    its machine. Two bounds, the larger holds: the pipeline's critical path at the lone-rank speed
    (pipe * alone), and each machine's total work spread over its ranks (the cores never idle while work
    is left). Only ranks of other stages can take a stage's cores: where every machine holds ranks of one
    stage alone (a machine per stage, as on the emulated mixed cluster), they idle and run together and
    nothing is handed over."""
    stage_of = [r // stage_ranks for r in range(len(t) * stage_ranks)]
    if all(len(set(stage_of[m:m + machine_ranks])) == 1 for m in range(0, len(stage_of), machine_ranks)):
        return pipe
    work = [B * t[i] for i in stage_of]  # per rank, all-busy seconds
    machines = [work[m:m + machine_ranks] for m in range(0, len(work), machine_ranks)]
    return max(pipe * alone, max(sum(w) / machine_ranks for w in machines))


def pipeline_refuses(pp: int, num_micro: int) -> bool:
    """Whether the 1F1B schedule a joint plan runs under refuses this many micro-batches per step (it needs
    at least pp; amsp/parallel/micro_batches.py); such a plan would stop at startup."""
    return micro_batch_problem("1f1b", num_micro, pp) is not None


def stage_group(s: Setting, groups: list[NodeGroup]) -> NodeGroup:
    """The node group a stage over `groups` is priced as: a stage across two kinds of node runs at the
    slower one's pace (its block's time per micro-batch: measured where the startup timed it, else FLOPs
    at its peak and efficiency; two kinds may share one preset and differ only in what they measured)
    within the smallest memory among them."""
    slow = max(groups, key=lambda g: (unit_costs(s, g).block, -g.spec.device_memory_bytes))
    memory = min(g.spec.device_memory_bytes for g in groups)
    if memory == slow.spec.device_memory_bytes:
        return slow
    return dataclasses.replace(slow, spec=dataclasses.replace(slow.spec, device_memory_bytes=memory))


def plan_joint(model: LlamaConfig, cluster: HeteroCluster, *, seq_len: int, global_batch: int,
               precision: Precision, efficiency: dict | None = None, micro_batch_sizes=(1, 2, 4, 8),
               tp_degrees: list[int] | None = None, top_k: int = 10, memory_margin: float | None = None,
               reserved_bytes: float = 2**30, overlap_slowdown: float | None = None,
               unit_times: dict | None = None, progress=None, overlap_spread: bool = False,
               spread_window: int = 2, optimizer_s_per_elem: dict | None = None,
               kernels: Kernels | None = None, sequence_parallel: bool = True,
               overlap_update: bool = False, optimizer_kernel: str = "auto", loss_parallel: bool = True,
               layout: tuple[int, int] | None = None) -> list[JointPlan]:
    """Ranked feasible joint plans (fastest first). InputError when nothing fits, naming what excluded the
    layouts. overlap_spread / spread_window: the engine's (amsp.overlap_spread, amsp.spread_window), for the
    memory model; kernels / sequence_parallel / optimizer_kernel / loss_parallel: what the run executes
    (Workload.kernels, parallel.sequence_parallel, amsp.optimizer_kernel, parallel.loss_parallel). layout:
    the one (tp, pp) to search (fixed_layout: amsp.planner.tp / pp), the rest still chosen. Layouts training
    refuses are never priced: pp > 1 with tied embeddings (configs/validate.py), stages that straddle a node
    part-way (amsp/parallel/mesh.py), fewer micro-batches than stages (amsp/parallel/micro_batches.py); the
    winner's notes say which were left out."""
    t0 = time.perf_counter()
    world, gpn = cluster.world, cluster.ranks_per_node
    eff = check_efficiency(efficiency or {}, cluster)
    plans, shortfall = [], None
    tps = tp_degrees or tp_candidates(model, gpn, seq_len, sequence_parallel, loss_parallel)
    left_out = _LeftOut()
    if model.tie_embeddings and not loss_parallel and tp_degrees is None:
        left_out.add("tied_loss", "tp > 1")
    if layout is not None:
        tps = [layout[0]]
        left_out.add("fixed", f"tp{layout[0]} pp{layout[1]}")
    combos = []
    for tp, pp in ((tp, pp) for tp in tps for pp in _divisors(world // tp)
                   if pp <= model.n_layers and (layout is None or pp == layout[1])):
        if pp > 1 and model.tie_embeddings:
            left_out.add("tied", f"tp{tp} pp{pp}")
        elif stage_layout_problem(world, gpn, tp, pp):
            left_out.add("uneven", f"tp{tp} pp{pp} ({world // pp} ranks a stage)")
        else:
            combos.append((tp, pp))
    for n, (tp, pp) in enumerate(combos):
        dp = world // (tp * pp)
        sizes = [m for m in micro_batch_sizes if global_batch % (dp * m) == 0]
        runnable = [m for m in sizes if not pipeline_refuses(pp, global_batch // (dp * m))]
        if not sizes:  # a layout is left out for its batch only when no micro-batch size of it runs
            left_out.add("batch", f"tp{tp} pp{pp} dp{dp}")
        elif not runnable:
            left_out.add("micro", f"tp{tp} pp{pp} dp{dp} (B={global_batch // (dp * min(sizes))})")
        for mbs in runnable:
            B = global_batch // (dp * mbs)
            s = Setting(model, seq_len, precision, tp, pp, dp, mbs, B, eff, memory_margin, reserved_bytes,
                        overlap_slowdown, unit_times or {}, overlap_spread, spread_window, optimizer_s_per_elem or {},
                        kernels, sequence_parallel, overlap_update, optimizer_kernel, loss_parallel)
            cand = _Candidate(s, cluster)
            bounds = cand.split()
            if bounds is None:
                need = cand.shortfall()
                shortfall = need if shortfall is None else min(shortfall, need)
            res = None if bounds is None else cand.evaluate(bounds)
            if res is None:
                left_out.add("memory", f"tp{tp} pp{pp} dp{dp} mbs{mbs}")
                if tp > 1 and not loss_parallel:
                    left_out.add("loss_memory", f"tp{tp} pp{pp} dp{dp} mbs{mbs}")
                continue
            step, stages, terms = res
            flops = 6 * model.num_params() * global_batch * seq_len + 12 * model.n_layers * model.dim * \
                seq_len * seq_len * global_batch  # attention included, as models/llama/flops.py counts it
            peak = sum(g.gpus * g.spec.peak_flops for g in cluster.groups)
            plans.append(JointPlan(
                tp, pp, dp, mbs, B,
                layer_split=stage_blocks(bounds, model.n_layers),
                recompute=[c.recompute for c in stages],
                stage_plans=[(c.degrees.p, c.degrees.g, c.degrees.os) for c in stages],
                stage_nodes=[p.g.name for p in cand.pricers], schedule="1f1b", step_s=step, terms=terms,
                stage_memory_gib=[c.memory_bytes / 2**30 for c in stages],
                stage_budget_gib=[p.budget / 2**30 for p in cand.pricers],
                mfu=flops / (step * peak)))
        if progress is not None and (n + 1) % 10 == 0:
            progress(f"joint planner: {n + 1}/{len(combos)} (tp, pp) pairs, {len(plans)} feasible plans, "
                     f"{time.perf_counter() - t0:.1f} s")
    if not plans:
        smallest = min((world // tp for tp, _ in combos), default=world) * min(micro_batch_sizes)
        raise InputError(f"no joint plan fits {cluster.describe()}: "
                         + left_out.why_none(global_batch, smallest, shortfall, reserved_bytes,
                                             min(g.spec.device_memory_bytes for g in cluster.groups)))
    plans.sort(key=lambda p: p.step_s)
    explain(plans)
    plans[0].notes = left_out.notes()
    return plans[:top_k]


class _LeftOut:
    """Which layouts the search excluded, and why, for the winner's notes and the nothing-fits message."""

    def __init__(self):
        self.keys: dict[str, list[str]] = {}

    def add(self, why: str, key: str) -> None:
        self.keys.setdefault(why, []).append(key)

    @staticmethod
    def _some(keys: list[str], n: int = 3) -> str:
        return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")

    def _reasons(self) -> dict[str, str]:
        k = self.keys
        out = {}
        if "tied" in k:
            out["tied"] = ("pp > 1 not considered: model.tie_embeddings=true keeps the embedding and the head, "
                           "which share one table, on one stage (training refuses pipelines then)")
        if "uneven" in k:
            out["uneven"] = (f"{self._some(k['uneven'], 12)} not considered: a stage that neither fits inside a node "
                             f"nor fills whole nodes has unequal data-parallel ranks per node, which training refuses")
        if "tied_loss" in k:
            out["tied_loss"] = ("tp > 1 not considered: model.tie_embeddings=true with parallel.loss_parallel=false "
                                "(training refuses a tied head whose logits would be gathered)")
        if "loss_memory" in k:
            out["loss_memory"] = (f"{self._some(k['loss_memory'])} did not fit with parallel.loss_parallel=false, "
                                  f"under which every TP rank holds the full-vocabulary logits, their log-softmax and "
                                  f"gradients (true keeps them vocabulary-sharded)")
        if "fixed" in k:
            out["fixed"] = (f"only {k['fixed'][0]} searched: fixed by {' / '.join(FIXED_LAYOUT_KEYS)} (the "
                            f"split, micro-batch size, recomputation and AMSP degrees chosen)")
        return out

    def notes(self) -> list[str]:
        return list(self._reasons().values())

    def why_none(self, global_batch: int, smallest: int, shortfall: float | None, reserved_bytes: float = 0.0,
                 device_bytes: float = math.inf) -> str:
        """What excluded every layout, most actionable first. reserved_bytes / device_bytes: the runtime's reserve
        (amsp.planner.reserved_gib) and the smallest GPU's memory: when the reserve alone fills the GPU, neither
        more GPUs nor a shorter sequence can help, and the reserve is what to name."""
        k, parts = self.keys, []
        if reserved_bytes >= device_bytes:
            parts.append(f"amsp.planner.reserved_gib={reserved_bytes / 2**30:g} GiB (kept for the runtime outside "
                         f"the allocator) is all of a GPU's {device_bytes / 2**30:g} GiB: lower "
                         f"amsp.planner.reserved_gib, or describe GPUs with more memory")
        elif shortfall is not None:
            parts.append(f"the most memory-saving layout still needs {shortfall / 2**30:.1f} GiB more per GPU on its "
                         f"tightest stage (add GPUs or shorten data.seq_len; amsp.planner.reserved_gib="
                         f"{reserved_bytes / 2**30:g} GiB of each GPU is kept for the runtime)")
        if "batch" in k or "micro" in k:
            what = []
            if "batch" in k:
                what.append(f"the global batch of {global_batch} samples does not split into whole micro-batches "
                            f"over the data-parallel ranks of {self._some(k['batch'])}")
            if "micro" in k:
                what.append(f"{self._some(k['micro'])} would get fewer micro-batches a step (B) than pipeline stages, "
                            f"and 1F1B needs at least one per stage")
            parts.append("; ".join(what) + f"; raise trainer.global_batch_size (a layout takes a multiple of its "
                                           f"dp x micro-batch size, with at least pp micro-batches: {smallest} "
                                           f"samples at the least on this cluster)")
        parts += self._reasons().values()
        if not parts:  # no (tp, pp) to try at all
            parts.append("no tensor-parallel degree divides the GPUs per node and the model's dimensions")
        return "; ".join(parts)


def check_efficiency(efficiency: dict, cluster: HeteroCluster) -> dict:
    """The per-node-group compute efficiency (fraction of peak), checked: every key names a node group of
    the cluster and every value is a finite number > 0 (one divides by it). A bad one is a one-line
    InputError naming the group, not a ZeroDivisionError inside the pricing."""
    names = [g.name for g in cluster.groups]
    unknown = sorted(set(efficiency) - set(names))
    if unknown:
        raise InputError(f"compute efficiency given for {', '.join(map(str, unknown))}, not a node group of "
                         f"cluster {cluster.name} (its groups: {', '.join(dict.fromkeys(names))})")
    for name, v in efficiency.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise InputError(f"compute efficiency of node group {name} is {v!r}: a fraction of peak > 0 is "
                             f"needed (amsp.planner.mfu, or the --efficiency file)")
    return efficiency


def _full(dp: int):
    from amsp.plan import Degrees

    return Degrees(dp, dp, dp)


_TERM_WORDS = {
    "pipeline_compute_s": "the slowest stage's compute", "bubble_s": "the pipeline bubble",
    "imbalance_s": "stage imbalance", "boundary_sends_s": "activation sends between stages",
    "tp_comm_s": "tensor-parallel collectives (within the stage compute)",
    "amsp_exposed_s": "exposed AMSP communication",
    "optimizer_s": "the optimizer step",
    "idle_cores_reused_s": "the cores idle pipeline stages hand to busy ones (CPU ranks sharing cores; <= 0)",
}


def explain(plans: list[JointPlan]) -> None:
    """Say, for the winner, which term dominates its step and which term the runner-up lost on."""
    best = plans[0]
    big = max((k for k in best.terms if k != "imbalance_s"), key=lambda k: best.terms[k])
    text = (f"{best.key()} wins at {best.step_s:.3f} s/step (predicted MFU {best.mfu:.1%}); its largest term is "
            f"{_TERM_WORDS[big]} ({best.terms[big]:.3f} s)")
    if best.tp > 1:
        text += f"; TP={best.tp} stays inside a node"
    if any(best.recompute):
        text += f"; recomputation on in stages {[i for i, r in enumerate(best.recompute) if r]} (memory)"
    if len(plans) > 1:
        nxt = plans[1]
        diff = max(nxt.terms, key=lambda k: nxt.terms[k] - best.terms.get(k, 0.0))
        text += (f". Runner-up {nxt.key()} ({nxt.step_s:.3f} s) loses {nxt.terms[diff] - best.terms[diff]:+.3f} s "
                 f"on {_TERM_WORDS[diff]}")
    best.decided_by = text
    for p in plans[1:]:
        d = max(p.terms, key=lambda k: p.terms[k] - best.terms.get(k, 0.0))
        p.decided_by = f"{p.step_s - best.step_s:+.3f} s vs the choice, mostly {_TERM_WORDS[d]}"


def format_joint(plans: list[JointPlan], cluster: HeteroCluster) -> str:
    lines = [cluster.describe(), "",
             f"{'rank':>4} {'tp':>3} {'pp':>3} {'dp':>5} {'mbs':>4} {'B':>4} {'step s':>9} {'MFU':>6}  "
             f"{'layers/stage':<24} {'AMSP p/g/os per stage':<28} recompute  tightest stage GiB (budget)"]
    for r, p in enumerate(plans, 1):
        split = ",".join(map(str, p.layer_split))
        degs = ",".join("/".join(map(str, d)) for d in p.stage_plans)
        rc = "".join("R" if x else "-" for x in p.recompute)
        tight = max(range(p.pp), key=lambda i: p.stage_memory_gib[i] / p.stage_budget_gib[i])
        mem = f"{p.stage_memory_gib[tight]:.1f} ({p.stage_budget_gib[tight]:.0f})"
        lines.append(f"{r:>4} {p.tp:>3} {p.pp:>3} {p.dp:>5} {p.micro_batch_size:>4} {p.num_micro:>4} "
                     f"{p.step_s:>9.3f} {p.mfu:>6.1%}  {_clip(split, 24):<24} {_clip(degs, 28):<28} "
                     f"{_clip(rc, 9):<9}  {mem}")
    lines += ["", "why: " + plans[0].decided_by]
    lines += [f"note: {n}" for n in plans[0].notes]
    if len(set(plans[0].stage_nodes)) > 1:
        lines.append("stages on: " + ", ".join(f"{i}:{n}({s})" for i, (n, s) in
                                              enumerate(zip(plans[0].stage_nodes, plans[0].layer_split))))
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def split_bounds(layer_split: list[int]) -> list[int]:
    """Unit boundaries of the stages (units: the embedding, then the blocks, then the head) for
    `layer_split` blocks per stage: the first stage starts with the embedding, the last ends with the head."""
    bounds, pos = [0], 1
    for n in layer_split:
        pos += n
        bounds.append(pos)
    bounds[-1] = sum(layer_split) + 2
    return bounds


def stage_blocks(bounds: list[int], n_layers: int) -> list[int]:
    """Blocks per stage of unit boundaries (split_bounds' inverse)."""
    return [min(bounds[i + 1], n_layers + 1) - max(bounds[i], 1) for i in range(len(bounds) - 1)]


def price_config(model: LlamaConfig, cluster: HeteroCluster, *, seq_len: int, global_batch: int,
                 precision: Precision, tp: int, pp: int, micro_batch_size: int, degrees,
                 recompute: bool = False, layer_split: list[int] | None = None, efficiency: dict | None = None,
                 memory_margin: float | None = None, reserved_bytes: float = 2**30,
                 overlap_slowdown: float | None = None, unit_times: dict | None = None,
                 overlap_spread: bool = False, spread_window: int = 2,
                 optimizer_s_per_elem: dict | None = None, kernels: Kernels | None = None,
                 sequence_parallel: bool = True, overlap_update: bool = False,
                 optimizer_kernel: str = "auto", loss_parallel: bool = True) -> tuple[float, dict] | None:
    """Predicted step seconds and terms of one named configuration (benchmarks compare it with a run),
    or None when it does not fit. layer_split: blocks per stage (None: the DP's split); the terms carry
    the split priced under "layer_split"."""
    if pp > 1 and model.tie_embeddings:
        raise InputError(f"pp={pp} with model.tie_embeddings=true: the embedding and the head share one table, "
                         f"which training keeps on one stage")
    dp = cluster.world // (tp * pp)
    B = global_batch // (dp * micro_batch_size)
    s = Setting(model, seq_len, precision, tp, pp, dp, micro_batch_size, B,
                check_efficiency(efficiency or {}, cluster), memory_margin,
                reserved_bytes, overlap_slowdown, unit_times or {}, overlap_spread, spread_window,
                optimizer_s_per_elem or {}, kernels, sequence_parallel, overlap_update, optimizer_kernel,
                loss_parallel)
    cand = _Candidate(s, cluster)
    if layer_split is None:
        bounds = cand.split()
        if bounds is None:
            return None
    else:
        bounds = split_bounds(layer_split)
    res = cand.evaluate(bounds, degrees, recompute)
    return None if res is None else (res[0], {**res[2], "layer_split": stage_blocks(bounds, model.n_layers)})
