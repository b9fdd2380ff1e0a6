"""The partitioner: picks per-unit-group shard degrees (p/g/os) from a cost model solved as an ILP.

DESIGN.md §3. The engine never imports this package; train.py calls plan_for_run when amsp.plan=auto,
and `python -m amsp.planner` prints the same table on any machine.
"""

from .report import NoFeasiblePlan
from .startup import PlanOutcome, plan_for_run

__all__ = ["NoFeasiblePlan", "PlanOutcome", "plan_for_run"]
