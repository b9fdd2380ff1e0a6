"""The mesh's rank order and groups (pure: no processes)."""
import pytest

from amsp.errors import InputError
from amsp.parallel.mesh import Coords, ParallelMesh


def test_rank_order_tp_innermost_pp_outermost():
    m = ParallelMesh(world=16, ranks_per_node=8, tp=2, pp=2)
    assert m.dp == 4
    assert m.coords(0) == Coords(0, 0, 0) and m.coords(1) == Coords(0, 0, 1) and m.coords(2) == Coords(0, 1, 0)
    assert m.coords(8) == Coords(1, 0, 0)
    assert all(m.rank_of(m.coords(r)) == r for r in range(16))
    assert m.tp_ranks(5) == (4, 5)
    assert m.dp_ranks(5) == (1, 3, 5, 7)
    assert m.pp_ranks(5) == (5, 13)


def test_every_rank_in_exactly_one_group_of_each_kind():
    m = ParallelMesh(world=24, ranks_per_node=4, tp=2, pp=3)
    for groups, size in ((m.tp_groups(), 2), (m.dp_groups(), 4), (m.pp_groups(), 3)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(24)) and all(len(g) == size for g in groups)
    for r in range(24):  # TP groups never leave a node
        assert len({x // 4 for x in m.tp_ranks(r)}) == 1


def test_dp_topology_names_global_ranks_and_real_nodes():
    m = ParallelMesh(world=16, ranks_per_node=4, tp=2, pp=1)
    t = m.dp_topology(3)
    assert t.world == 8 and t.ranks_per_node == 2 and t.members == (1, 3, 5, 7, 9, 11, 13, 15)
    assert t.shard_groups(2) == [(1, 3), (5, 7), (9, 11), (13, 15)]
    assert t.replica_groups(4) == [(1, 9), (3, 11), (5, 13), (7, 15)]
    assert not t.crosses_nodes((1, 3)) and t.crosses_nodes((3, 5))
    assert t.position(9) == 4
    # a DP group smaller than a node's share: the whole group sits in one node
    small = ParallelMesh(world=8, ranks_per_node=8, tp=2, pp=2).dp_topology(0)
    assert small.world == 2 and small.ranks_per_node == 2 and not small.crosses_nodes(small.members)


@pytest.mark.parametrize("kw, words", [
    (dict(world=8, ranks_per_node=4, tp=8), "inside a node"),
    (dict(world=8, ranks_per_node=8, tp=3), "not divisible"),
    (dict(world=8, ranks_per_node=8, tp=0), ">= 1"),
])
def test_bad_degrees_are_one_line_input_errors(kw, words):
    with pytest.raises(InputError, match=words):
        ParallelMesh(**kw)


def test_a_stage_straddling_a_node_is_refused_naming_the_pp_that_work():
    # 6 ranks on nodes of 2, pp 2: a stage of 3 ranks puts 2 DP ranks on one node and 1 on the next
    with pytest.raises(InputError, match=r"parallel.pp=2 .* unequal ranks per node.*; use parallel.pp in \[1, 3, 6\]"):
        ParallelMesh(world=6, ranks_per_node=2, tp=1, pp=2)
    # a stage of 6 inside nodes of 8 (tp 2 x dp 3): stage 1 = ranks 6..11 spans two nodes unevenly
    with pytest.raises(InputError, match="neither fits inside a node of 8 ranks nor fills whole nodes"):
        ParallelMesh(world=24, ranks_per_node=8, tp=2, pp=4)


def test_every_accepted_layout_gives_dp_groups_their_true_node_shape():
    """Over every small layout: the mesh refuses it, or each DP group has exactly its Topology's
    ranks_per_node members on each of its Topology's nodes (what the engine's groups and byte counts assume)."""
    accepted = refused = 0
    for world in range(1, 25):
        for rpn in (r for r in range(1, world + 1) if world % r == 0):
            for tp in (t for t in range(1, rpn + 1) if rpn % t == 0):
                for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0):
                    try:
                        m = ParallelMesh(world=world, ranks_per_node=rpn, tp=tp, pp=pp)
                    except InputError as e:
                        assert "unequal ranks per node" in str(e), (world, rpn, tp, pp, e)
                        refused += 1
                        continue
                    accepted += 1
                    for topo in m.dp_topologies():
                        per_node: dict = {}
                        for r in topo.members:
                            per_node[r // rpn] = per_node.get(r // rpn, 0) + 1
                        assert set(per_node.values()) == {topo.ranks_per_node}, (world, rpn, tp, pp, per_node)
                        assert len(per_node) == topo.nodes, (world, rpn, tp, pp, per_node)
    assert accepted > 100 and refused > 10
