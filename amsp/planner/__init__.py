"""The partitioner: picks per-unit-group shard degrees (p/g/os) from a cost model solved as an ILP.

DESIGN.md §3. The engine never imports this package; train.py calls plan_for_run when amsp.plan=auto,
and `python -m amsp.planner` prints the same table on any machine.
"""

from .report import NoFeasiblePlan


def __getattr__(name):
    # plan_for_run needs torch (the probe); the CLI and the cost model do not, so it loads on first use
    if name in ("PlanOutcome", "plan_for_run"):
        from . import startup

        return getattr(startup, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["NoFeasiblePlan", "PlanOutcome", "plan_for_run"]
