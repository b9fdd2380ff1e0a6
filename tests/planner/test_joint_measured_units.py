"""The joint planner priced from what startup measures: TP units timed on real groups replace the
FLOPs + bytes estimate, and CPU ranks sharing a machine's cores make a pipeline's idle stages give
their cores to the busy ones (amsp/planner/joint/search.shared_core_pipeline)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from amsp.plan import Degrees
from amsp.planner.from_config import cpu_shared_cores
from amsp.planner.joint.hetero import from_spec, load_preset
from amsp.planner.joint.search import price_config, shared_core_pipeline
from amsp.planner.joint.stage_cost import Setting, measured_units, unit_costs
from amsp.schedule import Precision
from models.llama import get_preset

FP32 = Precision.named("fp32")
TINY = get_preset("tiny")


def _cluster(shared=None):
    spec = replace(load_preset("h100x8", 1).with_shape(2, 2), shared_cores=shared)
    return from_spec(spec)


def _price(cluster, tp=1, pp=1, mbs=2, units=None, deg=(1, 1, 1)):
    return price_config(TINY, cluster, seq_len=128, global_batch=16, precision=FP32, tp=tp, pp=pp,
                        micro_batch_size=mbs, degrees=Degrees(*deg), reserved_bytes=0, unit_times=units)


def test_measured_units_replace_the_flops_estimate_and_scale_with_the_micro_batch():
    cluster = _cluster()
    name = cluster.groups[0].name
    s = Setting(TINY, 128, FP32, 2, 1, 2, 2, 4, {}, unit_times={(name, 2, 1): (0.05, 0.04, 0.01)})
    assert measured_units(s, name) == pytest.approx((0.10, 0.08, 0.02)), "nearest measured size, in proportion"
    assert measured_units(s, "other-node") is None
    # measured at 1 and 8 (what startup times): the sizes between on the line through them, a fixed cost per
    # micro-batch plus one per sample, so a larger micro-batch is cheaper per sample as measured
    two = {(name, 2, 1): (0.05, 0.04, 0.01), (name, 2, 8): (0.26, 0.18, 0.03)}
    at = {m: measured_units(replace(s, micro_batch_size=m, unit_times=two), name) for m in (1, 2, 4, 8, 16)}
    assert at[1] == (0.05, 0.04, 0.01) and at[8] == (0.26, 0.18, 0.03)
    assert at[2] == pytest.approx((0.08, 0.06, 0.01 + 0.02 / 7))
    assert at[4] == pytest.approx((0.14, 0.10, 0.01 + 0.06 / 7))
    assert at[16] == pytest.approx((0.50, 0.34, 0.03 + 0.16 / 7)), "beyond the largest: the same line"
    assert at[2][0] / 2 < at[1][0] and at[8][0] / 8 < at[2][0] / 2
    c = unit_costs(s, cluster.groups[0])
    assert (c.block, c.head, c.embed) == pytest.approx((0.10, 0.08, 0.02))
    assert c.block_full == pytest.approx(0.10 * 4 / 3), "recomputation adds the forward, a third of fwd+bwd"
    # a measured TP block 10x its estimate makes the whole TP step dearer; tp 1 is untouched
    flops_only = _price(cluster, tp=2)[0]
    est = unit_costs(replace(s, unit_times={}), cluster.groups[0])
    slow = {(name, 2, 2): (10 * est.block, est.head, est.embed)}
    assert _price(cluster, tp=2, units=slow)[0] > 5 * flops_only
    assert _price(cluster, tp=1, units=slow)[0] == pytest.approx(_price(cluster, tp=1)[0])


def test_shared_core_pipeline_bounds():
    # 4 stages of one rank on one 4-rank machine, 8 micro-batches, a rank alone runs 2x faster
    t = [1.0, 1.0, 1.0, 3.0]
    pipe = 7 * 3.0 + sum(t)  # the 1F1B step with every rank at the all-busy speed: 27
    work = 8 * sum(t) / 4  # the machine's cores never idle while work is left: 12
    assert shared_core_pipeline(pipe, t, 8, 1, 4, 0.5) == pytest.approx(max(pipe * 0.5, work))
    # balanced stages with a small bubble: the total work bounds it
    assert shared_core_pipeline(11.0, [1.0] * 4, 8, 1, 4, 0.5) == pytest.approx(8.0)
    # two machines: the busier one decides
    assert shared_core_pipeline(27.0, t, 8, 1, 2, 0.9) == pytest.approx(max(27 * 0.9, 8 * 4.0 / 2))
    # a machine per stage (2 stages of 2 ranks, 2 ranks a machine): a stage's ranks idle and run together,
    # no other stage can take their cores, so the pipeline keeps its all-busy time
    assert shared_core_pipeline(5.0, [1.0, 2.0], 2, 2, 2, 0.5) == 5.0
    # the same stages on one 4-rank machine: the idle stage's cores go to the busy one
    assert shared_core_pipeline(5.0, [1.0, 2.0], 2, 2, 4, 0.5) == pytest.approx(max(2.5, (2 + 2 + 4 + 4) / 4))


def test_pipeline_on_shared_cores_is_cheaper_and_data_parallel_unchanged():
    alone, shared = _cluster(), _cluster((4, 0.5))
    pp_alone, terms_alone = _price(alone, pp=4)
    pp_shared, terms = _price(shared, pp=4)
    assert pp_shared < pp_alone and terms["idle_cores_reused_s"] < 0 == terms_alone["idle_cores_reused_s"]
    assert _price(shared)[0] == pytest.approx(_price(alone)[0]), "every rank busy: nothing to hand over"


def test_cpu_shared_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cpu_shared_cores(4, threads=1) == (4, 0.5)
    assert cpu_shared_cores(2, threads=1) is None, "a core per rank: nothing shared"
    assert cpu_shared_cores(4, threads=2) == (4, 0.25), "alone, a 2-thread rank uses both cores"
    assert cpu_shared_cores(1, threads=8) is None


def test_measured_optimizer_rate_prices_each_node_types_step():
    """optimizer_s_per_elem (compute_profile.time_optimizer, per node preset) replaces the memory-bandwidth
    estimate of the optimizer term: the OS shard's elements times the rate, for the node type it names."""
    cluster = _cluster()
    name = cluster.groups[0].name

    def optimizer_s(rates, os_):
        res = price_config(TINY, cluster, seq_len=128, global_batch=16, precision=FP32, tp=1, pp=1,
                           micro_batch_size=2, degrees=Degrees(1, 1, os_), reserved_bytes=0,
                           optimizer_s_per_elem=rates)
        return res[1]["optimizer_s"]

    rate = 5e-9
    assert optimizer_s({name: rate}, 1) == pytest.approx(TINY.num_params() * rate, rel=0.02)
    assert optimizer_s({name: rate}, 4) == pytest.approx(optimizer_s({name: rate}, 1) / 4, rel=0.02)
    assert optimizer_s({"other-node": rate}, 1) == pytest.approx(optimizer_s(None, 1)), "another type's rate"
    assert optimizer_s(None, 1) != pytest.approx(optimizer_s({name: rate}, 1))


def test_a_stage_across_two_kinds_runs_at_the_measured_slower_pace_within_the_smaller_memory():
    """Two node groups of one preset that differ only in what they measured at startup (a mixed cluster
    whose file names the kinds apart): a data-parallel stage over both is priced at the slower group's
    measured units, whichever comes first; with different memories, within the smaller."""
    from amsp.planner.joint.hetero import HeteroCluster, NodeGroup
    from amsp.planner.joint.search import stage_group

    spec = load_preset("h100x8", 1).with_shape(1, 2)
    small = replace(spec, device_memory_bytes=spec.device_memory_bytes // 2)
    fast, slow = (0.01, 0.02, 0.001), (0.03, 0.06, 0.003)
    for first, second in ((("fast", spec), ("slow", small)), (("slow", small), ("fast", spec))):
        cluster = HeteroCluster("two", tuple(NodeGroup(n, 1, sp, "h100x8") for n, sp in (first, second)))
        units = {("fast", 1, 2): fast, ("slow", 1, 2): slow}
        s = Setting(TINY, 128, FP32, 1, 1, 4, 2, 2, {}, unit_times=units)
        g = stage_group(s, list(cluster.groups))
        assert g.name == "slow" and g.spec.device_memory_bytes == small.device_memory_bytes
        step = _price(cluster, units=units)[0]
        only_slow = {("fast", 1, 2): slow, ("slow", 1, 2): slow}
        assert step == pytest.approx(_price(cluster, units=only_slow)[0]), "the fast group does not set the pace"
    # the slower kind with the larger memory: its pace, the other's memory
    cluster = HeteroCluster("two", (NodeGroup("fast", 1, small, "h100x8"), NodeGroup("slow", 1, spec, "h100x8")))
    g = stage_group(Setting(TINY, 128, FP32, 1, 1, 4, 2, 2, {}, unit_times=units), list(cluster.groups))
    assert g.name == "slow" and g.spec.device_memory_bytes == small.device_memory_bytes
