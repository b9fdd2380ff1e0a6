"""Seconds of one collective call on the cluster: ring and tree algorithms over k ranks on each of m
nodes, with a node's NICs shared by every group that crosses them at the same time.

Notation: a call of `kind` moves S bytes per rank (amsp.schedule's convention: all_gather output,
reduce_scatter input, all_reduce buffer) over a group of n = k*m ranks; R ranks per node; the
bandwidth curves are read at the per-step chunk c = S / n (cluster.py's lookup convention); alpha_i /
alpha_e are the per-step latencies inside a node / across nodes; f = (n-1)/n (x2 for all_reduce).

  one node (m = 1), ring:       steps * alpha_i + S f / intra(c)           steps = n-1 (2(n-1) all_reduce)
  several nodes, ring:          (steps - x) * alpha_i + x * alpha_e + max(S f / intra(c) if k > 1,
                                                                          (R/k) * S f / inter(c))
      x = m-1 steps cross a node boundary for all_gather / reduce_scatter, 2m for all_reduce (NCCL's
      count, src/graph/tuning.cc). A ring crosses each node boundary once per direction, so one
      group pushes S f through a node's NICs whatever k is; the R/k groups of the same collective on
      that node run at once (each rank is in exactly one of them, for the strided layouts too) and
      share the NICs.
  several nodes, all_reduce:    NCCL picks the faster of the ring and the hierarchical tree; the
      tree is priced per level: a chain inside the node (2(k-1) steps of alpha_i, S over NVLink each
      way) feeding a double binary tree across nodes (2 ceil(log2 m) hops of alpha_e, about 2S through
      each node's NICs per group, shared as above); the levels pipeline, so their bandwidth terms
      overlap (max) and their latencies add.

Concurrent phases (the next unit's prefetch gather and the previous unit's reduce-scatter in
backward) are not priced here: the cost model adds their seconds inside one compute window, which is
what sharing one set of NICs (and NVLink ports) between them costs.
"""
from __future__ import annotations

import math

from .cluster import ClusterSpec, ring_factor


def ring_seconds(c: ClusterSpec, kind: str, nbytes: float, n: int, k: int, m: int) -> float:
    f = ring_factor(kind, n)
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    chunk = nbytes / n
    if m == 1:
        return steps * c.latency_s("intra") + nbytes * f / (c.busbw_gbps(kind, "intra", chunk) * 1e9)
    cross = 2 * m if kind == "all_reduce" else m - 1
    cross = min(cross, steps)
    lat = (steps - cross) * c.latency_s("intra") + cross * c.latency_s("inter")
    share = c.ranks_per_node / k
    t_inter = share * nbytes * f / (c.busbw_gbps(kind, "inter", chunk) * 1e9)
    t_intra = nbytes * f / (c.busbw_gbps(kind, "intra", chunk) * 1e9) if k > 1 else 0.0
    return lat + max(t_inter, t_intra)


def tree_all_reduce_seconds(c: ClusterSpec, nbytes: float, n: int, k: int, m: int) -> float:
    """Hierarchical all_reduce across m > 1 nodes: intra-node chain + inter-node double binary tree.
    Tree hops are charged the ring's per-step latencies (NCCL's table puts a network tree hop between
    its LL and Simple ring figures), and the bandwidth is read at the same per-rank chunk as the ring."""
    chunk = nbytes / n
    lat = 2 * (k - 1) * c.latency_s("intra") + 2 * math.ceil(math.log2(m)) * c.latency_s("inter")
    share = c.ranks_per_node / k
    t_inter = share * 2 * nbytes / (c.busbw_gbps("all_reduce", "inter", chunk) * 1e9)
    t_intra = 2 * nbytes / (c.busbw_gbps("all_reduce", "intra", chunk) * 1e9) if k > 1 else 0.0
    return lat + max(t_inter, t_intra)


def collective_seconds(c: ClusterSpec, kind: str, nbytes: float, n: int, k: int, m: int) -> float:
    """Seconds of one call; 0 for a group of one rank (nothing to exchange)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    t = ring_seconds(c, kind, nbytes, n, k, m)
    if kind == "all_reduce" and m > 1:
        t = min(t, tree_all_reduce_seconds(c, nbytes, n, k, m))
    return t
