"""Reference solver: every (blocks, embed_head) pair of degree triples, scored by the same terms.

Vectorised with numpy over the candidate grid (680 x 680 pairs at 16384 ranks of 8 per node), it is
the yardstick for the ILP in the tests and the source of the ranked table of alternatives.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from amsp.plan import Plan

from .memory_events import event_bytes
from .terms import GroupTerms


@dataclass(frozen=True)
class Choice:
    plan: Plan
    step_time_s: float  # the objective: constant + both groups' exposed seconds
    memory_bytes: float  # model states + gathered pair + gradient buckets + spread window + constants (no margin)


def grid(t: GroupTerms) -> tuple[np.ndarray, np.ndarray]:
    """(step time, memory) over [blocks candidate, embed_head candidate]."""
    time = t.constant_s + t.exposed_s[0][:, None] + t.exposed_s[1][None, :]
    gathered = _peak_pair(t, t.gathered)
    buckets = t.bucket_floor
    for roles, filler, offset in t.bucket_events:
        held = event_bytes(roles, filler, offset, lambda r, table: _role_axis(t, r, table), t.buckets, t.fills,
                           t.inflight)
        buckets = np.maximum(buckets, held)
    spread = None
    for role in t.spread:
        term = _role_axis(t, role, t.spread)
        spread = term if spread is None else np.maximum(spread, term)
    # the larger phase: forward/backward transients, or the optimizer step's OS-shard gradients, or the
    # spread that follows the update (which freed them)
    # gloo's copies of neighbouring units whose G->OS syncs are in flight
    step = t.sync_bytes[0][:, None] + t.sync_bytes[1][None, :] + _peak_pair(t, t.sync_copy)
    spread = t.spread_window * spread  # in the phase where the spread is in flight
    fb = t.constant_bytes + gathered + buckets + (spread if t.spread_in_forward else 0)
    memory = t.state_bytes[0][:, None] + t.state_bytes[1][None, :] + np.maximum(
        fb, np.maximum(step, 0 if t.spread_in_forward else spread))
    return time, memory


def _peak_pair(t: GroupTerms, per_role: dict) -> np.ndarray:
    """Over [blocks candidate, embed_head candidate]: the largest sum of a per-unit table over the pairs of
    neighbouring units (CostModel.peak_pair). A pair within one group is a column or a row: those are
    maximised as vectors before anything is broadcast, and the grid is built once (stacking every pair's
    broadcast grid cost 0.3 s a call at 1920 x 1920 candidates)."""
    column = row = grid = None
    for pair in t.pairs:
        term = sum(_role_axis(t, r, per_role) for r in pair)
        if term.shape[1] == 1:
            column = term if column is None else np.maximum(column, term)
        elif term.shape[0] == 1:
            row = term if row is None else np.maximum(row, term)
        else:
            grid = term if grid is None else np.maximum(grid, term, out=grid)
    parts = [x for x in (column, row) if x is not None]
    out = np.maximum(*parts) if len(parts) == 2 else parts[0] if parts else None
    if grid is None:
        return out
    return grid if out is None else np.maximum(grid, out, out=grid)


def _role_axis(t: GroupTerms, role: str, per_role: dict | None = None) -> np.ndarray:
    v = (t.gathered if per_role is None else per_role)[role]
    return v[:, None] if t.role_group[role] == 0 else v[None, :]


def _plan(t: GroupTerms, i: int, j: int, name: str = "auto") -> Plan:
    return Plan(blocks=t.candidates[i], embed_head=t.candidates[j], name=name)


def ranked(t: GroupTerms, k: int) -> list[Choice]:
    """The k best plans that fit, fastest first; ties broken by less memory, then smaller degrees."""
    time, memory = grid(t)
    states = t.state_bytes[0][:, None] + t.state_bytes[1][None, :]
    fits = (memory <= t.budget_bytes) & (states <= t.state_budget_bytes)
    n_fit = int(np.count_nonzero(fits))
    if n_fit == 0 or k <= 0:
        return []
    # Sorting every fitting pair (3.7 M at 1920 candidates a group) for k of them cost a second: keep the
    # pairs no slower than the k-th fastest (all of its ties, so the tie-breaks below stay exact).
    timed = np.where(fits, time, np.inf).ravel()
    kth = np.partition(timed, min(k, n_fit) - 1)[min(k, n_fit) - 1]
    i, j = np.nonzero(fits & (time <= kth))
    order = np.lexsort((j, i, memory[i, j], time[i, j]))[:k]
    return [Choice(_plan(t, a, b), float(time[a, b]), float(memory[a, b]))
            for a, b in zip(i[order], j[order])]


def best(t: GroupTerms) -> Choice | None:
    r = ranked(t, 1)
    return r[0] if r else None


def smallest_memory(t: GroupTerms) -> Choice:
    time, memory = grid(t)
    i, j = np.unravel_index(np.argmin(memory), memory.shape)
    return Choice(_plan(t, int(i), int(j), "min-mem"), float(time[i, j]), float(memory[i, j]))
