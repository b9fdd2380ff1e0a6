"""The ILP and the exhaustive search return the same optimum over random models and clusters."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amsp.plan import Plan
from amsp.planner import exhaustive, ilp
from amsp.planner.cost_model import CostModel, Options
from amsp.planner.terms import GroupTerms
from models.llama.config import LlamaConfig
from planner_cases import flat_cluster, workload


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([4, 8, 16, 32, 64]))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8, heads) if heads % h == 0]))
    model = LlamaConfig(dim=heads * head_dim, n_layers=draw(st.integers(1, 96)), n_heads=heads, n_kv_heads=kv,
                        vocab_size=draw(st.integers(1000, 160000)), multiple_of=256,
                        tie_embeddings=draw(st.booleans()))
    rpn = draw(st.sampled_from([1, 2, 4, 8]))
    # Node counts from 1 to 2048, log-spread, with non-powers of two (more divisors, more triples).
    nodes = draw(st.one_of(st.integers(1, 16), st.sampled_from([24, 96, 100, 384, 1000, 1536, 2048])))
    w = workload(model, seq_len=draw(st.sampled_from([256, 1024, 4096])), mbs=draw(st.integers(1, 4)),
                 micro_batches=draw(st.integers(1, 16)), precision=draw(st.sampled_from(["bf16", "fp32"])),
                 recompute=draw(st.sampled_from(["none", "selective", "full"])))
    cluster = flat_cluster(nodes, rpn, intra_gbps=draw(st.floats(20, 500)), inter_gbps=draw(st.floats(1, 400)),
                           latency_us=draw(st.floats(0, 20)), memory_gib=draw(st.sampled_from([8, 24, 40, 80, 141])),
                           peak_tflops=draw(st.floats(10, 1000)))
    options = Options(mfu=draw(st.floats(0.2, 0.7)), overlap_spread=draw(st.booleans()),
                      overlap_slowdown=draw(st.sampled_from([0.0, 0.1, 0.3])))
    return w, cluster, options


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_ilp_equals_exhaustive(case):
    w, cluster, options = case
    terms = GroupTerms.build(CostModel(w, cluster, options))
    got, _ = ilp.solve(terms)
    ref = exhaustive.best(terms)
    assert (got is None) == (ref is None)
    if ref is None:
        return
    # Same optimum; the plan may differ only among exact ties of the objective.
    assert got.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9, abs=1e-12)
    assert got.memory_bytes <= terms.budget_bytes
    time_grid, memory_grid = exhaustive.grid(terms)
    i = terms.candidates.index(got.plan.blocks)
    j = terms.candidates.index(got.plan.embed_head)
    assert time_grid[i, j] == pytest.approx(got.step_time_s, rel=1e-12)
    assert memory_grid[i, j] == pytest.approx(got.memory_bytes, rel=1e-12)


def _ranked_by_sorting_everything(terms, k):
    """ranked() as it was before it stopped sorting every fitting pair: the reference for its shortcut."""
    import numpy as np

    time_grid, memory_grid = exhaustive.grid(terms)
    states = terms.state_bytes[0][:, None] + terms.state_bytes[1][None, :]
    ok = np.argwhere((memory_grid <= terms.budget_bytes) & (states <= terms.state_budget_bytes))
    order = np.lexsort((ok[:, 1], ok[:, 0], memory_grid[ok[:, 0], ok[:, 1]], time_grid[ok[:, 0], ok[:, 1]]))[:k]
    return [(terms.candidates[a], terms.candidates[b], float(time_grid[a, b]), float(memory_grid[a, b]))
            for a, b in ok[order]]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from([1, 3, 10, 50]))
def test_ranked_alternatives_equal_a_full_sort(case, k):
    """The ranked table keeps only the pairs no slower than the k-th: same plans, same order, ties included
    (the zero-overlap-slowdown cases and tiny models tie many plans)."""
    w, cluster, options = case
    terms = GroupTerms.build(CostModel(w, cluster, options))
    got = [(c.plan.blocks, c.plan.embed_head, c.step_time_s, c.memory_bytes) for c in exhaustive.ranked(terms, k)]
    assert got == _ranked_by_sorting_everything(terms, k)


def test_memory_constraint_binds():
    """A memory budget between the plans' needs forces the ILP away from the fastest plan."""
    w = workload("llama2_7b", seq_len=2048, mbs=1, micro_batches=4, recompute="full")
    roomy = GroupTerms.build(CostModel(w, flat_cluster(8, 8, memory_gib=400, inter_gbps=50, latency_us=3)))
    tight = GroupTerms.build(CostModel(w, flat_cluster(8, 8, memory_gib=24, inter_gbps=50, latency_us=3)))
    fast, _ = ilp.solve(roomy)
    fit, _ = ilp.solve(tight)
    assert fit.memory_bytes <= tight.budget_bytes < fast.memory_bytes
    assert fit.step_time_s >= fast.step_time_s
    assert fit.step_time_s == pytest.approx(exhaustive.best(tight).step_time_s, rel=1e-9)


@pytest.mark.slow
def test_solve_time_16384_ranks():
    """Acceptance: under 2 s for 16384 ranks (cost terms + ILP); scripts/bench/bench_planner.py."""
    w = workload("llama2_70b", seq_len=4096, mbs=1, micro_batches=4, recompute="full")
    t0 = time.perf_counter()
    terms = GroupTerms.build(CostModel(w, flat_cluster(2048, 8, inter_gbps=370, latency_us=4)))
    choice, _ = ilp.solve(terms)
    assert choice is not None and time.perf_counter() - t0 < 2.0


def test_model_state_budget_binds_every_solver_and_the_fit():
    """amsp.planner.state_budget_gib caps params + grads + optimizer states apart from the device fit:
    the ILP's choice is the fastest plan, by brute force over every priced pair, whose states are within
    it; the table's fit and the 'why' say so; a budget nothing meets names the binding cap."""
    from amsp.planner.report import NoFeasiblePlan, why
    from amsp.planner.solve import plan_cluster

    w = workload("debug", seq_len=64, mbs=1, micro_batches=2, precision="fp32")
    cluster = flat_cluster(2, 2, intra_gbps=50, inter_gbps=1, latency_us=5, memory_gib=80)
    free = CostModel(w, cluster, Options())
    cands = free.candidates()
    priced = [free.evaluate(Plan(b, e)) for b in cands for e in cands]
    fastest = min(priced, key=lambda c: c.step_time_s)
    states = sorted({c.model_state_bytes for c in priced})
    assert fastest.model_state_bytes > states[0], "the case must make the cap bind"
    budget = max(s for s in states if s < fastest.model_state_bytes)
    opts = Options(state_budget_bytes=budget)
    capped = CostModel(w, cluster, opts)
    ref = min((c for c in priced if c.model_state_bytes <= budget), key=lambda c: c.step_time_s)
    terms = GroupTerms.build(capped)
    got, _ = ilp.solve(terms)
    assert got.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)
    assert exhaustive.best(terms).step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)
    res = plan_cluster(w, cluster, opts)
    assert res.chosen.model_state_bytes <= budget and res.chosen.fits
    assert all(c.model_state_bytes <= budget for c in res.ranked)
    over = capped.evaluate(fastest.plan)
    assert not over.fits and why(over).startswith("model states")
    with pytest.raises(NoFeasiblePlan, match="state_budget_gib") as e:
        plan_cluster(w, cluster, Options(state_budget_bytes=states[0] / 2))
    assert e.value.excess_bytes == pytest.approx(states[0] / 2)
    with pytest.raises(ValueError, match="model-state budget"):
        Options(state_budget_bytes=0)


def test_state_budget_from_config_and_refused_by_the_joint_planner():
    from omegaconf import OmegaConf

    from amsp.planner.from_config import options_from_config, planner_config, refuse_state_budget_for_joint
    from configs.schema import TrainConfig

    cfg = OmegaConf.structured(TrainConfig)
    assert options_from_config(cfg).state_budget_bytes is None
    refuse_state_budget_for_joint(planner_config(cfg))
    cfg.amsp.planner.state_budget_gib = 0.5
    assert options_from_config(cfg).state_budget_bytes == 2**29
    with pytest.raises(ValueError, match="data-parallel planner only"):
        refuse_state_budget_for_joint(planner_config(cfg))
