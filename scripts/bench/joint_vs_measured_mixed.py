"""The mixed-cluster half of the joint planner check (`joint_vs_measured.py --slow-node Q`): a slower node
stands in for an older kind of GPU node.

--slow-node Q: a mixed cluster (slow_node.py): each emulated node pinned to a core of its own, the second
slowed to Q of a core. Each node type's units are measured twice: by its own node on the mixed layout
(every rank at once, each node keeping the median of its ranks: what a startup on a mixed cluster would
measure; the median of --unit-measurements such runs, as a throttled node's timings have outliers) and
on a layout of that type alone (both nodes fast, then both slow); the probe on the mixed layout. The
configurations of MIXED_CONFIGS run on the mixed layout and are priced with either set of units on a
two-group cluster (amsp/planner/joint/hetero.py), pipelines both with an even split and with the split
the planner picks for that cluster. Then train.py's own startup runs on the same layout, --startup-runs
times (parallel.auto=true, parallel.cluster_file naming the two nodes apart, fresh measurements each):
each choice and its step time against the fastest configuration of the table.
`joint_vs_measured.py --reprice JSON` prices an earlier --slow-node run again.

The launching, measuring and pricing helpers are joint_vs_measured.py's; this file holds what only the
mixed layout needs.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import slow_node
from joint_vs_measured import (MODEL, RANKS, RANKS_PER_NODE, _err, _s, measure, optimizer_rate, prediction_stats,
                               pricing_inputs, run_config, run_train, write_results)

# The mixed cluster's configurations (--slow-node): node 1 is the slow one. Pipelines run twice: the
# even split (None) and the split the planner picks for the mixed cluster ("planned").
MIXED_CONFIGS = [(1, 1, (1, 1, 1), 2, None), (1, 1, (1, 1, 2), 2, None), (1, 1, (2, 2, 2), 2, None),
                 (2, 1, (1, 1, 1), 2, None), (1, 2, (1, 1, 1), 2, None), (1, 2, (1, 1, 1), 2, "planned"),
                 (1, 2, (1, 1, 1), 1, None), (1, 2, (1, 1, 1), 1, "planned"), (2, 2, (1, 1, 1), 2, None),
                 (2, 2, (1, 1, 1), 2, "planned"), (1, 1, (1, 1, 1), 4, None), (1, 2, (1, 1, 1), 4, "planned")]


def startup_choice(steps: int, workdir: str, run: int = 0) -> dict | None:
    """train.py with parallel.auto on the mixed layout, told the node groups (parallel.cluster_file): the
    plan its startup chose from what each node measured there (fresh measurements, no cache), that plan's
    predicted and measured step seconds. Each emulated node is a machine of one core and its 2 ranks
    (AMSP_MACHINE_RANKS), as mixed_cluster prices it. A launch that fails is said so (its output kept) and
    tried once more."""
    cluster_file = os.path.join(workdir, "slow_node_cluster.yaml")
    with open(cluster_file, "w") as f:
        f.write("name: slow_node\nnode_groups:\n  - {name: fast, preset: cpu, nodes: 1}\n"
                "  - {name: slow, preset: cpu, nodes: 1}\n")
    for attempt in (1, 2):
        name = f"startup_auto{run}_{attempt}"
        measured = run_train(name, ["parallel.auto=true", "amsp.plan=auto", f"parallel.cluster_file={cluster_file}",
                                    f"amsp.planner.cache_dir={os.path.join(workdir, name + '_cache')}"], steps, None,
                             workdir, placed=True, env={"AMSP_MACHINE_RANKS": str(RANKS_PER_NODE)})
        if measured is not None:
            break
    if measured is None:
        return None
    text = open(os.path.join(workdir, name, "plan.txt")).read()
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("rank"))
    col = lines[header + 1].split()  # rank tp pp dp mbs B step MFU layers/stage p/g/os-per-stage ...
    return {"tp": int(col[1]), "pp": int(col[2]), "mbs": int(col[4]), "split": col[8], "degrees": col[9],
            "predicted_s": float(col[6]), "measured_s": measured, "attempts": attempt, "plan": text}



def node_units(model, seq: int, mbs: int, world: int) -> dict[int, dict]:
    """{node: by_mbs entry} of one micro-batch size: every rank times the units at once (the ranks of a
    node share its core, as in training), each node keeps the median of its own ranks."""
    from amsp import control
    from amsp.parallel.tp_profile import measure_tp_units
    from amsp.planner.compute_profile import time_compute, time_optimizer

    control.barrier()
    times, parts = time_compute(model, seq, mbs, "fp32", "cpu")
    del parts
    opt = time_optimizer("cpu")
    tp2 = measure_tp_units(model, seq, mbs, "fp32", "cpu", 2, world, repeats=5, slowest=False)
    mine = [times["block_forward_s"], times["block_forward_s"] + times["block_backward_s"],
            times["head_forward_backward_s"], times["embedding_s"], opt, tp2.block_s, tp2.head_s, tp2.embedding_s]
    rows = control.all_gather_object(mine)
    out = {}
    for node in range(world // RANKS_PER_NODE):
        ranks = rows[node * RANKS_PER_NODE:(node + 1) * RANKS_PER_NODE]
        med = [statistics.median(col) for col in zip(*ranks)]
        # the node's 2 ranks share one core: hidden communication takes compute's CPU time one for one
        out[node] = {"block_forward_s": med[0], "overlap_slowdown": 1.0, "optimizer_s_per_elem": med[4],
                     "units": {1: med[1:4], 2: med[5:8]}, "ranks": ranks}
    return out



def mixed_cluster(points, quota: float):
    """slow_node.py's mixed layout as the joint planner's two-group cluster: node 0 of the cpu preset with
    the probe merged in, node 1 the same at `quota` of its peak. Each node's 2 ranks share its one core,
    so a rank alone on its node computes in half the all-busy time (ClusterSpec.shared_cores)."""
    from dataclasses import replace

    from amsp.planner.__main__ import compose_config
    from amsp.planner.from_config import cluster_spec
    from amsp.planner.joint.hetero import HeteroCluster, NodeGroup
    from amsp.planner.probe import apply_points

    spec = apply_points(cluster_spec(compose_config(MODEL), nodes=2, ranks_per_node=RANKS_PER_NODE,
                                     local_ranks=RANKS, device="cpu"), *points)
    fast = replace(spec, nodes=1, shared_cores=(RANKS_PER_NODE, 0.5))
    slow = replace(fast, name=f"{spec.name}_slow", peak_flops=spec.peak_flops * quota)
    return HeteroCluster("mixed", (NodeGroup(fast.name, 1, fast), NodeGroup(slow.name, 1, slow)))


def predict_mixed(tp, pp, deg, mbs, split, cluster, inputs) -> tuple[float, list[int]] | None:
    """(predicted step seconds, the blocks per stage priced) on the mixed cluster; split None: the
    planner's own split for it."""
    from amsp.plan import Degrees
    from amsp.planner.__main__ import compose_config
    from amsp.planner.joint.search import price_config
    from amsp.schedule import Precision
    from configs.schema import to_llama_config

    cfg = compose_config(MODEL)
    eff, units, slowdown, _ = inputs
    res = price_config(to_llama_config(cfg.model), cluster, seq_len=int(cfg.data.seq_len),
                       global_batch=int(cfg.trainer.global_batch_size), precision=Precision.named("fp32"), tp=tp,
                       pp=pp, micro_batch_size=mbs, degrees=Degrees(*deg), layer_split=split,
                       efficiency={g: e[mbs] for g, e in eff.items()}, reserved_bytes=0, overlap_slowdown=slowdown,
                       unit_times=units, optimizer_s_per_elem=inputs[3])
    return None if res is None else (res[0], res[1]["layer_split"])


def mixed_inputs(got: dict, quota: float, source: str):
    """(two-group cluster, pricing inputs) of the mixed layout; source "mixed": each node type's units as
    its own node measured them on the mixed layout (what a startup there would measure), "alone": on a
    layout of that type alone (both nodes fast, then both slow)."""
    from amsp.planner.probe import _from_json

    cluster = mixed_cluster((_from_json(got["mixed"]["points"]), "probe"), quota)
    per_type = ([{"by_mbs": got["mixed"]["by_node"][n]["by_mbs"], "points": got["mixed"]["points"]} for n in ("0", "1")]
                if source == "mixed" else [got["fast"], got["slow"]])
    eff, units, rates = {}, {}, {}
    for fast, g, m in zip((True, False), cluster.groups, per_type):
        e, u, _, _ = pricing_inputs(m)
        # efficiency() divides by the cpu preset's peak; the slow group's peak is quota x that
        eff[g.name] = {mbs: min(1.0, v / (1.0 if fast else quota)) for mbs, v in e.items()}
        units.update({(g.name, tp, mbs): t for (tp, mbs), t in u.items()})
        rates[g.name] = optimizer_rate(m)
    slowdown = pricing_inputs(per_type[0])[2]
    return cluster, (eff, units, slowdown, {k: v for k, v in rates.items() if v})


def median_units(runs: list[dict]) -> dict:
    """Per-node measurements of several runs (measure(per_node=True)) as one: every number the median
    over the runs; the probe of the first."""
    def med(values):
        first = values[0]
        if isinstance(first, dict):
            return {k: med([v[k] for v in values]) for k in first if k != "ranks"}
        if isinstance(first, list):
            return [med(list(col)) for col in zip(*values)]
        return statistics.median(values)

    return {"by_node": med([r["by_node"] for r in runs]), "points": runs[0]["points"]}


def mixed_summary(rows: list[dict], key: str) -> dict | None:
    """prediction_stats of one unit source's predictions on the mixed cluster."""
    got = prediction_stats(rows, key, lambda r: f"tp{r['tp']} pp{r['pp']} {r['degrees']} mbs{r['mbs']} {r['how']}")
    return None if got is None else {"priced_and_ran": got[0], **got[1]}


def mixed_main(a, t0: float) -> int:
    """--slow-node: measure each node type alone and the mixed layout per node, then run MIXED_CONFIGS on
    the mixed layout and price them with either set of units (--reprice: price an earlier run again)."""
    from amsp.parallel.pipeline import split_layers
    from models.llama import get_preset

    n_layers = get_preset("tiny").n_layers
    old = json.load(open(a.reprice)) if a.reprice else None
    configs = MIXED_CONFIGS[:a.limit] if a.limit else MIXED_CONFIGS
    if old:  # the configurations that ran then
        configs = [(r["tp"], r["pp"], tuple(r["degrees"]), r["mbs"], None if r["how"] == "default" else r["how"])
                   for r in old["rows"]]
    sizes = sorted({c[3] for c in configs})
    got, rows = (old["measured"], old["rows"]) if old else ({}, [])
    try:
        for layout in () if old else ("fast", "slow", "mixed"):
            slow_node.setup(layout, a.slow_node)
            if layout == "mixed":  # a throttled node's timings have outliers: the median of a few
                runs = [measure(sizes, None, placed=True, per_node=True) for _ in range(a.unit_measurements)]
                got[layout] = {**median_units(runs), "runs": runs}
            else:
                got[layout] = measure(sizes, None, placed=True)
            print(f"[{time.time() - t0:.0f}s] measured the {layout} layout", file=sys.stderr)
        priced = {src: mixed_inputs(got, a.slow_node, src) for src in ("mixed", "alone")}
        for src, (cluster, inputs) in priced.items():
            print(f"units measured {src}:", cluster.describe(), inputs[1], file=sys.stderr)
        with tempfile.TemporaryDirectory() as work:
            for i, (tp, pp, deg, mbs, how) in enumerate(configs):
                split = None if how == "planned" else [len(x) for x in split_layers(n_layers, pp)]
                row = {"tp": tp, "pp": pp, "degrees": deg, "mbs": mbs, "how": how or "default"}
                if old:  # the split that ran
                    row["split"] = old["rows"][i]["split"]
                    split = row["split"] or split
                for src, key in (("mixed", "predicted_s"), ("alone", "predicted_alone_s")):
                    res = predict_mixed(tp, pp, deg, mbs, split, *priced[src])
                    row[key] = None if res is None else res[0]
                    if src == "mixed" and res is not None:
                        split = res[1]  # the planner's own split (priced with the mixed layout's units)
                row.setdefault("split", split if pp > 1 else None)
                row["measured_s"] = (old["rows"][i]["measured_s"] if old else
                                     run_config(tp, pp, deg, mbs, a.steps, None, work, row["split"], placed=True))
                rows[i:i + 1] = [row]
                print(f"[{i + 1}/{len(configs)} {time.time() - t0:.0f}s] tp{tp} pp{pp} {deg} mbs{mbs} split "
                      f"{row['split'] or '-'} ({row['how']}): predicted {_s(row['predicted_s'])} (units alone "
                      f"{_s(row['predicted_alone_s'])}) measured {_s(row['measured_s'])}", file=sys.stderr)
            # train.py's own startup on the same layout, right after the configurations: a few independent
            # startups, each measuring afresh (the throttled node's timings move their choice)
            startups = old["summary"].get("startups", []) if old else []
            for i in range(0 if old else a.startup_runs):
                got_i = startup_choice(a.steps, work, i)
                startups.append(got_i)
                if got_i is not None:
                    print(f"[{time.time() - t0:.0f}s] parallel.auto at startup ({i + 1}/{a.startup_runs}):\n"
                          f"{got_i['plan']}\nmeasured {_s(got_i['measured_s'])}", file=sys.stderr)
    finally:
        if not old:
            slow_node.teardown()
    summary = {"layout": f"node 1 at {a.slow_node} of a core, node 0 a full core (2 ranks each)",
               "quota": a.slow_node, "configs": len(rows),
               "units_measured_on_the_mixed_layout": mixed_summary(rows, "predicted_s"),
               "units_measured_alone": mixed_summary(rows, "predicted_alone_s"),
               "units": {src: {f"{k[0]} tp{k[1]} mbs{k[2]}": v for k, v in inputs[1].items()}
                         for src, (_, inputs) in priced.items()}, "wall_s": time.time() - t0}
    fastest = min((r["measured_s"] for r in rows if r["measured_s"]), default=None)
    summary["startups"] = [None if st is None else {**st, "vs_fastest_configuration": st["measured_s"] / fastest
                                                    if fastest else None} for st in startups]

    def line(r: dict) -> str:
        split = f"{'/'.join(map(str, r['split']))} ({r['how']})" if r["split"] else "-"
        return (f"| {r['tp']} | {r['pp']} | {'/'.join(map(str, r['degrees']))} | {r['mbs']} | {split} "
                f"| {_s(r['predicted_s'])} | {_err(r['predicted_s'], r['measured_s'])} | {_s(r['predicted_alone_s'])} "
                f"| {_err(r['predicted_alone_s'], r['measured_s'])} | {_s(r['measured_s'])} |\n")

    write_results(a, summary, rows, got, "| tp | pp | p/g/os | mbs | blocks per stage | predicted s (units on "
                  "the mixed layout) | error | predicted s (units alone) | error | measured s |\n"
                  "|---|---|---|---|---|---|---|---|---|---|\n", line)
    if a.markdown and summary["startups"]:
        with open(a.markdown, "a") as f:
            f.write("\n| train.py parallel.auto startup | tp | pp | mbs | blocks per stage | p/g/os per stage | "
                    "predicted s | measured s | vs the fastest configuration above |\n"
                    "|---|---|---|---|---|---|---|---|---|\n")
            for i, st in enumerate(summary["startups"], 1):
                f.write(f"| {i} | failed twice | | | | | | | |\n" if st is None else
                        f"| {i} | {st['tp']} | {st['pp']} | {st['mbs']} | {st['split']} | {st['degrees']} | "
                        f"{_s(st['predicted_s'])} | {_s(st['measured_s'])} | {st['vs_fastest_configuration']:.3f}x |\n")
    return 0
