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


def _startup_cfg(*overrides):
    from amsp.launch import DistEnv
    from amsp.planner.__main__ import compose_config
    from configs.schema import to_llama_config

    cfg = compose_config(["model=debug", *overrides])
    return cfg, to_llama_config(cfg.model), DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4,
                                                    launcher="torchrun")


def test_startup_times_tp_for_a_sequence_it_does_not_split():
    """The TP degrees startup times (the joint planner's candidates): without sequence parallelism the
    sequence need not divide by tp; they were all left out for data.seq_len=63 (the debug model's 2 kv
    heads allow tp 2 on 4 ranks a node)."""
    from amsp.parallel.joint_startup import measured_tp_degrees

    for sp, tps in (("true", []), ("false", [2])):
        assert measured_tp_degrees(*_startup_cfg("data.seq_len=63", f"parallel.sequence_parallel={sp}")) == tps


def test_a_tp_startup_cannot_time_is_one_line_naming_those_it_can(monkeypatch):
    """It was a bare ValueError (a traceback, exit 1) whose reason left out the sequence and the MLP."""
    from amsp.errors import classify
    from amsp.parallel import joint_startup
    from amsp.planner.compute_profile import ComputeProfile
    from amsp.planner.startup import tp_local_profile

    cfg, model, denv = _startup_cfg("parallel.tp=4")
    monkeypatch.setattr(joint_startup, "measured_tp_units", lambda *a, **k: {})
    with pytest.raises(ValueError) as err:
        tp_local_profile(ComputeProfile(0.01, 0.02, 0.005, 0.001, None, "measured"), cfg, model, denv, "cpu", 4)
    assert classify(err.value) == (2, "config error")
    assert "measurable tp: [2]" in str(err.value) and "with sequence parallelism, data.seq_len" in str(err.value)


def test_a_joint_choice_without_a_mesh_recomputes_through_the_model_config():
    """parallel.auto choosing tp = pp = 1 with recomputation: nothing reads parallel.recompute_stages without a
    mesh, so the recomputation the planner priced (full, or none) goes to model.activation_checkpointing."""
    from types import SimpleNamespace

    from amsp.parallel.joint_startup import with_joint_plan
    from tests.test_presets import composed

    cfg = composed("model=debug", "parallel.auto=true")
    for tp, pp, recompute, want in ((1, 1, [True], "full"), (1, 1, [False], "none"), (2, 1, [True], None)):
        plan = SimpleNamespace(tp=tp, pp=pp, layer_split=[2], recompute=recompute, micro_batch_size=2)
        out = with_joint_plan(cfg, plan)
        if want is None:  # a mesh: its stages read the list
            assert list(out.parallel.recompute_stages) == recompute
            assert out.model.activation_checkpointing == cfg.model.activation_checkpointing
        else:
            assert out.parallel.recompute_stages is None and out.model.activation_checkpointing == want
