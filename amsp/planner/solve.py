"""One planning pass: cost terms -> ILP -> ranked alternatives -> text table and wandb rows."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

from amsp.plan import PRESET_NAMES, Degrees, Plan, PlanError, make_plan

from . import exhaustive, ilp
from .cluster import ClusterSpec
from .cost_model import CostModel, Options
from .report import NoFeasiblePlan, PlanCost, format_table, plan_cost_json, wandb_rows
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
    terms: GroupTerms | None = None  # every candidate triple's terms per unit group (to_json)

    def table(self) -> str:
        c = self.chosen
        head = (f"chosen plan: {c.plan}  predicted step {c.step_time_s:.3f} s (compute {c.compute_s:.3f} s, "
                f"optimizer {c.optimizer_s:.3f} s, "
                f"exposed communication {c.exposed_comm_s:.3f} s), {c.memory_total / 2**30:.2f} of "
                f"{c.device_memory / 2**30:.1f} GiB per rank; ILP over {self.candidates} triples per group "
                f"solved in {self.solve_s:.2f} s")
        if c.state_budget is not None:
            head += (f"\nmodel states {c.model_state_bytes / 2**30:.3g} GiB per rank within the model-state "
                     f"budget of {c.state_budget / 2**30:.3g} GiB (amsp.planner.state_budget_gib)")
        text = format_table(self.ranked, head + "\nbest alternatives:")
        if self.presets:
            text += "\n" + format_table(self.presets, "named presets for comparison (total > device memory = does "
                                                      "not fit):")
        return text

    def wandb_table(self) -> tuple[list, list]:
        return wandb_rows(self.ranked + self.presets)

    def to_json(self) -> dict:
        """The choice, the ranked plans' and named presets' costs (report.plan_cost_json), and every
        candidate triple's terms per unit group (GroupTerms.to_json)."""
        return {"chosen": plan_cost_json(self.chosen), "ranked": [plan_cost_json(c) for c in self.ranked],
                "presets": [plan_cost_json(c) for c in self.presets], "solve_s": self.solve_s,
                "candidates_per_group": self.candidates,
                "candidates": None if self.terms is None else self.terms.to_json()}


def price_plan(workload: Workload, cluster: ClusterSpec, options: Options, plan: Plan) -> PlanCost:
    """One named plan priced by the same cost model (python -m amsp.planner --price)."""
    return _with_ranks(CostModel(workload, cluster, options).evaluate(plan), workload)


def parse_plan(text: str, dp_world: int, dp_per_node: int) -> Plan:
    """A plan from the command line: a preset name (ddp, zero1, zero2, zero3, hsdp), or explicit
    degrees P/G/OS for every unit, or P/G/OS|P/G/OS for blocks | embedding+head (amsp.p/g/os and
    amsp.embed_head_p/g/os in a training config). PlanError (a ValueError) names what is wrong."""
    text = text.strip()
    if text in PRESET_NAMES:
        return make_plan(text, dp_world, dp_per_node)
    parts = [x.strip() for x in text.replace(":", "|").split("|")]
    if len(parts) > 2 or not all(_TRIPLE.fullmatch(x) for x in parts):
        raise PlanError(f"cannot read plan {text!r}: expected a preset ({', '.join(PRESET_NAMES)}), P/G/OS "
                        f"(e.g. 8/8/64) or P/G/OS|P/G/OS for blocks | embedding+head")
    blocks, *rest = [Degrees(*(int(v) for v in x.split("/"))) for x in parts]
    return make_plan("custom", dp_world, dp_per_node, blocks=blocks, embed_head=rest[0] if rest else None)


_TRIPLE = re.compile(r"\d+/\d+/\d+")


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
                             workload.micro_batch_size, reserved_bytes=options.reserved_bytes)
    chosen = _with_ranks(model.evaluate(choice.plan), workload)
    alternatives = [replace(c.plan, name="alt") for c in exhaustive.ranked(terms, top_k)
                    if (c.plan.blocks, c.plan.embed_head) != (choice.plan.blocks, choice.plan.embed_head)]
    ranked = [chosen] + [_with_ranks(model.evaluate(p), workload) for p in alternatives]
    return PlannerResult(choice.plan, chosen, ranked[:top_k], preset_costs(model) if with_presets else [],
                         solve_s, len(terms.candidates), terms)
