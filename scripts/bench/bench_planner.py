"""Partitioner solve time against cluster size (acceptance: under 2 s at 16384 ranks).

For each GPU count (8 per node) it times, on this machine: building the per-group cost terms for
every valid degree triple (the cost model), the CBC integer program, and the numpy exhaustive search
over all (blocks, embed_head) pairs, and checks that the ILP and the exhaustive optimum agree. Then
the whole command line at the largest size, end to end in a fresh process (interpreter start,
imports, Hydra compose, solve, table), and its import time alone: what a user waits for.

    .venv/bin/python scripts/bench/bench_planner.py [--model llama2_70b] [--cluster h100x8] \\
        [--max-ranks 16384] [--markdown BENCHMARKS.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from amsp.planner import exhaustive, ilp  # noqa: E402
from amsp.planner.__main__ import compose_config  # noqa: E402
from amsp.planner.cost_model import CostModel  # noqa: E402
from amsp.planner.from_config import cluster_spec, options_from_config, workload_from_config  # noqa: E402
from amsp.planner.report import plan_label  # noqa: E402
from amsp.planner.terms import GroupTerms  # noqa: E402

SECTION = "## Partitioner solve time (scripts/bench/bench_planner.py)"


def bench(model: str, cluster: str, max_ranks: int, repeats: int) -> list[dict]:
    rows = []
    ranks = 8
    while ranks <= max_ranks:
        cfg = compose_config([f"model={model}", f"cluster={cluster}", f"cluster.nodes={ranks // 8}",
                              "data.seq_len=4096", "trainer.micro_batch_size=1",
                              f"trainer.global_batch_tokens={4096 * max(ranks, 1024)}",
                              "model.activation_checkpointing=full"])
        c = cluster_spec(cfg)
        w = workload_from_config(cfg, c)
        best = None
        for _ in range(repeats):  # best of a few: the machine is shared
            t0 = time.perf_counter()
            terms = GroupTerms.build(CostModel(w, c, options_from_config(cfg)))
            t1 = time.perf_counter()
            choice, _ = ilp.solve(terms)
            t2 = time.perf_counter()
            ref = exhaustive.best(terms)
            t3 = time.perf_counter()
            run = {"ranks": ranks, "triples": len(terms.candidates), "terms_s": t1 - t0, "ilp_s": t2 - t1,
                   "exhaustive_s": t3 - t2}
            if choice is None:  # both must find that nothing fits
                run.update(plan="no plan fits", step_s=float("nan"), agree=ref is None)
            else:
                run.update(plan=plan_label(choice.plan), step_s=choice.step_time_s,
                           agree=ref is not None and abs(choice.step_time_s - ref.step_time_s) <= 1e-9 * ref.step_time_s)
            if best is None or run["terms_s"] + run["ilp_s"] < best["terms_s"] + best["ilp_s"]:
                best = run
        rows.append(best)
        print(f"{ranks:6d} ranks  {best['triples']:4d} triples  terms {best['terms_s']:.3f} s  ILP {best['ilp_s']:.3f} s  "
              f"total {best['terms_s'] + best['ilp_s']:.3f} s  exhaustive {best['exhaustive_s']:.3f} s  "
              f"agree {best['agree']}  {best['plan']}", flush=True)
        ranks *= 2
    return rows


def cli_args(model: str, cluster: str, ranks: int) -> list[str]:
    return [f"model={model}", f"cluster={cluster}", f"cluster.nodes={ranks // 8}", "data.seq_len=4096",
            "trainer.micro_batch_size=1", f"trainer.global_batch_tokens={4096 * max(ranks, 1024)}",
            "model.activation_checkpointing=full"]


def _wall(argv: list[str], repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of a fresh process, best of `repeats`. CPU = user + sys of the process and
    its children (CBC): on a shared machine the wall time mostly measures the other jobs, the CPU
    time is what the command needs of one core."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       cwd=os.path.dirname(os.path.dirname(HERE)))
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best = min(best, (wall, cpu))
    return best


def cli_timing(model: str, cluster: str, ranks: int, repeats: int) -> dict:
    """(wall, CPU) seconds of `python -m amsp.planner` (text and --json), of its imports alone, and of
    `import torch` (what the CLI no longer pays)."""
    py = sys.executable
    out = {"ranks": ranks, "args": " ".join(cli_args(model, cluster, ranks)),
           "python": _wall([py, "-c", "pass"], repeats),
           "torch": _wall([py, "-c", "import torch"], repeats),
           "import": _wall([py, "-c", "import amsp.planner.__main__"], repeats),
           "cli": _wall([py, "-m", "amsp.planner"] + cli_args(model, cluster, ranks), repeats),
           "json": _wall([py, "-m", "amsp.planner", "--json"] + cli_args(model, cluster, ranks), repeats)}
    print(f"CLI at {ranks} ranks: {out['cli'][0]:.2f} s wall / {out['cli'][1]:.2f} s CPU (--json "
          f"{out['json'][0]:.2f} / {out['json'][1]:.2f}; imports {out['import'][0]:.2f} / {out['import'][1]:.2f}; "
          f"import torch {out['torch'][0]:.2f} / {out['torch'][1]:.2f})", flush=True)
    return out


def markdown(rows: list[dict], model: str, cluster: str, cmd: str, cli: dict | None = None) -> str:
    lines = [SECTION, "",
             f"`{cmd}` on {platform.processor() or platform.machine()} ({os.cpu_count()} cores, shared with other "
             f"jobs; best of the repeats). Model {model}, cluster preset {cluster} (8 GPUs per node), seq_len 4096, "
             "micro-batch 1, full recomputation, global batch max(ranks, 1024) x 4096 tokens. Solve = building "
             "the cost terms for every valid degree triple of both unit groups + the CBC integer program; the "
             "exhaustive search over all pairs is the reference and must agree.", "",
             "| ranks | triples per group | cost terms (s) | ILP (s) | solve total (s) | exhaustive (s) | ILP = exhaustive | chosen plan (blocks \\| emb+head) | predicted step (s) |",
             "|---:|---:|---:|---:|---:|---:|:---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['triples']} | {r['terms_s']:.3f} | {r['ilp_s']:.3f} | "
                     f"{r['terms_s'] + r['ilp_s']:.3f} | {r['exhaustive_s']:.3f} | {'yes' if r['agree'] else 'NO'} | "
                     f"{r['plan'].replace('|', chr(92) + '|')} | {r['step_s']:.2f} |")
    if cli:
        lines += ["", f"Command line end to end at {cli['ranks']} ranks (fresh process, best of the repeats; torch is "
                  f"not imported): `python -m amsp.planner {cli['args']}`", "",
                  "| what | wall (s) | CPU, user+sys (s) |", "|---|---:|---:|"]
        for key, what in (("python", "bare interpreter (`python -c pass`)"),
                          ("torch", "`import torch` (no longer imported by the CLI)"),
                          ("import", "imports (`python -c 'import amsp.planner.__main__'`)"),
                          ("cli", "CLI, text table"), ("json", "CLI, `--json`")):
            lines.append(f"| {what} | {cli[key][0]:.2f} | {cli[key][1]:.2f} |")
    return "\n".join(lines) + "\n"


def write_section(path: str, text: str) -> None:
    """Replace this benchmark's section in BENCHMARKS.md (or append it), leaving the others alone."""
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    start = old.find(SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        nxt = old.find("\n## ", start + len(SECTION))
        new = old[:start] + text + ("" if nxt < 0 else old[nxt:])
    with open(path, "w") as f:
        f.write(new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2_70b")
    ap.add_argument("--cluster", default="h100x8")
    ap.add_argument("--max-ranks", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", help="write/replace this benchmark's section in that file")
    args = ap.parse_args()
    rows = bench(args.model, args.cluster, args.max_ranks, args.repeats)
    cli = cli_timing(args.model, args.cluster, args.max_ranks, args.repeats)
    cmd = "python scripts/bench/bench_planner.py " + " ".join(sys.argv[1:])
    if args.markdown:
        write_section(args.markdown, markdown(rows, args.model, args.cluster, cmd.strip(), cli))
    worst = max(r["terms_s"] + r["ilp_s"] for r in rows if r["ranks"] == max(x["ranks"] for x in rows))
    ok = all(r["agree"] for r in rows) and worst < 2.0 and cli["cli"][1] < 2.0
    print(f"largest cluster solved in {worst:.3f} s, CLI {cli['cli'][1]:.2f} s CPU; {'OK' if ok else 'FAILED'} "
          f"(target < 2 s each, ILP = exhaustive)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
