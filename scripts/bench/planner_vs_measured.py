"""Partitioner check: its predictions per AMSP plan against what the shoot-out measured.

Reads a shoot-out result (shootout.py --json), rebuilds the cluster the automatic plan was chosen
for (same probe bandwidths and peak), prices every AMSP plan that ran with the planner's cost model,
and reports Spearman rank correlations across the plans:
  predicted step time          vs measured median step time
  predicted exposed comm time  vs measured median step time
  predicted inter-node bytes   vs bytes counted on the emulated links

    python scripts/bench/planner_vs_measured.py /tmp/sb/comm-fp32.json [--markdown BENCHMARKS.md]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def ranks(xs: list[float]) -> list[float]:
    """Average ranks (ties share the mean of their positions)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def parse_plan(text: str, world: int, rpn: int):
    """'auto (blocks p/g/os = 2/2/4, embedding+head = 1/1/2)' or 'zero1 (p/g/os = 1/1/4)' -> Plan."""
    import re

    from amsp.plan import Degrees, make_plan

    degs = [Degrees(*map(int, m)) for m in re.findall(r"(\d+)/(\d+)/(\d+)", text)]
    name = text.split(" ")[0]
    return make_plan(name, world, rpn, blocks=degs[0], embed_head=degs[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    with open(a.result) as f:
        d = json.load(f)
    spec, raw, rows = d["spec"], d["raw"], {r["system"]: r for r in d["rows"]}
    if "auto" not in raw:
        raise SystemExit("this result has no automatic plan (run the shoot-out with amsp:auto)")
    from amsp.planner.cluster import AlphaBeta, ClusterSpec
    from amsp.planner.cost_model import CostModel, Options
    from amsp.planner.workload import Workload
    from amsp.schedule import Precision
    from models.llama import LlamaConfig

    nodes, rpn = spec["nodes"], spec["ranks_per_node"]
    fb = {s: AlphaBeta(v["latency_s"], v["busbw_gbs"]) for s, v in raw["auto"]["probe"].items()}
    cluster = ClusterSpec("netns-emulated", nodes, rpn, spec["device_memory_bytes"], raw["auto"]["peak_flops"], 5.0,
                          "fp32", fallback=fb, source="probe")
    wl = Workload(model=LlamaConfig(**spec["model"]), seq_len=spec["seq_len"], micro_batch_size=spec["micro_batch_size"],
                  micro_batches=spec["micro_batches"], precision=Precision.named(spec["precision"]))
    model = CostModel(wl, cluster, Options(reserved_bytes=0))
    table = []
    for s, text in raw["plans"].items():
        if not s.startswith("amsp:") or s not in rows or not rows[s].get("fits", True):
            continue
        c = model.evaluate(parse_plan(text, nodes * rpn, rpn))
        r = rows[s]
        table.append((s, str(c.plan).split("(")[-1].rstrip(")"), c.step_time_s, c.exposed_comm_s,
                      c.inter_node_bytes() / 1e6, r["median_step_s"], r["inter_node_mb_per_step"]))
    if len(table) < 3:
        raise SystemExit("need at least 3 AMSP plans for a rank correlation")
    col = lambda i: [t[i] for t in table]  # noqa: E731
    rho_step = spearman(col(2), col(5))
    rho_exposed = spearman(col(3), col(5))
    rho_bytes = spearman(col(4), col(6))
    lines = [f"Planner predictions vs shoot-out measurements ({os.path.basename(a.result)}, {d['date']}, "
             f"{len(table)} AMSP plans; command: `python scripts/bench/planner_vs_measured.py {a.result}`)", "",
             "| plan | p/g/os | predicted step s | predicted exposed comm s | predicted inter-node MB (per-rank sum) "
             "| measured step s | measured link MB/step |", "|---|---|---|---|---|---|---|"]
    for t in sorted(table, key=lambda t: t[5]):
        lines.append(f"| {t[0]} | {t[1].replace('p/g/os = ', '')} | {t[2]:.3f} | {t[3]:.3f} | {t[4]:.1f} | "
                     f"{t[5]:.3f} | {t[6]:.1f} |")
    lines += ["", f"Spearman rank correlation: predicted step time vs measured step time **{rho_step:.2f}**; "
              f"predicted exposed communication vs measured step time **{rho_exposed:.2f}**; predicted inter-node "
              f"bytes vs link counters **{rho_bytes:.2f}**.", ""]
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
