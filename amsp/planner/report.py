"""A plan's predicted cost, the ranked table of alternatives, wandb rows, and the no-fit error."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from amsp.plan import Plan

GIB = 2**30
MEMORY_PARTS = ("params", "grads", "optim", "grad_sync", "activations", "gathered", "spread", "buckets", "reserved")
COMM_PHASES = ("forward", "backward", "grad", "grad_to_os", "grad_replica", "spread", "grad_norm")


@dataclass
class PlanCost:
    plan: Plan
    compute_s: float
    exposed_s: dict  # phase -> exposed seconds per step
    memory: dict  # part -> bytes per rank (MEMORY_PARTS; reserved includes the safety margin)
    collectives: list  # cost_model.Priced
    device_memory: int
    tokens_per_step_per_rank: int
    model_flops_per_rank: float
    peak_flops: float
    ranks_per_replica: int = 1  # tp * pp GPUs share one data-parallel rank's tokens
    state_budget: float | None = None  # Options.state_budget_bytes: a cap on params + grads + optim

    @property
    def step_time_s(self) -> float:
        return self.compute_s + sum(self.exposed_s.values())

    @property
    def exposed_total_s(self) -> float:
        return sum(self.exposed_s.values())

    @property
    def exposed_comm_s(self) -> float:
        """Exposed seconds caused by communication (the optimizer step is memory-bound compute)."""
        return sum(s for ph, s in self.exposed_s.items() if ph != "optimizer")

    @property
    def optimizer_s(self) -> float:
        """The optimizer step's share of the step (not communication: exposed_comm_s leaves it out)."""
        return self.exposed_s.get("optimizer", 0.0)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def model_state_bytes(self) -> float:
        return self.memory["params"] + self.memory["grads"] + self.memory["optim"]

    @property
    def within_state_budget(self) -> bool:
        return self.state_budget is None or self.model_state_bytes <= self.state_budget

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.device_memory and self.within_state_budget

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step_per_rank / self.ranks_per_replica / self.step_time_s

    @property
    def mfu(self) -> float:
        return self.model_flops_per_rank / self.step_time_s / self.peak_flops

    def comm_bytes(self) -> dict:
        """Bytes per rank per step by phase (amsp.schedule's convention)."""
        out: dict = defaultdict(int)
        for x in self.collectives:
            out[x.phase] += x.bytes * x.count
        return dict(out)

    def comm_seconds(self) -> dict:
        """Unhidden communication seconds per step by phase (before overlap)."""
        out: dict = defaultdict(float)
        for x in self.collectives:
            out[x.phase] += x.seconds * x.count
        return dict(out)

    def inter_node_bytes(self) -> int:
        return sum(x.bytes * x.count for x in self.collectives if x.crosses_nodes)


# What each exposed-time phase of cost_model.unit_exposure is, for the "why" of a plan.
_PHASES_OF = {"forward": ("forward", "spread"), "backward": ("backward", "grad", "grad_to_os", "grad_replica"),
              "spread": ("spread",), "grad_norm": ("grad_norm",)}
_NAMES = {"forward": "fwd gather (+spread)", "backward": "bwd gather+reduce", "spread": "param spread",
          "grad_norm": "grad-norm all_reduce", "contention": "overlap slowdown", "optimizer": "optimizer step"}


def why(c: PlanCost) -> str:
    """The term that decides the plan's time beyond compute, compactly: 'inter-node bwd gather+reduce
    exposed 0.267 s (16%)', 'overlap slowdown (inter-node comm hidden) 0.08 s (5%)', or memory when
    the plan does not fit."""
    if not c.within_state_budget:
        return f"model states {c.model_state_bytes / GIB:.3g} > budget {c.state_budget / GIB:.3g} GiB"
    if not c.fits:
        return f"memory {c.memory_total / GIB:.1f} > {c.device_memory / GIB:.0f} GiB"
    terms = {ph: sec for ph, sec in c.exposed_s.items() if sec > 0}
    if not terms:
        return "compute only"
    ph, sec = max(terms.items(), key=lambda kv: kv[1])
    share = f"{sec:.3g} s ({sec / c.step_time_s:.0%})"
    if ph == "contention":  # compute slowed by the communication it hides
        scope = "inter-node" if any(x.crosses_nodes for x in c.collectives) else "intra-node"
        return f"{_NAMES[ph]} ({scope} comm hidden) {share}"
    if ph in _PHASES_OF:
        scope = "inter-node" if any(x.crosses_nodes for x in c.collectives if x.phase in _PHASES_OF[ph]) else "intra-node"
        return f"{scope} {_NAMES[ph]} exposed {share}"
    return f"{_NAMES.get(ph, ph)} {share}"


def plan_label(plan: Plan) -> str:
    if plan.blocks == plan.embed_head:
        return str(plan.blocks)
    return f"{plan.blocks} | {plan.embed_head}"


COLUMNS = ["rank", "plan", "name", "blocks_p", "blocks_g", "blocks_os", "eh_p", "eh_g", "eh_os",
           "mem_params_gib", "mem_grads_gib", "mem_optim_gib", "mem_act_gib", "mem_buffers_gib", "mem_reserve_gib",
           "mem_total_gib",
           "comm_gather_gb", "comm_rs_gb", "comm_grad_to_os_gb", "comm_replica_gb", "comm_spread_gb",
           "comm_inter_node_gb", "comm_time_s", "exposed_s", "optimizer_s", "step_time_s", "tokens_per_s_per_gpu",
           "mfu"]


_MEMORY_COLUMNS = COLUMNS[COLUMNS.index("mem_params_gib"):COLUMNS.index("mem_total_gib") + 1]
_COMM_COLUMNS = COLUMNS[COLUMNS.index("comm_gather_gb"):COLUMNS.index("comm_inter_node_gb") + 1]


def row(rank: int, c: PlanCost) -> list:
    b, e, m, cb = c.plan.blocks, c.plan.embed_head, c.memory, c.comm_bytes()
    g = lambda k: cb.get(k, 0) / 1e9  # noqa: E731
    return [rank, plan_label(c.plan), c.plan.name, b.p, b.g, b.os, e.p, e.g, e.os,
            m["params"] / GIB, m["grads"] / GIB, m["optim"] / GIB, m["activations"] / GIB,
            # transients, net of the optimizer step's reuse of freed activations (step_reuse <= 0), so the
            # memory columns add up to the total
            (m["gathered"] + m["spread"] + m["buckets"] + m["grad_sync"] + m["step_reuse"]) / GIB,
            m["reserved"] / GIB, c.memory_total / GIB,
            g("forward") + g("backward"), g("grad"), g("grad_to_os"), g("grad_replica"), g("spread"),
            # exposed_s: what communication costs the step (its waits and the slowdown of the compute it
            # hides); the optimizer step is memory-bound compute, a column of its own
            c.inter_node_bytes() / 1e9, sum(c.comm_seconds().values()), c.exposed_comm_s,
            c.optimizer_s, c.step_time_s,
            c.tokens_per_s_per_gpu, c.mfu]


def wandb_rows(costs: list[PlanCost]) -> tuple[list[str], list[list]]:
    """(columns, rows) for WandbLogger.log_table: rank 1 is the chosen plan."""
    return list(COLUMNS), [row(i + 1, c) for i, c in enumerate(costs)]


def format_table(costs: list[PlanCost], header: str = "") -> str:
    """Fixed-width text: memory per rank by part, communication per rank per step by collective,
    exposed communication and predicted step time. GiB/GB, or MiB/MB for models too small for them."""
    small = max(c.memory_total - c.memory["reserved"] for c in costs) < 2**30
    mu, mdiv, cu, cdiv = ("MiB", 2**20, "MB", 1e6) if small else ("GiB", GIB, "GB", 1e9)
    head = (f"{'#':>3} {'plan p/g/os (blocks | emb+head)':<34} {'name':<8}"
            f"{'P':>7} {'G':>7} {'OS':>7} {'act':>7} {'buf':>7} {'resv':>7} {'total':>8} |"
            f"{'AG':>8} {'RS':>8} {'g->os':>7} {'repl':>7} {'spread':>7} {'inter':>8} |"
            f"{'comm s':>8} {'exposed':>8} {'opt s':>8} {'step s':>8} {'tok/s/gpu':>10} {'MFU':>6}  why")
    unit = (f"{'':>3} {'':<34} {'':<8}{f'memory per rank, {mu}':^58}|"
            f"{f'communication per rank per step, {cu}':^51}|{'predicted':^53}")
    lines = ([header] if header else []) + [unit, head, "-" * len(head)]
    for i, c in enumerate(costs):
        r = dict(zip(COLUMNS, row(i + 1, c)))
        mem = [r[k] * GIB / mdiv for k in _MEMORY_COLUMNS]
        com = [r[k] * 1e9 / cdiv for k in _COMM_COLUMNS]
        lines.append(f"{r['rank']:>3} {r['plan']:<34} {r['name']:<8}"
                     + " ".join(f"{v:7.2f}" for v in mem[:-1]) + f" {mem[-1]:8.2f} |"
                     + f"{com[0]:8.2f} {com[1]:8.2f} {com[2]:7.2f} {com[3]:7.2f} {com[4]:7.2f} {com[5]:8.2f} |"
                     + f"{r['comm_time_s']:8.3f} {r['exposed_s']:8.3f} {r['optimizer_s']:8.3f} "
                     + f"{r['step_time_s']:8.3f} {r['tokens_per_s_per_gpu']:10.0f} {r['mfu']:6.1%}  {why(c)}")
    return "\n".join(lines)


# Where a NoFeasiblePlan is reported decides the keys its hints name: a training run (train.py's startup)
# sets parallel.tp / pp and its world comes from the launcher; the planner CLI prices cluster.nodes and
# amsp.planner.tp / pp as what-ifs. A raiser that does not say (solve.plan_cluster) names both.
_MORE_RANKS = {"train": "more GPUs (a larger launch: larger shard degrees)",
               "cli": "more nodes (cluster.nodes: larger shard degrees)",
               None: "more nodes (larger shard degrees)"}
_MODEL_PARALLEL = {"train": "tensor / pipeline parallelism (parallel.tp / parallel.pp, or parallel.auto=true)",
                   "cli": "tensor / pipeline parallelism (parallel.tp / parallel.pp; --joint searches them)",
                   None: "tensor / pipeline parallelism (parallel.tp / parallel.pp in a training run, "
                         "amsp.planner.tp / pp as the planner CLI's what-if)"}


class NoFeasiblePlan(RuntimeError):
    """No plan fits in device memory; the message names the smallest-memory plan, the excess and what
    could close it: the hints follow the part that is over (model states or activations) and name the
    keys of `context` ("train": train.py, "cli": python -m amsp.planner; in_context sets it).
    reserved_bytes: the fixed runtime reserve (Options.reserved_bytes, amsp.planner.reserved_gib) inside the
    plan's `reserved` part, which also holds the allocator margin; None: unknown, not judged."""

    def __init__(self, smallest: PlanCost, recompute: str, micro_batch_size: int, context: str | None = None,
                 reserved_bytes: float | None = None):
        self.smallest, self.recompute, self.micro_batch_size = smallest, recompute, micro_batch_size
        self.reserved_bytes = reserved_bytes
        if smallest.memory_total <= smallest.device_memory and not smallest.within_state_budget:
            self.excess_bytes = smallest.model_state_bytes - smallest.state_budget
        else:
            self.excess_bytes = smallest.memory_total - smallest.device_memory
        self.in_context(context)

    def in_context(self, context: str | None) -> "NoFeasiblePlan":
        """This error with its hints naming `context`'s keys (the message is its args[0])."""
        if context not in _MORE_RANKS:
            raise ValueError(f"NoFeasiblePlan context {context!r}: expected 'train', 'cli' or None")
        self.context = context
        self.args = (self._message(context),)
        return self

    def _message(self, context: str | None) -> str:
        smallest, recompute, mbs = self.smallest, self.recompute, self.micro_batch_size
        more, model_parallel = _MORE_RANKS[context], _MODEL_PARALLEL[context]
        if smallest.memory_total <= smallest.device_memory and not smallest.within_state_budget:
            # the device would hold it: the model-state cap is what binds
            return (f"no sharding plan keeps model states within amsp.planner.state_budget_gib = "
                    f"{smallest.state_budget / GIB:.3g} GiB per rank: the smallest-memory plan "
                    f"{plan_label(smallest.plan)} holds {smallest.model_state_bytes / GIB:.3g} GiB of params, "
                    f"grads and optimizer states. Raise or unset the budget, or use {more}")
        over = self.excess_bytes
        m = smallest.memory
        parts = ", ".join(f"{k} {m[k] / GIB:.2f}" for k in MEMORY_PARTS)
        states, act = smallest.model_state_bytes, m["activations"]
        reserve = self.reserved_bytes
        if reserve is not None and reserve >= smallest.device_memory:
            # the runtime reserve alone fills the device: no sharding, recomputation or model parallelism can
            # make room, so they are not offered; the key that sets the reserve is
            return (f"no sharding plan fits in {smallest.device_memory / GIB:.2f} GiB per device: the runtime "
                    f"reserve amsp.planner.reserved_gib={reserve / GIB:.3g} GiB (CUDA context, kernels, workspaces) "
                    f"is itself {'more than' if reserve > smallest.device_memory else 'all of'} the device's "
                    f"memory, before any tensor ({parts} GiB). Try: a smaller amsp.planner.reserved_gib, or a "
                    f"device with more memory" + (" (cluster.device_memory_gib)" if context == "cli" else ""))
        # Model states shrink only by sharding them over more ranks or by model parallelism; shrinking the
        # activations (recomputation, micro-batch, sequence) is offered when it could close the excess or
        # they are the larger part (a 7B model's 2.5 of 112 GiB is neither). The larger part's hints first.
        act_hints = []
        if recompute != "full":
            act_hints.append("more activation recomputation (model.activation_checkpointing="
                             + ("selective or full)" if recompute == "none" else "full)"))
        if mbs > 1:
            act_hints.append(f"a smaller micro-batch (trainer.micro_batch_size < {mbs})")
        act_hints.append("a shorter sequence (data.seq_len)")
        state_hints = [more, model_parallel]
        if act < over and act < states:
            hints = state_hints
            why = (f"model states (params + grads + optim) are {states / GIB:.2f} GiB and activations only "
                   f"{act / GIB:.2f}, less than the excess, so recomputation, a smaller micro-batch or a shorter "
                   f"sequence cannot make it fit. Try: ")
        else:
            hints = act_hints + state_hints if act >= states else state_hints + act_hints
            why = "Try: "
        return (f"no sharding plan fits in {smallest.device_memory / GIB:.1f} GiB per device: the smallest-memory "
                f"plan {plan_label(smallest.plan)} needs {smallest.memory_total / GIB:.2f} GiB per rank, "
                f"{over / GIB:.2f} GiB over ({parts} GiB); {why}" + "; ".join(hints))


# ---- machine-readable output (python -m amsp.planner --json) -------------------------------------

def degrees_json(d) -> dict:
    return {"p": d.p, "g": d.g, "os": d.os}


def plan_cost_json(c: PlanCost) -> dict:
    """Every term of one priced plan: per-unit-group degrees, exposed seconds by phase, memory parts
    (bytes per rank), the priced collectives, fit and MFU."""
    return {
        "plan": plan_label(c.plan), "name": c.plan.name,
        "degrees": {"blocks": degrees_json(c.plan.blocks), "embed_head": degrees_json(c.plan.embed_head)},
        "step_time_s": c.step_time_s, "compute_s": c.compute_s, "exposed_s": dict(c.exposed_s),
        "exposed_total_s": c.exposed_total_s, "exposed_comm_s": c.exposed_comm_s,
        "comm_seconds_by_phase": c.comm_seconds(),
        "comm_bytes_by_phase": c.comm_bytes(), "inter_node_bytes": c.inter_node_bytes(),
        "memory_bytes": dict(c.memory), "memory_total_bytes": c.memory_total, "device_memory_bytes": c.device_memory,
        "model_state_bytes": c.model_state_bytes, "state_budget_bytes": c.state_budget,
        "fits": c.fits, "tokens_per_s_per_gpu": c.tokens_per_s_per_gpu, "mfu": c.mfu,
        "collectives": [{"phase": x.phase, "kind": x.kind, "unit": x.unit, "group_size": x.group_size,
                         "members_per_node": x.members_per_node, "nodes": x.nodes, "bytes": x.bytes,
                         "count": x.count, "seconds": x.seconds} for x in c.collectives],
    }


def cluster_json(cluster) -> dict:
    """The cluster figures the plans were priced with (curves: per-rank chunk bytes -> bus GB/s)."""
    return {"name": cluster.name, "nodes": cluster.nodes, "ranks_per_node": cluster.ranks_per_node,
            "device_memory_bytes": cluster.device_memory_bytes, "peak_flops": cluster.peak_flops,
            "memory_bandwidth_gbs": cluster.memory_bandwidth_gbs, "dtype": cluster.dtype,
            "bandwidth_source": cluster.source, "overlap_slowdown": cluster.overlap_slowdown,
            "curves": {f"{kind}|{scope}": [[s, b] for s, b in curve.points]
                       for (kind, scope), curve in sorted(cluster.curves.items())},
            "alpha_beta": {scope: {"latency_s": ab.latency_s, "gbps": ab.gbps}
                           for scope, ab in sorted(cluster.fallback.items())}}
