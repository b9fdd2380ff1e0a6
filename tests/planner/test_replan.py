"""Re-planning from measurement (amsp/planner/replan.py): refit math, the >= 5% rule, user plans."""
from __future__ import annotations

from dataclasses import replace

import pytest

from amsp.plan import make_plan
from amsp.planner import replan as rp
from amsp.planner.cost_model import CostModel, Options
from amsp.planner.solve import plan_cluster
from configs.schema import PlannerConfig
from tests.planner.planner_cases import flat_cluster, workload

W = workload("debug", seq_len=64, mbs=2, micro_batches=2, precision="fp32")


def slow_cluster():  # communication that compute cannot hide for zero3 of the debug model
    return flat_cluster(1, 8, intra_gbps=0.5, latency_us=20.0, peak_tflops=1.0)


def measured_on(truth_cluster, plan, options=Options()) -> rp.Measured:
    """What a run would measure if `truth_cluster` were the real machine."""
    c = CostModel(W, truth_cluster, options).evaluate(plan)
    return rp.Measured(step_s=c.step_time_s, exposed_comm_s=rp.comm_exposed_s(c), peak_bytes=0.0, steps=10)


def test_window_median_leaves_out_the_first_step():
    assert rp.window_median([9.0, 1.0, 2.0, 3.0]) == 2.0
    assert rp.window_median([9.0, 1.0, 2.0, 3.0], skip_first=False) == 2.5
    with pytest.raises(ValueError, match="at least one step"):
        rp.window_median([9.0])


def test_scaled_cluster_scales_collectives_and_compute():
    c = slow_cluster()
    plan = make_plan("zero3", 8, 8)
    base = CostModel(W, c, Options()).evaluate(plan)
    slow = CostModel(W, rp.scaled_cluster(c, 10.0, 2.0), Options()).evaluate(plan)
    assert sum(slow.comm_seconds().values()) == pytest.approx(10 * sum(base.comm_seconds().values()), rel=1e-9)
    assert slow.compute_s == pytest.approx(2 * base.compute_s, rel=1e-9)
    with pytest.raises(ValueError, match="positive"):
        rp.scaled_cluster(c, 0.0)


@pytest.mark.parametrize("comm, compute", [(10.0, 1.0), (0.1, 3.0), (25.0, 0.5)])
def test_refit_reproduces_what_was_measured(comm, compute):
    prior = slow_cluster()
    plan = make_plan("zero3", 8, 8)
    m = measured_on(rp.scaled_cluster(prior, comm, compute), plan)
    fit = rp.refit(W, prior, Options(), plan, m)
    c2, o2 = rp.refitted_inputs(prior, Options(), fit)
    again = CostModel(W, c2, o2).evaluate(plan)
    assert rp.comm_exposed_s(again) == pytest.approx(m.exposed_comm_s, rel=1e-3)
    assert again.step_time_s == pytest.approx(m.step_s, rel=1e-3)
    assert fit.comm_scale == pytest.approx(comm, rel=0.05)


@pytest.mark.parametrize("optimizer_rate", [None, 2e-6])
def test_refit_with_a_measured_profile_reproduces_the_run(optimizer_rate):
    """The refit scales every compute term, the AdamW step's included: with a profile whose optimizer is a
    large share of the step (2e-6 s per element, or priced by a slow memory), a refit that scaled only the
    blocks left the running plan priced 44% off the measurement it was fitted to."""
    from amsp.planner.compute_profile import ComputeProfile

    prof = ComputeProfile(2e-3, 4e-3, 1e-3, 1e-4, 0.2, "test", optimizer_s_per_elem=optimizer_rate)
    # without a measured rate the memory bandwidth prices the step: a slow one makes it as large
    prior, plan = replace(slow_cluster(), memory_bandwidth_gbs=0.005), make_plan("zero1", 8, 8)
    o = Options(compute=prof)
    truth_o = replace(o, compute=replace(prof, **{k: 3 * getattr(prof, k) for k in (
        "block_forward_s", "block_backward_s", "head_forward_backward_s", "embedding_s")},
        optimizer_s_per_elem=None if optimizer_rate is None else 3 * optimizer_rate))
    truth = CostModel(W, rp.scaled_cluster(prior, 40.0, 3.0, flops=False), truth_o).evaluate(plan)
    assert truth.exposed_s["optimizer"] > 0.1 * truth.step_time_s  # the case that needs the optimizer scaled
    assert rp.comm_exposed_s(truth) > 0.05 * truth.step_time_s  # and the links are seen
    m = rp.Measured(truth.step_time_s, rp.comm_exposed_s(truth), 0.0, 10)
    fit = rp.refit(W, prior, o, plan, m)
    again = CostModel(W, *rp.refitted_inputs(prior, o, fit)).evaluate(plan)
    assert again.step_time_s == pytest.approx(m.step_s, rel=1e-3)
    assert rp.comm_exposed_s(again) == pytest.approx(m.exposed_comm_s, rel=1e-3)
    assert fit.compute_scale == pytest.approx(3.0, rel=1e-3)


def test_hidden_communication_leaves_the_links_alone():
    fast = flat_cluster(1, 8, intra_gbps=1e4, peak_tflops=0.01)  # compute-bound: nothing exposed
    plan = make_plan("ddp", 8, 8)
    m = rp.Measured(step_s=2 * CostModel(W, fast, Options()).evaluate(plan).step_time_s, exposed_comm_s=0.0,
                    peak_bytes=0.0, steps=5)
    fit = rp.refit(W, fast, Options(), plan, m)
    assert fit.comm_scale == 1.0 and fit.compute_scale > 1.5


def _priced(step_s: float, plan_name: str):
    cost = CostModel(W, slow_cluster(), Options()).evaluate(make_plan(plan_name, 8, 8))
    return replace(cost, compute_s=cost.compute_s + step_s - cost.step_time_s)


def test_decide_needs_the_configured_gain_and_a_planner_plan():
    gain = PlannerConfig.replan_min_gain  # the schema's default, 5%
    current, better, marginal = _priced(1.0, "zero3"), _priced(0.94, "ddp"), _priced(0.96, "ddp")
    assert rp.decide(current, better, user_named=False, min_gain=gain).switch
    assert not rp.decide(current, marginal, user_named=False, min_gain=gain).switch
    assert rp.decide(current, marginal, user_named=False, min_gain=0.0).switch
    named = rp.decide(current, better, user_named=True, min_gain=gain)
    assert not named.switch and "named by the user" in named.reason
    # parallel.auto's plan: reported, not switched
    joint = rp.decide(current, better, user_named=False, min_gain=gain, joint=True)
    assert not joint.switch and "joint planner" in joint.reason and "named by the user" not in joint.reason
    same = rp.decide(current, _priced(0.5, "zero3"), user_named=False, min_gain=gain)
    assert not same.switch and "still the best" in same.reason


def test_wrong_prior_is_corrected_by_one_recheck():
    """A prior 10x too optimistic about the links picks a plan; after one refit the re-solve picks
    what the true machine's model picks."""
    truth = slow_cluster()
    prior = rp.scaled_cluster(truth, 0.1)
    w = workload("tiny", seq_len=64, mbs=1, micro_batches=1, precision="fp32")
    first = plan_cluster(w, prior, Options(), top_k=1, with_presets=False).plan
    c = CostModel(w, truth, Options()).evaluate(first)
    m = rp.Measured(c.step_time_s, rp.comm_exposed_s(c), 0.0, 10)
    fit = rp.refit(w, prior, Options(), first, m)
    c2, o2 = rp.refitted_inputs(prior, Options(), fit)
    replanned = plan_cluster(w, c2, o2, top_k=1, with_presets=False).chosen
    best_true = plan_cluster(w, truth, Options(), top_k=1, with_presets=False).chosen
    achieved = CostModel(w, truth, Options()).evaluate(replanned.plan).step_time_s
    assert achieved <= best_true.step_time_s * 1.02
    assert fit.comm_scale == pytest.approx(10.0, rel=0.1)


def test_relative_error():
    assert rp.relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert rp.relative_error(1.0, 0.0) is None


def test_the_allocator_margin_is_raised_to_the_overhead_a_run_held_never_lowered():
    """memory_scale = the peak the device held (CUDA: reserved; CPU: anonymous above the engine's start) over
    the predicted tensor peak; the re-solve then keeps that much headroom (capped), and a run that held
    less than its margin leaves the margin as it was."""
    c = flat_cluster(1, 8)
    plan = make_plan("zero1", 8, 8)
    prior = CostModel(W, c, Options()).evaluate(plan)
    tensors = prior.memory_total - prior.memory.get("reserved", 0)
    held = rp.Measured(prior.step_time_s, 0.0, peak_bytes=tensors, steps=10, held_bytes=1.3 * tensors)
    fit = rp.refit(W, c, Options(), plan, held)
    assert fit.memory_scale == pytest.approx(1.3)
    _, opts = rp.refitted_inputs(c, Options(memory_margin=0.08), fit)
    assert opts.memory_margin == pytest.approx(0.3)
    assert rp.refitted_margin(0.08, 0.97) == 0.08 and rp.refitted_margin(0.08, 5.0) == rp.MAX_MARGIN
    cpu = rp.Measured(prior.step_time_s, 0.0, peak_bytes=1.1 * tensors, steps=10)  # no held: the peak itself
    assert rp.refit(W, c, Options(), plan, cpu).memory_scale == pytest.approx(1.1)
    assert rp.refit(W, c, Options(), plan, rp.Measured(1.0, 0.0, 0.0, 10)).memory_scale == 1.0  # nothing measured


def test_waits_the_plans_collectives_cannot_make_leave_the_links_alone():
    """A plan with no collective to expose (a data-parallel group of one rank: each stage of a pipeline
    whose ranks all hold different stages) cannot explain measured waits at any link speed: the refit
    keeps the links (it ran the scale to its 1000x clamp, and the recheck deleted the probe cache)."""
    c = flat_cluster(1, 1, intra_gbps=10.0, latency_us=20.0, peak_tflops=1.0)
    plan = make_plan("ddp", 1, 1)
    cost = CostModel(W, c, Options()).evaluate(plan)
    m = rp.Measured(step_s=cost.step_time_s + 0.05, exposed_comm_s=0.05, peak_bytes=0.0, steps=10)
    fit = rp.refit(W, c, Options(), plan, m)
    assert fit.comm_scale == 1.0
    assert fit.compute_scale == pytest.approx(1.0, rel=1e-3)


def test_the_recheck_prices_the_run_under_its_model_parallel_layout():
    """planner_inputs (the recheck's and the out-of-memory message's workload) under parallel.tp / pp and the
    pipeline schedule, as the startup planner prices them; it priced a pp 2 run as the whole model on
    every rank."""
    from types import SimpleNamespace

    from amsp.planner.__main__ import compose_config
    from amsp.startup_memory import planner_inputs

    cfg = compose_config(["model=debug", "model.n_layers=4", "parallel.pp=2", "parallel.schedule=gpipe"])
    w, _, _ = planner_inputs(cfg, SimpleNamespace(world_size=4, local_world_size=4, rank=0), "cpu")
    assert (w.pp, w.tp, w.schedule, w.micro_batches_in_flight()) == (2, 1, "gpipe", w.micro_batches)
