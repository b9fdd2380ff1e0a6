"""Data-parallel shoot-out on the emulated cluster: AMSP (auto plan + presets) against DDP, FSDP2 and
FSDP2-HSDP, same model / global batch / micro-batches / seed, configurations alternating in one run.

    python scripts/bench/shootout.py --regime comm-fp32      # 2 nodes x 2 ranks, 100 Mbit/s links
    python scripts/bench/shootout.py --regime comm-bf16      # same, bf16 gradient traffic everywhere
    python scripts/bench/shootout.py --regime compute        # unshaped links
    python scripts/bench/shootout.py --regime memory         # model states held to 12 bytes/param per rank
    python scripts/bench/shootout.py --regime comm-fp32 --systems ddp,amsp:auto --rounds 1   # quick look

Prints (and with --markdown appends to a file) one table per regime: median step time, tokens/s,
bytes over the inter-node links per step (link counters), peak RSS per rank, model-state bytes per
rank, and tokens/s relative to the best peer (DDP, FSDP2, FSDP2-HSDP). Needs root + iproute2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import netns_cluster as nc  # noqa: E402

PEERS = ("ddp", "fsdp2", "fsdp2_hsdp")
AMSP = ("amsp:ddp", "amsp:zero1", "amsp:zero2", "amsp:zero3", "amsp:hsdp", "amsp:auto")
PEER_EQUIV = {"ddp": "ddp", "fsdp2": "zero3", "fsdp2_hsdp": "hsdp"}  # same p/g/os point

TINY = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 8192, "multiple_of": 256,
        "max_seq_len": 1024, "attention": "sdpa", "norm": "torch"}

REGIMES = {
    "comm-fp32": dict(rate="100mbit", precision="fp32", micro_batch_size=1, seq_len=128, micro_batches=2),
    "comm-bf16": dict(rate="100mbit", precision="bf16", micro_batch_size=1, seq_len=128, micro_batches=2),
    "compute": dict(rate=None, precision="fp32", micro_batch_size=2, seq_len=256, micro_batches=2),
    "memory": dict(rate="100mbit", precision="fp32", micro_batch_size=1, seq_len=128, micro_batches=2,
                   budget_bytes_per_param=12.0),
}


def model_state_bytes_of_plan(plan_name: str, model: dict, spec: dict) -> int:
    """Planner's count of P + G + OS bytes per rank for an AMSP preset (memory does not depend on
    bandwidths, so a placeholder cluster is enough here)."""
    from amsp.plan import make_plan
    from amsp.planner.cluster import AlphaBeta, ClusterSpec
    from amsp.planner.cost_model import CostModel, Options
    from amsp.planner.workload import Workload
    from amsp.schedule import Precision
    from models.llama import LlamaConfig

    world = spec["nodes"] * spec["ranks_per_node"]
    cluster = ClusterSpec("placeholder", spec["nodes"], spec["ranks_per_node"], 1 << 40, 1e12, 5.0, "fp32",
                          fallback={"intra": AlphaBeta(1e-4, 1.0), "inter": AlphaBeta(1e-4, 1.0)})
    wl = Workload(model=LlamaConfig(**model), seq_len=spec["seq_len"], micro_batch_size=spec["micro_batch_size"],
                  micro_batches=spec["micro_batches"], precision=Precision.named(spec["precision"]))
    cost = CostModel(wl, cluster, Options(reserved_bytes=0)).evaluate(make_plan(plan_name, world, spec["ranks_per_node"]))
    return int(cost.memory["params"] + cost.memory["grads"] + cost.memory["optim"])


def fit_check(systems: list[str], spec: dict, numel: int) -> dict[str, dict]:
    """Memory regime: which named configurations' model states fit the per-rank budget (the planner
    is held to the same rule: amsp.planner.state_budget_gib)."""
    import peers

    world = spec["nodes"] * spec["ranks_per_node"]
    out = {}
    for s in systems:
        if s == "amsp:auto":
            continue  # the planner enforces the budget itself (Options.state_budget_bytes)
        if s in PEERS:
            b = peers.peer_model_state_bytes(s, numel, world, spec["ranks_per_node"])
        else:
            b = model_state_bytes_of_plan(s.split(":", 1)[1], spec["model"], spec)
        out[s] = {"model_state_bytes": b, "fits": b <= spec["state_budget_bytes"]}
    return out


def summarize(spec: dict, raw: dict, skipped: dict) -> list[dict]:
    tokens = spec["nodes"] * spec["ranks_per_node"] * spec["micro_batches"] * spec["micro_batch_size"] * spec["seq_len"]
    rows = []
    for s in spec["systems_all"]:
        if s in skipped:
            rows.append({"system": s, "fits": False, "model_state_mb": skipped[s]["model_state_bytes"] / 1e6})
            continue
        rs = raw["results"].get(s)
        if not rs:
            rows.append({"system": s, "fits": True, "not_run": True})
            continue
        steps = [t for r in rs for t in r["step_s"]]
        med = statistics.median(steps)
        rows.append({
            "system": s, "fits": True, "plan": raw["plans"].get(s, ""),
            "median_step_s": med, "step_s_min": min(steps), "step_s_max": max(steps), "tokens_per_s": tokens / med,
            "inter_node_mb_per_step": statistics.median([b for r in rs for b in r["inter_node_bytes"]]) / 1e6,
            "peak_rss_mb": max(max(r["peak_rss"]) for r in rs) / 1e6,
            "peak_over_base_mb": max(max(p - b for p, b in zip(r["peak_rss"], r["base_rss"])) for r in rs) / 1e6,
            "model_state_mb": max(max(r["model_state_bytes"]) for r in rs) / 1e6,
            "final_loss": rs[-1]["losses"][-1],
        })
    best_peer = max((r["tokens_per_s"] for r in rows if r["system"] in PEERS and "tokens_per_s" in r), default=None)
    for r in rows:
        if r["fits"] and best_peer and not r.get("not_run"):
            r["vs_best_peer"] = r["tokens_per_s"] / best_peer
    return rows


def markdown(regime: str, spec: dict, rows: list[dict], raw: dict, cmd: str, date: str, machine: str,
             wall_s: float) -> str:
    link = spec["rate"] or "unshaped veth"
    gb = spec["nodes"] * spec["ranks_per_node"] * spec["micro_batches"] * spec["micro_batch_size"]
    lines = [f"#### Regime `{regime}`: {spec['nodes']} nodes x {spec['ranks_per_node']} ranks, links {link}, "
             f"{spec['precision']} gradient traffic",
             "", f"- command: `{cmd}`", f"- date: {date}; machine: {machine}; wall time {wall_s:.0f} s",
             f"- model: {spec['model']['dim']}d x {spec['model']['n_layers']} layers, vocab "
             f"{spec['model']['vocab_size']} ({spec['numel'] / 1e6:.2f} M params); global batch {gb} x "
             f"{spec['seq_len']} tokens = {spec['micro_batches']} micro-batches of {spec['micro_batch_size']} per rank; "
             f"{spec['rounds']} rounds x {spec['timed_steps']} timed steps (+{spec['warmup_steps']} warm-up) per "
             f"configuration, order rotated each round" + ("" if raw.get("complete", True) else
                                                            "; STOPPED by its time limit (partial)")]
    if spec.get("budget_bytes_per_param"):
        lines.append(f"- model-state budget per rank: {spec['state_budget_bytes'] / 1e6:.1f} MB = "
                     f"{spec['budget_bytes_per_param']} bytes/param, for every system (given to the planner as "
                     f"amsp.planner.state_budget_gib; its device memory stays the machine's share)")
    if raw.get("auto"):
        inputs = next((ln for ln in raw["auto"]["table"].splitlines() if ln.startswith("cluster ")), "")
        lines.append(f"- automatic plan (train.py's startup planner, measuring on these ranks): {raw['auto']['plan']}"
                     + (f" ({inputs})" if inputs else ""))
    lines += ["", "| system | plan (p/g/os) | median step s (min-max) | tokens/s | inter-node MB/step | peak RSS MB "
              "(above base) | model states MB/rank | vs best peer | final loss |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['system']} | | does not fit: model states {r['model_state_mb']:.1f} MB > budget "
                         f"| | | | {r['model_state_mb']:.1f} | | |")
            continue
        if r.get("not_run"):
            lines.append(f"| {r['system']} | | not reached within the run's time limit | | | | | | |")
            continue
        plan = (r["plan"].split("(")[-1].rstrip(")").replace("p/g/os = ", "") if r["plan"]
                else {"ddp": "1/1/1", "fsdp2": "N/N/N", "fsdp2_hsdp": "R/R/R"}[r["system"]])
        lines.append(f"| {r['system']} | {plan} | {r['median_step_s']:.3f} ({r['step_s_min']:.2f}-{r['step_s_max']:.2f}) "
                     f"| {r['tokens_per_s']:.0f} | {r['inter_node_mb_per_step']:.1f} | {r['peak_rss_mb']:.0f} "
                     f"({r['peak_over_base_mb']:.0f}) | {r['model_state_mb']:.1f} | {r.get('vs_best_peer', 0):.2f}x "
                     f"| {r['final_loss']:.5f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regime", required=True, choices=sorted(REGIMES))
    ap.add_argument("--systems", default=",".join(PEERS + AMSP))
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rate", help="override the regime's link rate (e.g. 100mbit, none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timed-steps", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=1)
    ap.add_argument("--budget-bytes-per-param", type=float)
    ap.add_argument("--timeout", type=float, default=900.0, help="wall-clock limit of the whole run")
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--markdown", help="append the table to this file")
    ap.add_argument("--work", help="folder for the spec, the ranks' logs and the raw results (default: a temporary "
                                   "one, removed after a successful run and kept after a failed one)")
    a = ap.parse_args()

    from models.llama import LlamaConfig

    reg = dict(REGIMES[a.regime])
    if a.rate:
        reg["rate"] = None if a.rate == "none" else a.rate
    if a.budget_bytes_per_param:
        reg["budget_bytes_per_param"] = a.budget_bytes_per_param
    numel = LlamaConfig(**TINY).num_params()
    world = a.nodes * a.ranks_per_node
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in PEERS + AMSP]
    if bad:
        raise SystemExit(f"unknown systems {bad}; choose from {PEERS + AMSP}")
    budget = reg.get("budget_bytes_per_param")
    device_memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world)
    state_budget = int(budget * numel) if budget else None
    spec = {"model": TINY, "numel": numel, "seed": 0, "lr": 3e-4, "nodes": a.nodes, "ranks_per_node": a.ranks_per_node,
            "rounds": a.rounds, "timed_steps": a.timed_steps, "warmup_steps": a.warmup_steps,
            "device_memory_bytes": device_memory, "state_budget_bytes": state_budget, "reserved_bytes": 0,
            "systems_all": systems, **reg}
    skipped = {}
    if budget:
        fits = fit_check(systems, spec, numel)
        skipped = {s: v for s, v in fits.items() if not v["fits"]}
        for s, v in fits.items():
            print(f"{s:12s} model states {v['model_state_bytes'] / 1e6:6.1f} MB/rank "
                  f"{'fits' if v['fits'] else 'DOES NOT FIT'} budget {state_budget / 1e6:.1f} MB")
    spec["systems"] = [s for s in systems if s not in skipped]

    # The spec, the ranks' logs and the raw results: kept where --work says, else in a temporary folder
    # that a successful run removes and a failed one keeps (and names) for its logs.
    tmp = a.work or tempfile.mkdtemp(prefix="amspb-shootout-")
    os.makedirs(tmp, exist_ok=True)
    rc = 1
    try:
        rc = _run(a, spec, skipped, reg, tmp)
    finally:
        if a.work is None and rc == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        elif rc != 0:
            print(f"shoot-out failed; its spec, rank logs and raw results are in {tmp}", file=sys.stderr)
    return rc


def _run(a, spec: dict, skipped: dict, reg: dict, tmp: str) -> int:
    spec["out"] = os.path.join(tmp, "raw.json")
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{os.cpu_count()} CPU cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
               f"{platform.machine()}, torch {_torch_version()}")
    print(f"shoot-out {a.regime}: {spec['systems']} on {a.nodes}x{a.ranks_per_node} ranks, links {reg['rate']}",
          flush=True)
    with nc.NetnsCluster(a.nodes, rate=reg["rate"]) as cl:
        res = cl.launch(nc.python_argv("shootout_worker.py", spec_path), a.ranks_per_node, a.timeout,
                        env=nc.repo_env(), threads_per_rank=1, log_dir=tmp)
    print(next((r.log for r in res.ranks if r.rank == 0), "")[-6000:])
    if not res.ok:
        print(res.failure_report(), file=sys.stderr)
        if not (res.timed_out and os.path.exists(spec["out"])):
            return 1
        print(f"time limit {a.timeout:.0f} s reached: reporting the configurations that finished", file=sys.stderr)
    with open(spec["out"]) as f:
        raw = json.load(f)
    rows = summarize(spec, raw, skipped)
    cmd = "python scripts/bench/shootout.py " + " ".join(sys.argv[1:])
    md = markdown(a.regime, spec, rows, raw, cmd, date, machine, res.wall_s)
    print(md)
    if raw.get("auto"):
        print(raw["auto"]["table"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"spec": spec, "raw": raw, "rows": rows, "date": date, "machine": machine,
                       "link_bytes_total": res.link_bytes}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(md + "\n")
    return 0


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
