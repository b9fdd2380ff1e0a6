"""The integer program (PuLP + CBC): pick one degree triple per unit group.

Variables: x[g, c] binary, one per unit group g (blocks, embed_head) and valid triple c
(amsp.plan.enumerate_degrees is the pre-filter for the ordering, divisibility and fill-a-node rules),
with sum_c x[g, c] = 1; a continuous z >= the bytes of every pair of simultaneously gathered units
(current + prefetched next), which linearises that max exactly, a continuous u >= every bucket event
(a unit's gradient bucket filling, its gradient in copy, the next unit's bucket in flight with what
its reduce-scatter holds beyond it; the
embedding's pair less its offset: it arrives after the activations are gone) and >= the loss
backward's transient (bucket_floor), and a continuous y >=
every role's in-flight spread bytes (the largest unit's spread, times the window W), and a continuous
c >= every pair of neighbouring units' copies held by gloo while their G->OS reduce-scatters are in
flight (memory_events.sync_copy_bytes; 0 on CUDA).
Memory (every rank holds the same shards), the peak of the phases, each within the budget:
    forward/backward: sum_{g,c} x[g,c] * state_bytes[g,c] + z + u + activations [+ W * y] <= budget
    optimizer step:   sum_{g,c} x[g,c] * (state_bytes[g,c] + sync_bytes[g,c]) + c <= budget
    spread:           sum_{g,c} x[g,c] * state_bytes[g,c] + W * y <= budget
and, when a model-state budget is given (Options.state_budget_bytes), sum x * state_bytes <= it.
with the spread window W * y in the forward/backward phase when the spread overlaps the next
forward, else in a phase of its own after the update (which freed the OS-shard gradients).
Objective: the cost model's step time, constant + sum_{g,c} x[g,c] * exposed_s[g,c]. The cost model
makes exposure a sum of per-unit terms on fixed compute windows (cost_model.py), so this linear
objective IS the predicted step time and the exhaustive search optimises the same function.
Seconds are scaled to milliseconds and bytes to GiB so that CBC's tolerances sit far below any
difference that matters.
"""
from __future__ import annotations

import logging
import time
import warnings

import pulp

from amsp.plan import Plan, UNIT_GROUPS

from .memory_events import event_bytes
from .exhaustive import Choice
from .terms import GroupTerms

log = logging.getLogger(__name__)
GIB = 2**30


class SolverError(RuntimeError):
    pass


def solve(t: GroupTerms, time_limit_s: float = 20.0) -> tuple[Choice | None, float]:
    """(optimal choice or None when nothing fits, solve seconds)."""
    t0 = time.perf_counter()
    prob = pulp.LpProblem("amsp_plan", pulp.LpMinimize)
    budget = (t.budget_bytes - t.constant_bytes) / GIB
    state_budget = t.state_budget_bytes / GIB
    x = {}
    for gi, group in enumerate(UNIT_GROUPS):
        # Candidates whose own model states already overflow cannot be part of any feasible plan.
        keep = [ci for ci in range(len(t.candidates))
                if t.state_bytes[gi, ci] / GIB <= min(budget, state_budget)]
        if not keep:
            return None, time.perf_counter() - t0
        for ci in keep:
            x[gi, ci] = prob.add_variable(f"x_{group}_{ci}", cat=pulp.LpBinary)
        prob += pulp.lpSum(x[gi, ci] for ci in keep) == 1, f"one_{group}"
    z = prob.add_variable("gathered_gib", lowBound=0)

    y = prob.add_variable("spread_unit_gib", lowBound=0)
    u = prob.add_variable("grad_buckets_gib", lowBound=t.bucket_floor / GIB)
    c = prob.add_variable("sync_copies_gib", lowBound=0)

    def linear(coef):  # sum of x[k] * coef(k), built as one expression: x[k] * c made one object a term
        return pulp.LpAffineExpression([(var, float(coef(k))) for k, var in x.items()])

    def role_expr(role, per_role):
        gi, table = t.role_group[role], per_role[role]
        return pulp.LpAffineExpression([(var, float(table[ci]) / GIB) for (g, ci), var in x.items() if g == gi])

    for n, pair in enumerate(t.pairs):
        prob += z >= pulp.lpSum(role_expr(r, t.gathered) for r in pair), f"gathered_set_{n}"
        prob += c >= pulp.lpSum(role_expr(r, t.sync_copy) for r in pair), f"sync_copies_{n}"
    for n, (roles, filler, offset) in enumerate(t.bucket_events):
        prob += u >= event_bytes(roles, filler, offset / GIB, role_expr, t.buckets, t.fills, t.inflight), \
            f"grad_buckets_{n}"
    for role in t.spread:
        prob += y >= role_expr(role, t.spread), f"spread_{role}"
    fwd_spread, step_spread = (t.spread_window * y, 0) if t.spread_in_forward else (0, t.spread_window * y)
    states = linear(lambda k: t.state_bytes[k] / GIB)
    prob += states + z + u + fwd_spread <= budget, "memory_per_rank"
    # the step phase: the OS-shard gradients, then (spread after the update) the spread that follows
    prob += linear(lambda k: (t.state_bytes[k] + t.sync_bytes[k]) / GIB) + c <= t.budget_bytes / GIB, "memory_at_step"
    if not t.spread_in_forward:
        prob += states + step_spread <= t.budget_bytes / GIB, "memory_at_spread"
    if state_budget < float("inf"):
        prob += states <= state_budget, "model_state_budget"
    prob += linear(lambda k: t.exposed_s[k] * 1e3)
    with warnings.catch_warnings():
        # PuLP 3.3 deprecates PULP_CBC_CMD in favour of a separately installed CBC (pulp[cbc]); the
        # bundled binary is what ships with the pinned PuLP, so keep it and keep the log clean.
        warnings.filterwarnings("ignore", message=".*PULP_CBC_CMD is deprecated", category=DeprecationWarning)
        status = prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0))
    elapsed = time.perf_counter() - t0
    name = pulp.LpStatus[status]
    if name == "Infeasible":
        return None, elapsed
    if name != "Optimal":
        raise SolverError(f"CBC returned status {name!r} after {elapsed:.1f}s (time limit {time_limit_s}s); "
                          f"raise amsp.planner.time_limit_s")
    chosen = {}
    for (gi, ci), var in x.items():
        if var.value() is not None and var.value() > 0.5:
            chosen[gi] = ci
    if len(chosen) != len(UNIT_GROUPS):
        raise SolverError(f"CBC reported Optimal but selected {len(chosen)} of {len(UNIT_GROUPS)} groups")
    i, j = chosen[0], chosen[1]
    step = t.constant_s + t.exposed_s[0, i] + t.exposed_s[1, j]

    def at(role, per_role):
        return per_role[role][chosen[t.role_group[role]]]

    def peak_pair(per_role):  # the largest neighbouring pair of the chosen units (CostModel.peak_pair)
        return max(sum(at(r, per_role) for r in pair) for pair in t.pairs)

    gathered = peak_pair(t.gathered)

    buckets = max([t.bucket_floor] + [event_bytes(roles, filler, offset, at, t.buckets, t.fills, t.inflight)
                                      for roles, filler, offset in t.bucket_events])
    spread = t.spread_window * max(t.spread[r][chosen[t.role_group[r]]] for r in t.spread)
    fwd_spread, step_spread = (spread, 0) if t.spread_in_forward else (0, spread)
    copies = peak_pair(t.sync_copy)
    memory = (t.state_bytes[0, i] + t.state_bytes[1, j]
              + max(t.constant_bytes + gathered + buckets + fwd_spread,
                    t.sync_bytes[0, i] + t.sync_bytes[1, j] + copies, step_spread))
    plan = Plan(blocks=t.candidates[i], embed_head=t.candidates[j], name="auto")
    return Choice(plan, float(step), float(memory)), elapsed
