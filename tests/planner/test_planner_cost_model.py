"""Cost model: group layouts, the schedule contract (byte totals), memory and activation formulas,
the NIC-sharing rule, and that the per-group terms add up to the whole-plan evaluation."""
from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest
import torch

from amsp.plan import Degrees, Plan, enumerate_degrees, make_plan
from amsp.planner.cost_model import CostModel, Options, layout
from amsp.planner.exhaustive import grid
from amsp.planner.terms import GroupTerms
from amsp.planner.workload import Kernels
from amsp.schedule import step_collectives, totals
from amsp.topology import Topology
from models.llama.config import LlamaConfig, get_preset
from planner_cases import flat_cluster, workload

SHAPES = [(4, 2), (8, 4), (8, 1), (12, 4), (16, 4), (32, 8)]


def _topology_layout(topo: Topology, key: str, d: Degrees) -> tuple[int, int, int]:
    groups = {"p": topo.shard_groups(d.p), "g": topo.shard_groups(d.g), "g_to_os": topo.strided_within(d.os, d.g),
              "spread": topo.strided_within(d.os, d.p), "os_replica": topo.replica_groups(d.os),
              "world": topo.shard_groups(topo.world)}[key]
    shapes = set()
    for g in groups:  # every group of a collective has the same shape
        nodes = Counter(topo.node_of(r) for r in g)
        shapes.add((len(g), max(nodes.values()), len(nodes)))
    assert len(shapes) == 1, (key, d, shapes)
    return shapes.pop()


@pytest.mark.parametrize("world,rpn", SHAPES)
def test_layout_matches_topology(world, rpn):
    topo = Topology(world, rpn)
    for d in enumerate_degrees(world, rpn):
        for key in ("p", "g", "g_to_os", "spread", "os_replica", "world"):
            assert layout(key, d, rpn, world) == _topology_layout(topo, key, d), (key, d)


@pytest.mark.parametrize("world,rpn", SHAPES)
@pytest.mark.parametrize("tied", [False, True])
def test_collective_bytes_equal_schedule_for_every_plan(world, rpn, tied):
    """The contract of amsp/schedule.py: the cost model prices exactly the collectives the engine
    runs, so their byte totals per (kind, group size, intra/inter) and per phase are equal."""
    cfg = get_preset("debug").with_overrides(tie_embeddings=tied, vocab_size=509)  # odd sizes: padding
    precision, m = ("fp32", 3) if tied else ("bf16", 1)
    w = workload(cfg, micro_batches=m, precision=precision)
    model = CostModel(w, flat_cluster(world // rpn, rpn))
    topo = Topology(world, rpn)
    cands = model.candidates()
    # Units are priced independently, so every triple on both groups plus mixed pairs cover every plan.
    mixed = random.Random(world).sample(list(itertools.product(cands, cands)), min(20, len(cands) ** 2))
    for blocks, eh in [(d, d) for d in cands] + mixed:
        plan = Plan(blocks, eh)
        ours = model.evaluate(plan).collectives
        ref = step_collectives(w.units(), {"blocks": blocks, "embed_head": eh}, topo, m, w.precision)
        assert totals(ours) == totals(ref), plan
        key = lambda x: (x.phase, x.kind, x.unit, x.group_size, x.crosses_nodes, x.bytes, x.count)  # noqa: E731
        assert sorted(map(key, ours)) == sorted(map(key, ref)), plan


@pytest.mark.parametrize("tied", [False, True])
def test_units_are_the_engines_units(tied):
    """Same units, names and sizes as amsp/engine.py builds from the model's modules (built from the
    model's own module classes; the whole Llama would load the fused-kernel extension)."""
    from models.llama.model import OutputHead, TransformerBlock

    cfg = get_preset("debug").with_overrides(tie_embeddings=tied)
    with torch.device("meta"):
        emb = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
        layers = [TransformerBlock(cfg, i, "sdpa", "torch") for i in range(cfg.n_layers)]
        head = OutputHead(cfg, "torch")
    count = lambda mods: sum(p.numel() for mod in mods for p in mod.parameters())  # noqa: E731
    blocks = [(f"layers.{i}", count([b])) for i, b in enumerate(layers)]
    if tied:
        expected = [("embed_head", count([emb, head]))] + blocks
    else:
        expected = [("tok_embeddings", count([emb]))] + blocks + [("head", count([head]))]
    assert [(u.name, u.numel) for u in workload(cfg).units()] == expected


@pytest.mark.parametrize("world,rpn,tied,spread", [(16, 4, False, True), (32, 8, True, False), (64, 8, False, False)])
def test_group_terms_add_up_to_whole_plan(world, rpn, tied, spread):
    """The ILP's objective (constant + per-group terms) equals the unit-by-unit evaluation."""
    cfg = get_preset("tiny").with_overrides(tie_embeddings=tied)
    model = CostModel(workload(cfg, seq_len=128, micro_batches=3), flat_cluster(world // rpn, rpn, latency_us=3),
                      Options(overlap_spread=spread))
    t = GroupTerms.build(model)
    time, memory = grid(t)
    rng = random.Random(world)
    for _ in range(40):
        i, j = rng.randrange(len(t.candidates)), rng.randrange(len(t.candidates))
        c = model.evaluate(Plan(t.candidates[i], t.candidates[j]))
        assert c.step_time_s == pytest.approx(time[i, j], rel=1e-12)
        assert c.memory_total - c.memory["reserved"] == pytest.approx(memory[i, j], rel=1e-12)


def test_model_state_bytes_follow_the_degrees():
    """P in the compute dtype, G in fp32, OS 12 bytes (master, m, v) or 8 in fp32 (the weights are the
    master), each divided by its degree."""
    w = workload("tiny", precision="bf16")
    model = CostModel(w, flat_cluster(2, 8))
    n = w.params_per_rank()
    ddp = model.evaluate(make_plan("ddp", 16, 8)).memory
    assert (ddp["params"], ddp["grads"], ddp["optim"]) == (2 * n, 4 * n, 12 * n)
    z3 = model.evaluate(make_plan("zero3", 16, 8)).memory
    padded = sum(-(-u.numel // 16) * 16 for u in w.units())
    assert (z3["params"], z3["grads"], z3["optim"]) == (2 * padded // 16, 4 * padded // 16, 12 * padded // 16)
    assert z3["gathered"] > 0 and ddp["gathered"] == 0  # gathered weights only when p > 1
    # fp32: the weights are the master, so OS holds only the two moments (8 bytes).
    w32 = workload("tiny", precision="fp32")
    ddp32 = CostModel(w32, flat_cluster(2, 8)).evaluate(make_plan("ddp", 16, 8)).memory
    n32 = w32.params_per_rank()
    assert (ddp32["params"], ddp32["grads"], ddp32["optim"]) == (4 * n32, 4 * n32, 8 * n32)


def test_os_gradients_held_for_the_step_are_counted_where_they_get_a_buffer():
    """The fp32 OS-shard gradient of every unit lives from the sync to the optimizer step: its own
    buffer when the G->OS reduce-scatter makes it (os > g) or bf16 traffic is widened back to fp32,
    a view of the G shard otherwise (amsp.flat_unit). Under gloo (the cpu device) the step phase also
    holds the copies of two neighbouring units' G shards whose G->OS reduce-scatters are in flight."""
    w32 = workload("tiny", precision="fp32")
    m32 = CostModel(w32, dataclasses.replace(flat_cluster(2, 8), device="cuda"))
    sizes = [-(-u.numel // 16) * 16 for u in w32.units()]  # forward order
    padded = sum(sizes)
    assert m32.evaluate(make_plan("ddp", 16, 8)).memory["grad_sync"] == 0
    assert m32.evaluate(make_plan("zero2", 16, 8)).memory["grad_sync"] == 0  # os == g: a view
    assert m32.evaluate(make_plan("zero1", 16, 8)).memory["grad_sync"] == 4 * padded // 16
    gloo = CostModel(w32, flat_cluster(2, 8))
    copies = 4 * max(a + b for a, b in zip(sizes, sizes[1:]))  # g = 1: whole fp32 G shards
    assert gloo.evaluate(make_plan("zero1", 16, 8)).memory["grad_sync"] == 4 * padded // 16 + copies
    assert gloo.evaluate(make_plan("zero2", 16, 8)).memory["grad_sync"] == 0  # os == g: no reduce-scatter
    w16 = workload("tiny", precision="bf16")  # bf16 gradient traffic
    ddp16 = CostModel(w16, flat_cluster(2, 8)).evaluate(make_plan("ddp", 16, 8)).memory
    assert ddp16["grad_sync"] == 4 * w16.params_per_rank()


def test_activation_formula_and_recomputation_order():
    cfg = get_preset("llama2_7b")
    w = workload(cfg, seq_len=4096, mbs=1, precision="bf16")
    h, f, t = 4096, cfg.ffn_hidden_dim, 4096
    # fused norms keep their inputs (2h), the linears their inputs (2h), Q K V and the attention output
    # (4h), the fused SwiGLU gate, up and product (3f); all bf16
    assert w.layer_activation_bytes("none") == (8 * h + 3 * f) * 2 * t
    eager = workload(cfg, seq_len=4096, mbs=1, precision="bf16", kernels=Kernels())
    # the reference norms keep an fp32 input and a bf16 normalised output each, SiLU its input besides
    assert eager.layer_activation_bytes("none") == (2 * (4 + 2) * h + (6 * h + 4 * f) * 2) * t
    tp2 = workload(cfg, seq_len=4096, mbs=1, precision="bf16", tp=2)
    # sequence-parallel norms run the reference on half the positions; the linears' inputs are
    # all-gathered (whole sequence); heads and the MLP split in two
    assert tp2.layer_activation_bytes("none") == (2 * (4 + 2) * h / 2 + (2 * h + (4 * h + 3 * f) / 2) * 2) * t
    assert w.layer_activation_bytes("full") == h * 2 * t
    none, sel, full = (workload(cfg, seq_len=4096, mbs=1, recompute=r).activation_bytes()
                       for r in ("none", "selective", "full"))
    assert full < sel < none
    gqa = LlamaConfig(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8)
    assert workload(gqa).layer_activation_bytes() < workload(gqa.with_overrides(n_kv_heads=32)).layer_activation_bytes()
    repeated = Kernels(fused=workload(gqa).run_kernels.fused, kv_repeated=True)  # SDPA on CPU: K/V copied per head
    assert workload(gqa, kernels=repeated).layer_activation_bytes() == \
        workload(gqa.with_overrides(n_kv_heads=32)).layer_activation_bytes()


def test_a_node_nics_are_shared_by_its_concurrent_groups():
    """DESIGN §3: DDP's all_reduce of S (k = R, one group per node) and the all_reduce of S/R shards
    among one rank per node (k = 1, R groups side by side) put the same bytes through a node's NICs."""
    model = CostModel(workload(), flat_cluster(16, 8, intra_gbps=1e6, inter_gbps=10.0, curves=False))
    s = 2**28
    ddp = model.price("grad_replica", "all_reduce", "x", 128, 8, 16, s, 1).seconds
    hier = model.price("grad_replica", "all_reduce", "x", 16, 1, 16, s // 8, 1).seconds
    assert hier == pytest.approx(ddp * (15 / 16) / (127 / 128), rel=1e-9)  # ring factors 2(n-1)/n
    # Without the sharing rule the hierarchical one would look 8x cheaper:
    assert hier > 4 * (s // 8) * 2 * 15 / 16 / 10e9


@pytest.mark.parametrize("world,rpn", [(16, 4), (32, 8), (64, 8)])
def test_nic_sharing_counts_the_groups_crossing_a_node(world, rpn):
    """comm_time charges a node's NICs R/k times one group's traffic: exactly the number of groups of
    the collective that have members on that node (each rank is in one of them), also for the
    strided layouts (g_to_os, spread, os_replica)."""
    topo = Topology(world, rpn)
    for d in enumerate_degrees(world, rpn):
        groups = {"p": topo.shard_groups(d.p), "g_to_os": topo.strided_within(d.os, d.g),
                  "spread": topo.strided_within(d.os, d.p), "os_replica": topo.replica_groups(d.os)}
        for key, gs in groups.items():
            n, k, m = layout(key, d, rpn, world)
            if m > 1:
                on_node0 = sum(1 for g in gs if any(topo.node_of(r) == 0 for r in g))
                assert on_node0 == rpn // k, (key, d)


def test_bandwidth_curves_are_read_at_the_per_rank_chunk():
    """cluster.py's convention: an NCCL-tests size S measured on n ranks is the point S/n, and the
    cost model reads a call of S bytes over n ranks at S/n."""
    from amsp.planner.cluster import BandwidthCurve
    from amsp.planner.comm_time import collective_seconds

    curve = BandwidthCurve.from_totals([(16 * 2**20, 50.0), (256 * 2**20, 100.0)], ranks=16)
    assert curve.points == ((2**20, 50.0), (16 * 2**20, 100.0))
    c = dataclasses.replace(flat_cluster(1, 8, curves=False), curves={("all_gather", "intra"): curve})
    s = 8 * 2**20  # 1 MiB steps over 8 ranks: the 50 GB/s point, not the 8 MiB one
    assert collective_seconds(c, "all_gather", s, 8, 8, 1) == pytest.approx(s * 7 / 8 / 50e9)


def test_no_parameter_sharding_across_nodes_for_nothing():
    """Memory to spare, several micro-batches: P and G stay inside a node (AMSP's finding)."""
    from amsp.planner.solve import plan_cluster

    w = workload("llama2_7b", seq_len=2048, mbs=1, micro_batches=8, recompute="selective")
    res = plan_cluster(w, flat_cluster(32, 8, intra_gbps=150, inter_gbps=90, latency_us=3, peak_tflops=312))
    for d in (res.plan.blocks, res.plan.embed_head):
        assert d.p <= 8 and d.g <= 8, res.plan


def test_infeasible_names_the_smallest_plan_and_the_excess():
    from amsp.planner.report import NoFeasiblePlan
    from amsp.planner.solve import plan_cluster

    w = workload("llama2_70b", seq_len=4096, mbs=2, micro_batches=1, recompute="none")
    with pytest.raises(NoFeasiblePlan) as e:
        plan_cluster(w, flat_cluster(1, 8, memory_gib=80))
    msg = str(e.value)
    assert "smallest-memory plan" in msg and "GiB over" in msg
    assert "activation_checkpointing" in msg and "micro_batch_size" in msg
    assert e.value.excess_bytes > 0


def test_fixed_tensor_and_pipeline_degrees_scale_the_data_parallel_problem():
    """tp/pp are inputs: they divide the world (data-parallel world = world / (tp*pp), tp inside a
    node) and the per-rank model (1/tp of each unit, n_layers/pp blocks)."""
    base = CostModel(workload("tiny"), flat_cluster(2, 8))
    tp = CostModel(workload("tiny", tp=2), flat_cluster(2, 8))
    pp = CostModel(workload("tiny", pp=2), flat_cluster(2, 8))
    assert (base.dp_world, base.dp_per_node) == (16, 8)
    assert (tp.dp_world, tp.dp_per_node) == (8, 4) and (pp.dp_world, pp.dp_per_node) == (8, 8)
    assert max(d.os for d in tp.candidates()) == 8
    assert tp.w.block_numel == -(-base.w.block_numel // 2)
    # a pipelined rank: its worst stage, n_layers / pp blocks and the head (the first stage has the embedding)
    assert [u.name for u in pp.w.units()] == ["layers.0", "layers.1", "head"]
    with pytest.raises(ValueError, match="tensor-parallel degree"):
        CostModel(workload("tiny", tp=3), flat_cluster(2, 8))
    with pytest.raises(ValueError, match="assumed MFU"):
        Options(mfu=0)


def test_spread_window_memory_term():
    """The parameter spread's transient: window x the largest unit's in-flight bytes (its received S/p
    buffer in the compute dtype, plus the master's cast in bf16; fp32 weights are the master), only
    for units with os > p, the window capped at the number of units; the solvers' grid counts it too."""
    w16 = workload("tiny", precision="bf16")
    n_units = len(w16.units())

    def term(w, plan, window):
        return CostModel(w, flat_cluster(2, 8), Options(spread_window=window)).evaluate(make_plan(plan, 16, 8)).memory

    def largest(w, pb, cast):  # zero1 on 16 ranks: p = 1 (receive the whole unit), os = 16
        padded = [-(-u.numel // 16) * 16 for u in w.units()]
        return max(s * pb + (s // 16 * pb if cast else 0) for s in padded)

    one, two = term(w16, "zero1", 1), term(w16, "zero1", 2)  # zero1 = 1/1/16: every unit spreads
    assert one["spread"] == largest(w16, 2, 1) > 0
    assert two["spread"] == 2 * one["spread"]
    assert term(w16, "zero1", 100)["spread"] == n_units * one["spread"]
    tensors = lambda m: sum(v for k, v in m.items() if k != "reserved")  # noqa: E731 - the reserve scales with them
    assert tensors(two) - tensors(one) == one["spread"]  # the only part the window changes
    assert term(w16, "ddp", 2)["spread"] == 0 and term(w16, "zero3", 2)["spread"] == 0  # os = p: no gather
    w32 = workload("tiny", precision="fp32")
    assert term(w32, "zero1", 2)["spread"] == 2 * largest(w32, 4, 0)
    model1 = CostModel(w16, flat_cluster(2, 8), Options(spread_window=1))
    model3 = CostModel(w16, flat_cluster(2, 8), Options(spread_window=3))
    (_, m1), (_, m3) = grid(GroupTerms.build(model1)), grid(GroupTerms.build(model3))
    i = GroupTerms.build(model1).candidates.index(Degrees(1, 1, 16))
    assert m3[i, i] - m1[i, i] == pytest.approx(2 * one["spread"], rel=1e-12)
    with pytest.raises(ValueError, match="spread_window"):
        Options(spread_window=0)


def test_pipeline_schedules_bubble_and_activations_in_flight():
    """A hand-named pipeline is priced under its schedule: interleaving divides 1F1B's bubble by the
    virtual stages; zero bubble leaves the forward's share of it (ZB1P with equal input and weight
    halves of the backward: a third); GPipe has 1F1B's bubble but holds every micro-batch's activations
    (the blocks' on the first stage, the head's on the last)."""
    from amsp.planner.workload import Workload
    from amsp.schedule import Precision

    cfg = get_preset("debug").with_overrides(n_layers=4)

    def w(schedule, v=1, micro=8, recompute="none"):
        return Workload(cfg, 64, 2, micro, Precision.named("fp32"), recompute=recompute, pp=2, schedule=schedule,
                        virtual_stages=v)

    base = w("1f1b").pipeline_bubble()
    assert base == pytest.approx(1 / 8)
    assert w("interleaved", 2).pipeline_bubble() == pytest.approx(base / 2)
    assert w("zero_bubble").pipeline_bubble() == pytest.approx(base / 3)
    assert w("zero_bubble", 2).pipeline_bubble() == pytest.approx(base / 6)
    assert w("zero_bubble", recompute="full").pipeline_bubble() == pytest.approx(base / 4)  # bwd re-runs fwd
    assert w("gpipe").pipeline_bubble() == base
    per_mb = w("1f1b").layers * w("1f1b").layer_activation_bytes()
    assert w("gpipe").micro_batches_in_flight() == 8 and w("1f1b").micro_batches_in_flight() == 2
    head = w("1f1b").head_activation_bytes()  # GPipe's last stage keeps all 8 micro-batches' logits too
    assert w("gpipe").activation_bytes() - w("1f1b").activation_bytes() == pytest.approx(6 * per_mb + 7 * head)
    # zero bubble: one more micro-batch's graph kept for its pending weight pass, 1/v of it per chunk
    pending = per_mb + head
    assert w("zero_bubble").activation_bytes() - w("1f1b").activation_bytes() == pytest.approx(pending)
    assert w("zero_bubble", 2).activation_bytes() - w("1f1b").activation_bytes() == pytest.approx(pending / 2)
    with pytest.raises(ValueError, match="pipeline schedule 'zb'"):
        w("zb")


def test_train_config_names_the_schedule_to_the_planner():
    from amsp.planner.__main__ import compose_config
    from amsp.planner.from_config import pipeline_schedule

    cfg = compose_config(["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"])
    assert pipeline_schedule(cfg, 2) == {"schedule": "interleaved", "virtual_stages": 2}
    assert pipeline_schedule(cfg, 1) == {}
