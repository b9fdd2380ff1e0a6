"""Rank program for the harness's `allreduce` check: time an all-reduce flat and hierarchically.

flat:          one all_reduce over all ranks.
hierarchical:  reduce_scatter inside the node, all_reduce of the 1/R shard among the ranks with the
               same local rank (one per node, R such groups at once), all_gather inside the node.
reduce_scatter / all_gather: one flat call over all ranks (tensor = the full-size side), to see
               what gloo's algorithms put on the links (a ring moves (n-1)/n of it per crossing).
Run by netns_cluster.py inside the emulated nodes (reads the torchrun variables it sets).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def link_bytes(ifname: str = "eth0") -> int:
    """Bytes this node's link has sent so far (the namespace's own /sys view)."""
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=32.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="flat,hierarchical")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpn = int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    nodes = world // rpn
    intra = [dist.new_group(list(range(n * rpn, (n + 1) * rpn))) for n in range(nodes)]
    inter = [dist.new_group(list(range(lr, world, rpn))) for lr in range(rpn)]
    my_intra, my_inter = intra[rank // rpn], inter[rank % rpn]

    numel = int(a.mb * 1e6 / 4)
    numel -= numel % world
    x = torch.ones(numel)
    shard = torch.empty(numel // rpn)
    world_shard = torch.ones(numel // world)
    results = {}
    for mode in a.modes.split(","):
        times, sent = [], []
        for _ in range(a.repeats + 1):  # first call warms up connections
            dist.barrier()
            b0 = link_bytes()
            t0 = time.perf_counter()
            if mode == "flat":
                dist.all_reduce(x)
            elif mode == "hierarchical":
                dist.reduce_scatter_tensor(shard, x, group=my_intra)
                if nodes > 1:
                    dist.all_reduce(shard, group=my_inter)
                dist.all_gather_into_tensor(x, shard, group=my_intra)
            elif mode == "reduce_scatter":  # flat, over all ranks: what crosses the links per call
                dist.reduce_scatter_tensor(world_shard, x)
            elif mode == "all_gather":
                dist.all_gather_into_tensor(x, world_shard)
            else:
                raise SystemExit(f"unknown mode {mode!r}; expected flat, hierarchical, reduce_scatter or all_gather")
            t = time.perf_counter() - t0
            dist.barrier()
            times.append(t)
            sent.append(link_bytes() - b0)
            x.fill_(1.0)
        t_all = torch.tensor(times[1:])
        dist.all_reduce(t_all, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
        results[mode] = {"median_s": round(statistics.median(t_all.tolist()), 4),
                         "times_s": [round(v, 4) for v in t_all.tolist()],
                         "node_tx_bytes_per_call": statistics.median(sent[1:])}
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"tensor_mb": a.mb, "world": world, "results": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
