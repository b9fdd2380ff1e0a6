"""Rank program of the shoot-out (started by shootout.py inside the emulated nodes).

One process group runs every configuration in turn, in rounds, rotating the order each round, so
all systems see the same machine conditions. Per configuration and round:
  build the runner (same model, seed, micro-batches) -> warm-up steps -> timed steps -> close.
Measured per timed step: wall time (barrier before, max over ranks), bytes that left each node over
its link (eth0 tx counter of the node's namespace, read by local rank 0 between barriers), and per
rank the peak resident set (VmHWM, reset through /proc/self/clear_refs before the build).
The AMSP automatic plan is chosen here, on the real ranks, by train.py's startup planner (its probe and
compute profile measured on them).
"""
from __future__ import annotations

import ctypes
import datetime
import gc
import json
import logging
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import peers  # noqa: E402
from models.llama import LlamaConfig  # noqa: E402

_libc = ctypes.CDLL("libc.so.6")


def link_tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))


def reset_peak_rss() -> int:
    """Return memory freed by the previous configuration to the OS, reset VmHWM; current RSS (bytes)."""
    gc.collect()
    _libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size to the current one (Linux >= 4.0)
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def make_batches(cfg: LlamaConfig, spec: dict, rank: int, world: int):
    """The same global batch for every system: micro-batches of this rank, fixed by the seed."""
    g = torch.Generator().manual_seed(spec["seed"] + 7)
    m, b, s = spec["micro_batches"], spec["micro_batch_size"], spec["seq_len"]
    tokens = torch.randint(0, cfg.vocab_size, (world, m, b, s + 1), generator=g)
    return [(tokens[rank, i, :, :-1].contiguous(), tokens[rank, i, :, 1:].contiguous()) for i in range(m)]


# ---------------------------------------------------------------- planner

def choose_auto_plan(spec: dict, cache_dir: str):
    """The plan train.py's startup chooses for this run (amsp.planner.startup.plan_for_run: the collective
    probe's curves merged into the cpu preset, the compute profile measured on these ranks, the engine's
    own switches as peers.py builds it, e.g. the spread not overlapped), so the shoot-out measures the
    product's choice. A fresh cache directory: nothing measured by another run (or on a busier machine)
    is reused. Collective: every rank takes part in the probe and the compute timing."""
    from amsp.launch import DistEnv
    from amsp.planner.__main__ import compose_config
    from amsp.planner.startup import plan_for_run

    rank, world = dist.get_rank(), dist.get_world_size()
    overrides = [f"model.{k}={v}" for k, v in spec["model"].items()]
    overrides += [f"data.seq_len={spec['seq_len']}", f"trainer.micro_batch_size={spec['micro_batch_size']}",
                  f"trainer.global_batch_size={spec['micro_batch_size'] * spec['micro_batches'] * world}",
                  "trainer.dtype=fp32", f"amsp.grad_comm={spec['precision']}", "amsp.overlap_spread=false",
                  f"amsp.ranks_per_node={spec['ranks_per_node']}",
                  f"cluster.device_memory_gib={spec['device_memory_bytes'] / 2**30}",
                  f"amsp.planner.reserved_gib={spec.get('reserved_bytes', 0) / 2**30}",
                  f"amsp.planner.memory_margin={spec.get('memory_margin', 0.08)}",
                  f"amsp.planner.cache_dir={cache_dir}"]
    if spec.get("state_budget_bytes"):
        overrides.append(f"amsp.planner.state_budget_gib={spec['state_budget_bytes'] / 2**30}")
    denv = DistEnv(rank=rank, world_size=world, local_rank=int(os.environ["LOCAL_RANK"]),
                   local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), launcher="torchrun")
    return plan_for_run(compose_config(overrides), denv, "cpu")


# ---------------------------------------------------------------- one configuration

def run_config(system: str, plan, cfg: LlamaConfig, spec: dict, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    local0 = int(os.environ["LOCAL_RANK"]) == 0
    base_rss = reset_peak_rss()
    dist.barrier()
    t_build = time.perf_counter()
    runner = peers.make_runner(system, cfg, spec["seed"], spec["precision"], spec["lr"], spec["nodes"],
                               spec["ranks_per_node"], plan)
    build_s = time.perf_counter() - t_build
    losses, times, tx = [], [], []
    for step in range(spec["warmup_steps"] + spec["timed_steps"]):
        dist.barrier()
        b0 = link_tx_bytes() if local0 else 0
        t0 = time.perf_counter()
        losses.append(runner.train_step(batches))
        dt = time.perf_counter() - t0
        dist.barrier()
        b1 = link_tx_bytes() if local0 else 0
        if step >= spec["warmup_steps"]:
            times.append(dt)
            tx.append(b1 - b0)
    state_bytes = runner.model_state_bytes()
    runner.close()
    del runner
    peak = peak_rss()
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    sent = torch.tensor(tx, dtype=torch.float64)
    dist.all_reduce(sent)  # only each node's local rank 0 contributed its node's counter
    mem = torch.tensor([peak, base_rss, state_bytes], dtype=torch.float64)
    mems = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(mems, mem)
    return {"step_s": t.tolist(), "inter_node_bytes": sent.tolist(), "losses": losses, "build_s": build_s,
            "peak_rss": [int(m[0]) for m in mems], "base_rss": [int(m[1]) for m in mems],
            "model_state_bytes": [int(m[2]) for m in mems]}


def write_results(path: str, results: dict, plans: dict, auto_info: dict | None, complete: bool) -> None:
    out = {"results": {k: v for k, v in results.items() if v}, "plans": {s: str(p) for s, p in plans.items()},
           "complete": complete}
    if auto_info:
        out["auto"] = {"plan": str(auto_info["plan"]), "table": auto_info["table"]}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    timeout = datetime.timedelta(seconds=spec.get("collective_timeout_s", 300))
    dist.init_process_group("gloo", timeout=timeout)
    from amsp import control

    control.setup(timeout)  # the AMSP engine's groups take their timeout from the control plane
    rank, world = dist.get_rank(), dist.get_world_size()
    # Rank 0's log (what shootout.py prints) carries the startup planner's measurements and choice
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cfg = LlamaConfig(**spec["model"])
    batches = make_batches(cfg, spec, rank, world)
    from amsp.plan import make_plan

    plans, auto_info = {}, None
    systems = list(spec["systems"])
    if "amsp:auto" in systems:
        res = choose_auto_plan(spec, os.path.join(os.path.dirname(spec["out"]), "planner_cache"))
        auto_info = {"plan": res.plan, "table": res.table}
        plans["amsp:auto"] = auto_info["plan"]
    for s in systems:
        if s.startswith("amsp:") and s != "amsp:auto":
            plans[s] = make_plan(s.split(":", 1)[1], world, spec["ranks_per_node"])
    results: dict[str, list] = {s: [] for s in systems}
    t_start = time.monotonic()
    for r in range(spec["rounds"]):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            results[s].append(run_config(s, plans.get(s), cfg, spec, batches))
            if rank == 0:
                last = results[s][-1]
                print(f"round {r} {s:14s} step {statistics.median(last['step_s']):.3f} s  "
                      f"link {statistics.median(last['inter_node_bytes']) / 1e6:.1f} MB  "
                      f"loss {last['losses'][-1]:.5f}  ({time.monotonic() - t_start:.0f} s)", flush=True)
                # Written after every configuration, so a run stopped by its time limit keeps what it measured.
                write_results(spec["out"], results, plans, auto_info, complete=False)
    if rank == 0:
        write_results(spec["out"], results, plans, auto_info, complete=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
