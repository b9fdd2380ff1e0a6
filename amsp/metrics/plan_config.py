"""The sharding plan a run trains with, as wandb run config and a wandb table.

The config entry `chosen_plan` lets runs be filtered and grouped by plan in the wandb UI: how it was
chosen, its p/g/os degrees per unit group and, when the partitioner chose it (amsp.plan=auto), what
it predicted (step time, memory per rank, throughput, MFU) and which cluster figures it used (the
preset's, or the bandwidth probe's). The partitioner's ranked alternatives go to the table
`planner/plans` (columns: amsp/planner/report.py), rank 1 being the chosen plan. When the re-planner
switches plans mid-run (amsp/replan_switch.py), `chosen_plan` is replaced by the plan trained from then
on, with the step, the reason and the plan it replaced.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from amsp.plan import UNIT_GROUPS, Plan

if TYPE_CHECKING:
    from amsp.planner.startup import PlanOutcome

    from .wandb_logger import WandbLogger

PLANS_TABLE = "planner/plans"
# Chosen-plan columns of the planner's table copied into the config (name in the config: column).
PREDICTED = {"step_time_s": "step_time_s", "memory_gib_per_rank": "mem_total_gib",
             "tokens_per_s_per_gpu": "tokens_per_s_per_gpu", "mfu": "mfu", "exposed_comm_s": "exposed_s",
             "optimizer_s": "optimizer_s"}


def plan_summary(plan: Plan, setting: str, planned: PlanOutcome | None = None) -> dict[str, Any]:
    """The `chosen_plan` config entry. setting: amsp.plan as configured (auto, zero3, custom...)."""
    out: dict[str, Any] = {
        "name": plan.name, "label": str(plan), "amsp_plan": setting,
        "chosen_by": "planner" if planned is not None else "config",
        **{group: vars(plan.for_group(group)).copy() for group in UNIT_GROUPS},
    }
    if planned is None:
        return out
    cols, rows = list(planned.columns), planned.rows
    if not rows or rows[0][cols.index("rank")] != 1:
        raise ValueError(f"the planner's table does not start with the chosen plan (rank 1): {rows[:1]}")
    chosen = dict(zip(cols, rows[0]))
    if (chosen["blocks_p"], chosen["blocks_g"], chosen["blocks_os"]) != tuple(out["blocks"].values()):
        raise ValueError(f"the planner's rank-1 row ({chosen['plan']}) is not the plan the run uses ({plan})")
    out["predicted"] = {name: chosen[col] for name, col in PREDICTED.items()}
    out["cluster"] = planned.table.splitlines()[0] if planned.table else ""
    out["bandwidth_source"] = planned.cluster.source  # preset | alpha-beta | probe | cache (planner/cluster.py)
    out["alternatives"] = len(rows)
    return out


def log_plan(sink: WandbLogger, plan: Plan, setting: str, planned: PlanOutcome | None = None) -> dict[str, Any]:
    """Put the chosen plan in the run config and, when the partitioner ran, its ranked table."""
    summary = plan_summary(plan, setting, planned)
    sink.update_config({"chosen_plan": summary})
    if planned is not None:
        sink.log_table(PLANS_TABLE, planned.columns, planned.rows)
    return summary


def log_switch(sink: WandbLogger, new: Plan, old: Plan, setting: str, step: int, reason: str | None) -> dict[str, Any]:
    """After a re-planning switch at `step`: `chosen_plan` names the plan the run now trains with, so runs
    keep grouping by the plan they trained with, and keeps the one it replaced."""
    replaced = plan_summary(old, setting)
    summary = {**plan_summary(new, setting), "chosen_by": "replanner", "switched_at_step": step, "reason": reason,
               "replaced": {k: replaced[k] for k in ("name", "label", *UNIT_GROUPS)}}
    sink.update_config({"chosen_plan": summary})
    return summary
