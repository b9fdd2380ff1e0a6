"""Per-rank statistics gathered once per log interval, to make a slow rank visible.

One small all-gather of a few floats per rank, only at log steps, so it costs nothing measurable
and every rank must call it at the same steps (it is a collective).
"""
from __future__ import annotations

import statistics

from amsp import control


def gather_rank_values(values: list[float]) -> list[list[float]]:
    """[rank][i] = values[i] on that rank. One control-plane collective (CPU values, never the
    device's backend); a single process returns [values]."""
    return control.all_gather_floats(values)


def straggler_summary(busy_times: list[float]) -> dict[str, float | int]:
    """Spread of per-rank mean busy times and the slowest rank (ties: the lowest rank).

    Busy time is what a rank does on its own (its timed phases minus the exposed collective wait
    the engine reports). Wall step times hide a straggler: synchronous collectives
    make every rank wait for the slowest one, so all ranks show the same step time."""
    if not busy_times:
        raise ValueError("straggler_summary needs at least one rank's busy time")
    median = statistics.median(busy_times)
    slowest = max(range(len(busy_times)), key=lambda r: (busy_times[r], -r))
    return {
        "rank_busy_min_s": min(busy_times),
        "rank_busy_median_s": median,
        "rank_busy_max_s": busy_times[slowest],
        "rank_busy_spread_s": busy_times[slowest] - min(busy_times),
        "rank_busy_max_over_median": busy_times[slowest] / median if median > 0 else float("nan"),
        "slowest_rank": slowest,
    }
