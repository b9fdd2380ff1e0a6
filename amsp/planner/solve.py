"""One planning pass: cost terms -> ILP -> ranked alternatives -> text table and wandb rows."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from amsp.plan import PRESET_NAMES, Plan, PlanError, make_plan

from . import exhaustive, ilp
from .cluster import ClusterSpec
from .cost_model import CostModel, Options
from .report import NoFeasiblePlan, PlanCost, format_table, wandb_rows
from .terms import GroupTerms
from .workload import Workload

log = logging.getLogger(__name__)


@dataclass
class PlannerResult:
    plan: Plan
    chosen: PlanCost
    ranked: list  # PlanCost, the chosen plan first
    presets: list  # PlanCost of the named presets valid on this cluster (fitting or not)
    solve_s: float
    candidates: int

    def table(self) -> str:
        c = self.chosen
        head = (f"chosen plan: {c.plan}  predicted step {c.step_time_s:.3f} s (compute {c.compute_s:.3f} s, "
                f"exposed communication {c.exposed_total_s:.3f} s), {c.memory_total / 2**30:.2f} of "
                f"{c.device_memory / 2**30:.1f} GiB per rank; ILP over {self.candidates} triples per group "
                f"solved in {self.solve_s:.2f} s")
        text = format_table(self.ranked, head + "\nbest alternatives:")
        if self.presets:
            text += "\n" + format_table(self.presets, "named presets for comparison (total > device memory = does "
                                                      "not fit):")
        return text

    def wandb_table(self) -> tuple[list, list]:
        return wandb_rows(self.ranked + self.presets)


def _with_ranks(cost: PlanCost, w: Workload) -> PlanCost:
    cost.ranks_per_replica = w.tp * w.pp
    return cost


def preset_costs(model: CostModel) -> list[PlanCost]:
    out = []
    for name in PRESET_NAMES:
        try:
            plan = make_plan(name, model.dp_world, model.dp_per_node)
        except PlanError:
            continue
        out.append(_with_ranks(model.evaluate(plan), model.w))
    return out


def plan_cluster(workload: Workload, cluster: ClusterSpec, options: Options = Options(), top_k: int = 10,
                 time_limit_s: float = 20.0, with_presets: bool = True) -> PlannerResult:
    model = CostModel(workload, cluster, options)
    terms = GroupTerms.build(model)
    choice, solve_s = ilp.solve(terms, time_limit_s)
    if choice is None:
        smallest = exhaustive.smallest_memory(terms)
        raise NoFeasiblePlan(_with_ranks(model.evaluate(smallest.plan), workload), workload.recompute,
                             workload.micro_batch_size)
    chosen = _with_ranks(model.evaluate(choice.plan), workload)
    alternatives = [replace(c.plan, name="alt") for c in exhaustive.ranked(terms, top_k)
                    if (c.plan.blocks, c.plan.embed_head) != (choice.plan.blocks, choice.plan.embed_head)]
    ranked = [chosen] + [_with_ranks(model.evaluate(p), workload) for p in alternatives]
    return PlannerResult(choice.plan, chosen, ranked[:top_k], preset_costs(model) if with_presets else [],
                         solve_s, len(terms.candidates))
