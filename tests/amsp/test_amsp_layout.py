"""The nesting layout, proved by simulating every collective of a step on plain tensors (no processes):
for every valid plan on several cluster shapes, each transfer is a plain collective over the group
amsp/topology.py names (members in ascending rank order), and every rank ends with exactly its
shard of the summed gradient and of the updated weights."""
from __future__ import annotations

import pytest
import torch

from amsp.flat_buffer import ShardLayout
from amsp.groups import group_lists
from amsp.plan import enumerate_degrees
from amsp.topology import Topology

SHAPES = [(4, 2), (8, 4), (8, 2), (16, 4), (12, 4), (6, 3), (8, 8)]


def _reduce_scatter(inputs: dict[int, torch.Tensor], group: tuple[int, ...]) -> dict[int, torch.Tensor]:
    total = sum(inputs[r] for r in group)
    return {r: blk for r, blk in zip(group, total.chunk(len(group)))}


def _all_gather(inputs: dict[int, torch.Tensor], group: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([inputs[r] for r in group])


def _group(rank, groups):
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize("world,rpn", SHAPES)
def test_layout_every_plan(world, rpn):
    topo = Topology(world, rpn)
    plans = enumerate_degrees(world, rpn)
    assert plans
    for deg in plans:
        for numel in (1, 37, 5 * deg.os):
            lay = ShardLayout(numel, deg)
            groups = group_lists(deg, topo)
            gen = torch.Generator().manual_seed(numel * 31 + deg.os)
            grads = {r: torch.randint(-50, 50, (lay.padded,), generator=gen).double() for r in range(world)}
            weights = torch.randint(-50, 50, (lay.padded,), generator=gen).double()
            where = f"N={world} R={rpn} p/g/os={deg} numel={numel}"
            for r in range(world):  # nesting: OS shard inside G shard inside P shard
                (o0, o1), (g0, g1), (p0, p1) = lay.os_range(r), lay.g_range(r), lay.p_range(r)
                assert p0 <= g0 <= o0 < o1 <= g1 <= p1, where
                assert (o1 - o0, g1 - g0, p1 - p0) == (lay.chunk, lay.g_size, lay.p_size), where
            for os_group in topo.shard_groups(deg.os):  # the OS chunks of an OS group partition the buffer
                assert sorted(lay.os_chunk(r) for r in os_group) == list(range(deg.os)), where

            # G reduce-scatter over g consecutive ranks, send buffer in the permuted order.
            g_shard = {}
            for grp in groups["g"]:
                g_shard.update(_reduce_scatter({r: lay.grad_send_order(grads[r]) for r in grp}, grp))
            if deg.g == 1:
                g_shard = dict(grads)
            for r in range(world):
                lo, hi = lay.g_range(r)
                want = sum(grads[q] for q in _group(r, groups["g"]))[lo:hi]
                assert torch.equal(g_shard[r], want), f"{where}: G shard of rank {r}"
            # G -> OS reduce-scatter: plain, on the G shard, over the stride-g group.
            os_shard = {}
            for grp in groups["g_to_os"]:
                os_shard.update(_reduce_scatter({r: g_shard[r] for r in grp}, grp) if len(grp) > 1
                                else {grp[0]: g_shard[grp[0]]})
            # OS replica all-reduce: every member holds the same chunk.
            for grp in groups["os_replica"]:
                assert len({lay.os_range(r) for r in grp}) == 1, where
                total = sum(os_shard[r] for r in grp)
                for r in grp:
                    os_shard[r] = total
            full_sum = sum(grads.values())
            for r in range(world):
                lo, hi = lay.os_range(r)
                assert torch.equal(os_shard[r], full_sum[lo:hi]), f"{where}: OS grad of rank {r}"
            # Spread: all-gather of OS chunks over the stride-p group, permuted into the P shard.
            p_shard = {}
            for grp in groups["spread"]:
                got = _all_gather({r: weights[slice(*lay.os_range(r))] for r in grp}, grp)
                for r in grp:
                    out = torch.empty(lay.p_size, dtype=torch.float64)
                    lay.spread_to_p_order(got, out)
                    p_shard[r] = out
            for r in range(world):
                assert torch.equal(p_shard[r], weights[slice(*lay.p_range(r))]), f"{where}: P shard of rank {r}"
            # P all-gather: plain, the concatenation is the full buffer.
            for grp in groups["p"]:
                assert torch.equal(_all_gather(p_shard, grp), weights), where
