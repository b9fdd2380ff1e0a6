"""What-if across scales: predicted step time, tokens/s per GPU and MFU of the named presets and of
the planner's choice, for one model and cluster type at several GPU counts (same global batch), each
with the term that decides it (report.why): the largest exposed communication, or memory when a
faster plan does not fit."""
from __future__ import annotations

from amsp.parallel.micro_batches import micro_batch_problem
from amsp.plan import PRESET_NAMES, PlanError, make_plan

from .cluster import ClusterSpec
from .cost_model import CostModel, Options
from .report import GIB, NoFeasiblePlan, plan_label, why
from .solve import plan_cluster
from .workload import Workload

DEFAULT_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)


def simulate(workload_at, cluster: ClusterSpec, options: Options, gpus=DEFAULT_GPUS) -> list[dict]:
    """Rows {gpus, global_batch, plan, degrees, step_s, tokens_per_s_per_gpu, mfu, memory_gib, fits, note}.

    workload_at(world) -> Workload gives the workload at a world size (micro-batches follow the
    fixed global batch), or raises ValueError when the batch does not divide. With a pipeline (pp > 1) a
    count whose micro-batches per step the schedule refuses (fewer than pp for all but GPipe: train.py stops
    there before building anything, amsp/parallel/micro_batches.py) is one row saying so; GPipe, which runs
    them, gets its rows with a `warning`: the pipeline never fills."""
    rows = []
    r = cluster.ranks_per_node
    for n in gpus:
        base = {"gpus": n}
        if n % r and n > r:
            rows.append({**base, "plan": "-", "note": f"not a whole number of {r}-GPU nodes"})
            continue
        spec = cluster.with_shape(max(1, n // r), min(r, n))
        try:
            w: Workload = workload_at(n)
        except ValueError as e:
            rows.append({**base, "plan": "-", "note": str(e)})
            continue
        model = CostModel(w, spec, options)
        base["global_batch"] = w.micro_batch_size * w.micro_batches * model.dp_world  # as rounded for this count
        if w.pp > 1 and (problem := micro_batch_problem(w.schedule, w.micro_batches, w.pp)) is not None:
            rows.append({**base, "plan": "-", "note": f"train.py refuses this: {problem}"})
            continue
        if w.pp > 1 and w.micro_batches < w.pp:  # a schedule that runs it anyway (GPipe)
            base["warning"] = (f"{w.micro_batches} micro-batch(es) per step < parallel.pp={w.pp} stages: the "
                               f"pipeline never fills; its bubble, (pp-1)/m, is {w.pipeline_bubble():.0%} of the "
                               f"compute time; raise trainer.global_batch_size or lower trainer.micro_batch_size")
        presets = []
        for name in PRESET_NAMES:
            try:
                plan = make_plan(name, model.dp_world, model.dp_per_node)
            except PlanError:
                continue
            presets.append(model.evaluate(plan))
            rows.append({**base, **_row(presets[-1], w)})
        try:
            res = plan_cluster(w, spec, options, top_k=1, with_presets=False)
            row = _row(res.chosen, w)
            faster = [c for c in presets if not c.fits and c.step_time_s < res.chosen.step_time_s]
            if faster:  # memory decided: a faster plan exists but does not fit
                c = min(faster, key=lambda c: c.step_time_s)
                row["why"] = (f"memory: {c.plan.name} {res.chosen.step_time_s / c.step_time_s - 1:.0%} faster "
                              f"needs {c.memory_total / GIB:.0f} GiB; then {row['why']}")
            rows.append({**base, **row})
        except NoFeasiblePlan as e:
            rows.append({**base, "plan": "auto", "note": f"no plan fits (smallest {e.smallest.memory_total / GIB:.1f} "
                                                         f"GiB)"})
    return rows


def _row(cost, w: Workload) -> dict:
    cost.ranks_per_replica = w.tp * w.pp
    return {"plan": cost.plan.name, "degrees": plan_label(cost.plan), "step_s": cost.step_time_s,
            "tokens_per_s_per_gpu": cost.tokens_per_s_per_gpu, "mfu": cost.mfu,
            "memory_gib": cost.memory_total / GIB, "fits": cost.fits,
            "note": "" if cost.fits else "does not fit", "why": why(cost)}


def format_simulation(rows: list[dict]) -> str:
    head = (f"{'GPUs':>5} {'plan':<6} {'p/g/os (blocks | emb+head)':<30} {'step s':>8} {'tok/s/GPU':>10} "
            f"{'MFU':>6} {'GiB/rank':>9}  why")
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and r["gpus"] != last:
            lines.append("")
        if r["gpus"] != last and r.get("warning"):  # once per GPU count, above its rows
            lines.append(f"{r['gpus']:>5} warning: {r['warning']}")
        last = r["gpus"]
        if "step_s" not in r:
            lines.append(f"{r['gpus']:>5} {r['plan']:<6} {'':<30} {'':>8} {'':>10} {'':>6} {'':>9}  {r['note']}")
            continue
        lines.append(f"{r['gpus']:>5} {r['plan']:<6} {r['degrees']:<30} {r['step_s']:8.3f} "
                     f"{r['tokens_per_s_per_gpu']:10.0f} {r['mfu']:6.1%} {r['memory_gib']:9.1f}  {r['why']}")
    return "\n".join(lines)
