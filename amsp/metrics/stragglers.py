"""Per-rank statistics gathered once per log interval, to make a slow rank visible.

One small all-gather of a few floats per rank, only at log steps, so it costs nothing measurable
and every rank must call it at the same steps (it is a collective).
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def gather_rank_values(values: list[float], device: torch.device) -> list[list[float]]:
    """[rank][i] = values[i] on that rank. One collective; a single process returns [values]."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def straggler_summary(step_times: list[float]) -> dict[str, float | int]:
    """Spread of per-rank mean step times and the slowest rank (ties: the lowest rank)."""
    if not step_times:
        raise ValueError("straggler_summary needs at least one rank's step time")
    median = statistics.median(step_times)
    slowest = max(range(len(step_times)), key=lambda r: (step_times[r], -r))
    return {
        "step_time_min_s": min(step_times),
        "step_time_median_s": median,
        "step_time_max_s": step_times[slowest],
        "step_time_spread_s": step_times[slowest] - min(step_times),
        "step_time_max_over_median": step_times[slowest] / median if median > 0 else float("nan"),
        "slowest_rank": slowest,
    }
