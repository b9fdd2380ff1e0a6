"""The startup compute measurement (amsp/planner/compute_profile.py) and its use by the cost model."""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib

import pytest

from amsp.planner.compute_profile import ComputeProfile, load_profile, measure_group_profiles, measure_profile

TINY = ["model=debug", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4",
        "data.seq_len=32", "trainer.micro_batch_size=1", "trainer.global_batch_size=2"]


def _model(cfg):
    from configs.schema import to_llama_config

    return to_llama_config(cfg.model)


def test_measured_profile_is_sane_and_cached(tmp_path, caplog):
    from amsp.planner.__main__ import compose_config

    cfg = compose_config(TINY)
    args = (_model(cfg), 32, 1, "fp32", "none", "cpu", 1, 0, tmp_path)
    with caplog.at_level(logging.INFO, logger="amsp.planner"):
        first = measure_profile(*args)
    assert first.source.startswith("measured on ")
    for f in ("block_forward_s", "block_backward_s", "head_forward_backward_s", "embedding_s"):
        assert 0 < getattr(first, f) < 5, (f, first)
    assert 1e-12 < first.optimizer_s_per_elem < 1e-6, first  # AdamW: a few ns per element on a CPU core
    assert first.overlap_slowdown is None  # one process: nothing concurrent to measure, said so
    assert "a single process has no concurrent communication" in caplog.text
    second = measure_profile(*args)
    assert second.source.startswith("cache") and second.block_forward_s == first.block_forward_s
    assert second.optimizer_s_per_elem == first.optimizer_s_per_elem
    assert len(list(tmp_path.glob("compute-*.json"))) == 1
    other = measure_profile(_model(cfg), 16, 1, "fp32", "none", "cpu", 1, 0, tmp_path)  # another shape
    assert other.source.startswith("measured") and len(list(tmp_path.glob("compute-*.json"))) == 2


def test_a_profile_the_run_contradicts_leaves_the_cache(tmp_path):
    """The recheck's compute scale 1.5x or more off (either way) removes the cached profile, so the next
    startup measures afresh instead of planning every run from a timing taken on a busy machine."""
    from amsp.planner.__main__ import compose_config
    from amsp.planner.cache_file import forget_if_stale

    def forget_cached(profile, scale):  # what the recheck does with a profile's cache file
        return forget_if_stale(profile.cache_file, scale)

    args = (_model(compose_config(TINY)), 32, 1, "fp32", "none", "cpu", 1, 0, tmp_path)
    measured = measure_profile(*args)
    path = pathlib.Path(measured.cache_file)
    assert path.exists() and "cache_file" not in json.loads(path.read_text())["profile"]  # not stored
    cached = measure_profile(*args)
    assert cached.cache_file == str(path)
    for scale in (0.7, 1.0, 1.45):  # within the factor: the profile stays
        assert forget_cached(cached, scale) is None and path.exists()
    assert forget_cached(dataclasses.replace(cached, cache_file=None), 0.1) is None  # a profile from a file
    assert forget_cached(cached, 0.129) == str(path) and not path.exists()
    assert forget_cached(cached, 8.0) is None  # already gone
    assert measure_profile(*args).source.startswith("measured")


def test_a_cached_probe_is_named_by_its_source():
    from amsp.planner.probe import cached_probe

    assert cached_probe("cache /c/probe-1.json") == "/c/probe-1.json"
    assert cached_probe("cache /c/probe-1.json, refitted, refitted") == "/c/probe-1.json"
    assert cached_probe("probe") is None and cached_probe("preset") is None


def test_injected_profile_changes_the_prediction(tmp_path, capsys):
    from amsp.planner.__main__ import compose_config, main
    from amsp.planner.cost_model import CostModel, Options, overlap_slowdown_of
    from amsp.planner.from_config import cluster_spec, workload_from_config
    from amsp.plan import make_plan

    cfg = compose_config(["model=debug", "cluster=h100x8", "cluster.nodes=2", "model.activation_checkpointing=full"])
    cluster = cluster_spec(cfg)
    w = workload_from_config(cfg, cluster)
    prof = ComputeProfile(0.01, 0.02, 0.005, 0.001, 0.3, "file:test")
    plan = make_plan("zero3", cluster.world, cluster.ranks_per_node)
    flops = CostModel(w, cluster, Options()).evaluate(plan)
    measured = CostModel(w, cluster, Options(compute=prof)).evaluate(plan)
    # full recomputation: backward + one more forward per block; head and embedding once
    expected = (w.layers * (0.01 + 0.02 + 0.01) + 0.006) * w.micro_batches
    assert measured.compute_s == pytest.approx(expected) and flops.compute_s != pytest.approx(expected)

    path = tmp_path / "prof.json"
    path.write_text(json.dumps({"profile": dataclasses.asdict(prof)}))
    assert load_profile(str(path)).source == f"file:{path}"
    assert main(["--json", "--compute-profile", str(path), "model=debug", "cluster=h100x8", "cluster.nodes=2",
                 "model.activation_checkpointing=full"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["compute_source"] == f"file:{path}"
    assert out["chosen"]["compute_s"] == pytest.approx(expected)
    # The overlap slowdown priced with, and where it came from, is what the cluster line and the JSON say.
    assert out["inputs"]["overlap_slowdown"] == {"value": 0.3, "source": f"--compute-profile {path}"}
    assert CostModel(w, cluster, Options(compute=prof)).overlap_slowdown == 0.3
    assert overlap_slowdown_of(Options(), cluster) == (cluster.overlap_slowdown, "the preset's")
    assert overlap_slowdown_of(Options(compute=prof, overlap_slowdown=0.5), cluster) == \
        (0.5, "amsp.planner.overlap_slowdown")
    assert "slows compute by 0.30 s/s (measured at startup)" in cluster.describe((0.3, "measured at startup"))
    assert f"slows compute by {cluster.overlap_slowdown:.2f} s/s (the preset's)" in cluster.describe()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"block_forward_s": 1.0}))
    assert main(["--compute-profile", str(bad), "model=debug"]) == 2
    assert "missing block_backward_s" in capsys.readouterr().err


def _startup(rank: int, world: int, tmp: str) -> dict:
    from amsp.launch import DistEnv
    from amsp.planner.__main__ import compose_config
    from amsp.planner.startup import plan_for_run

    cfg = compose_config(TINY + ["cluster.peak_tflops=0.05", "amsp.planner.probe=false",
                                 f"amsp.planner.cache_dir={tmp}", "amsp.planner.top_k=2"])
    out = plan_for_run(cfg, DistEnv(rank, world, rank, world, "test"))
    again = plan_for_run(cfg, DistEnv(rank, world, rank, world, "test"))
    # a mixed cluster's node groups, one rank each here: each group's profile is its own rank's
    args = (_model(cfg), 32, 1, "fp32", "none", "cpu", world, rank, ["a", "b"], pathlib.Path(tmp))
    groups, groups_again = measure_group_profiles(*args), measure_group_profiles(*args)
    return {"plan": out.plan, "profile": out.options.compute if rank == 0 else None,
            "again": again.options.compute if rank == 0 else None, "table": out.table if rank == 0 else "",
            "groups": groups, "groups_again": groups_again}


@pytest.mark.distributed
def test_plan_for_run_measures_compute_and_overlap(tmp_path):
    from tests.distributed import run_distributed

    out = run_distributed(_startup, 2, str(tmp_path), timeout=300)
    assert out[0]["plan"] == out[1]["plan"]
    prof, again = out[0]["profile"], out[0]["again"]
    assert prof.source.startswith("measured on ") and prof.block_forward_s > 0
    assert prof.overlap_slowdown is not None and 0 <= prof.overlap_slowdown <= 1  # measured with 2 ranks
    assert again.source.startswith("cache") and again.overlap_slowdown == prof.overlap_slowdown
    groups, groups_again = out[0]["groups"], out[0]["groups_again"]
    assert list(groups) == ["a", "b"] and out[1]["groups"] == groups  # every rank gets rank 0's view
    assert all(p.source.startswith("measured on ") and p.overlap_slowdown is not None for p in groups.values())
    assert groups["a"].block_forward_s != groups["b"].block_forward_s  # each its own rank's timing, not one median
    assert all(groups_again[g].source.startswith("cache") and
               groups_again[g].block_forward_s == groups[g].block_forward_s for g in groups)
    assert len(list(tmp_path.glob("compute-*.json"))) == 2  # the grouped profile cached apart from the uniform one


def test_measured_optimizer_rate_prices_the_step():
    """A profile's AdamW rate replaces the cluster's memory bandwidth: the optimizer term is the OS shard's
    elements times it (fp32 masters: no extra weight write), and it scales with 1/os."""
    from amsp.plan import Degrees, Plan
    from amsp.planner.__main__ import compose_config
    from amsp.planner.cost_model import CostModel, Options
    from amsp.planner.from_config import cluster_spec, workload_from_config

    cfg = compose_config(["model=debug", "cluster=h100x8", "cluster.nodes=2", "amsp.precision=fp32"])
    cluster = cluster_spec(cfg)
    w = workload_from_config(cfg, cluster)
    rate = 3e-9
    prof = ComputeProfile(0.01, 0.02, 0.005, 0.001, 0.3, "file:test", optimizer_s_per_elem=rate)
    model = CostModel(w, cluster, Options(compute=prof))
    for os_ in (1, 4):
        cost = model.evaluate(Plan(Degrees(1, 1, os_), Degrees(1, 1, os_)))
        elems = sum(model.group_cost(g, Degrees(1, 1, os_)).parts["optim"] for g in ("blocks", "embed_head")) / 8
        assert cost.exposed_s["optimizer"] == pytest.approx(elems * rate, rel=1e-3), os_
    preset = CostModel(w, cluster, Options(compute=dataclasses.replace(prof, optimizer_s_per_elem=None)))
    assert preset.evaluate(Plan(Degrees(1, 1, 1), Degrees(1, 1, 1))).exposed_s["optimizer"] != pytest.approx(
        model.evaluate(Plan(Degrees(1, 1, 1), Degrees(1, 1, 1))).exposed_s["optimizer"])


def test_cache_key_names_what_changes_the_timing(monkeypatch):
    """The kernels the block runs, their code and where the ranks sit are in the key: a fused-off or
    compiled run must not read a profile timed with other kernels, nor one timed before the kernels'
    code changed (the CUDA kernels' vector accesses made a block faster), nor a 2 x 4 layout one timed
    on one node of 8."""
    import amsp.planner.compute_profile as cp
    from amsp.planner.compute_profile import cache_key
    from models.llama import get_preset

    m = get_preset("debug")
    args = (256, 1, "fp32", "none", "cpu", 8, "gloo")
    base = cache_key(m, *args)
    assert base == cache_key(m, *args)
    assert base != cache_key(m.with_overrides(fused="off"), *args)
    assert base != cache_key(m.with_overrides(norm="torch"), *args)
    assert base != cache_key(m, *args, compiled=True)
    assert cache_key(m, *args, ranks_per_node=8) != cache_key(m, *args, ranks_per_node=4)
    assert len(cp.timed_code_hash()) == 12 and "csrc/fused_cuda.cu" in cp.TIMED_SOURCES
    monkeypatch.setattr(cp, "timed_code_hash", lambda: "another-code")
    assert base != cache_key(m, *args)


def test_compiled_profile_times_the_compiled_block_without_recompiling():
    """model.compile on: the block timed is compiled once, before the timing; the timed forward runs with
    autograd on, as training does, so dynamo compiles no second (no_grad) graph inside the samples."""
    import torch._dynamo

    from amsp.planner.compute_profile import time_compute
    from models.llama import get_preset

    # large enough that a backward (twice a forward's work) stands above timing noise: it is measured as
    # (forward + backward) - forward, a compiled backward being one-shot
    m = get_preset("debug").with_overrides(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=512, fused="off")
    torch._dynamo.reset()
    times, parts = time_compute(m, 256, 2, "fp32", "cpu", repeats=3, compiled=True)
    block = parts[0]
    assert hasattr(block.forward, "_torchdynamo_orig_callable") or "compile" in repr(block.forward)
    for f in ("block_forward_s", "block_backward_s", "head_forward_backward_s", "embedding_s"):
        assert 0 < times[f] < 5, (f, times)
    stats = torch._dynamo.utils.counters["stats"]
    compiled_once = stats["unique_graphs"]
    time_compute(m, 256, 2, "fp32", "cpu", repeats=1, compiled=False)  # eager: nothing more to compile
    assert stats["unique_graphs"] == compiled_once >= 1


def test_tp_rank_profile_is_its_tp_local_units(monkeypatch):
    """parallel.tp > 1: the block, head and embedding a rank runs are the TP-local units timed on TP groups,
    split forward / backward as the whole block splits (a whole block priced tp times the work)."""
    from amsp.launch import DistEnv
    from amsp.parallel import joint_startup
    from amsp.planner.__main__ import compose_config
    from amsp.planner.startup import tp_local_profile

    whole = ComputeProfile(0.01, 0.02, 0.005, 0.001, 0.3, "measured on x", optimizer_s_per_elem=1e-9,
                           cache_file="/c/compute-1.json")
    cfg = compose_config(TINY + ["parallel.tp=2"])
    denv = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, launcher="torchrun")
    monkeypatch.setattr(joint_startup, "measured_tp_units", lambda *a, **k: {(None, 2): (0.012, 0.004, 0.002)})
    got = tp_local_profile(whole, cfg, _model(cfg), denv, "cpu", 2)
    assert got.block_forward_s == pytest.approx(0.004) and got.block_backward_s == pytest.approx(0.008)
    assert (got.head_forward_backward_s, got.embedding_s) == (0.004, 0.002)
    assert got.optimizer_s_per_elem == 1e-9 and got.overlap_slowdown == 0.3 and "TP-local units at tp 2" in got.source
    # both files it came from, for the recheck to remove when the run contradicts them
    units_file = str(joint_startup.tp_cache_path(cfg, _model(cfg), denv, "cpu", 2))
    assert pathlib.Path(units_file).name.startswith("tp2-") and got.cache_files() == ["/c/compute-1.json", units_file]
    with pytest.raises(ValueError, match="no tensor-parallel profile"):
        tp_local_profile(whole, cfg, _model(cfg), denv, "cpu", 4)


def test_the_recheck_removes_every_cache_file_a_contradicted_profile_came_from(tmp_path):
    """A tensor-parallel run's block times come from the TP units' file: a stale one is removed with the
    compute profile's, or every later TP startup would plan from it."""
    from types import SimpleNamespace

    from amsp.replan_switch import _forget_stale_caches

    files = [tmp_path / "compute-1.json", tmp_path / "tp2-v1-1.json"]
    for f in files:
        f.write_text("{}")
    prof = ComputeProfile(0.01, 0.02, 0.005, 0.001, None, "cache", cache_file=str(files[0]),
                          units_cache_file=str(files[1]))
    opts, cluster = SimpleNamespace(compute=prof), SimpleNamespace(source="preset cpu")
    assert _forget_stale_caches(opts, cluster, SimpleNamespace(compute_scale=1.2, comm_scale=1.0)) == (None, None)
    assert all(f.exists() for f in files)
    removed, probe = _forget_stale_caches(opts, cluster, SimpleNamespace(compute_scale=0.2, comm_scale=1.0))
    assert removed == f"{files[0]}, {files[1]}" and probe is None and not any(f.exists() for f in files)


def test_a_compiled_backward_timed_below_its_forward_is_retimed_then_priced(monkeypatch, caplog):
    """Under load the forward's median came out above the forward + backward one, and the compiled
    block's backward was priced at 0 s."""
    import amsp.planner.compute_profile as cp

    calls = []

    def noisy(fn, device, repeats):  # forward 10 ms, forward + backward 9 ms: every try
        calls.append(fn)
        return 0.010 if len(calls) % 2 else 0.009

    monkeypatch.setattr(cp, "median_time", noisy)
    with caplog.at_level("WARNING", logger=cp.__name__):
        fwd, bwd = cp._compiled_block_times(None, None, None, None, None, "cpu", 3)
    assert (fwd, bwd) == (0.010, 0.020) and len(calls) == 2 * cp.BACKWARD_ATTEMPTS
    assert "priced at twice the forward" in caplog.text
    calls.clear()
    plausible = iter([0.010, 0.009, 0.010, 0.031])  # noise on the first try only
    monkeypatch.setattr(cp, "median_time", lambda fn, device, repeats: next(plausible))
    assert cp._compiled_block_times(None, None, None, None, None, "cpu", 3) == (0.010, 0.031 - 0.010)
