"""The startup probe and plan_for_run on real gloo ranks (4 ranks posing as 2 nodes x 2)."""
from __future__ import annotations

import pathlib

import pytest

from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _startup(rank: int, world: int, tmp: str) -> dict:
    from amsp.launch import DistEnv
    from amsp.planner.__main__ import compose_config
    from amsp.planner.startup import plan_for_run

    cfg = compose_config(["model=debug", "trainer.micro_batch_size=2", "trainer.global_batch_size=16",
                          "cluster.peak_tflops=0.05", "amsp.ranks_per_node=2", "amsp.planner.probe=true",
                          f"amsp.planner.cache_dir={tmp}", "amsp.planner.top_k=3"])
    denv = DistEnv(rank, world, rank, world, "test")
    first = plan_for_run(cfg, denv, run_dir=pathlib.Path(tmp) / "run")
    second = plan_for_run(cfg, denv)  # same shape: served from the cache
    return {"plan": first.plan, "again": second.plan, "table": first.table, "second": second.table,
            "rows": len(first.rows)}


def test_probe_and_plan_for_run(tmp_path):
    out = run_distributed(_startup, 4, str(tmp_path), timeout=300)
    assert all(o["plan"] == out[0]["plan"] == o["again"] for o in out)  # every rank builds the same plan
    first, second = out[0]["table"], out[0]["second"]
    assert "bandwidths from probe" in first and "bandwidths from cache" in second
    for scope in ("intra", "inter"):
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            line = next(x for x in first.splitlines() if x.split()[:2] == [scope, kind])
            values = [float(p.split(":")[1]) for p in line.split()[2:]]
            assert len(values) == 3 and all(v > 0 for v in values), line
    assert "chosen plan: auto" in first and (tmp_path / "run" / "plan.txt").read_text().startswith("cluster cpu")
    assert len(list(tmp_path.glob("probe-*.json"))) == 1


def test_cache_key_follows_the_cluster_shape():
    import torch

    from amsp.planner.probe import cache_key
    from amsp.topology import Topology

    cpu = torch.device("cpu")
    base = cache_key(Topology(4, 2), ["a"] * 4, "gloo", cpu)
    assert base == cache_key(Topology(4, 2), ["a"] * 4, "gloo", cpu)
    assert base != cache_key(Topology(4, 4), ["a"] * 4, "gloo", cpu)
    assert base != cache_key(Topology(4, 2), ["a", "a", "b", "b"], "gloo", cpu)
    assert base != cache_key(Topology(4, 2), ["a"] * 4, "nccl", cpu)


def test_measured_points_replace_only_their_curves():
    from amsp.planner.probe import apply_points
    from planner_cases import flat_cluster

    c = flat_cluster(1, 4, curves=False)
    measured = apply_points(c, {("all_gather", "intra"): [(2**20, 1.5), (2**16, 0.5)]}, "probe")
    assert measured.source == "probe" and measured.curves[("all_gather", "intra")].points == ((2**16, 0.5), (2**20, 1.5))
    assert ("all_reduce", "intra") not in measured.curves  # still the alpha-beta figures


def test_plan_for_run_single_process(tmp_path, caplog):
    """One process: nothing to probe (said so), a plan and RUN_DIR/plan.txt; too little memory is
    the NoFeasiblePlan error before anything is allocated."""
    import logging

    from amsp.launch import DistEnv
    from amsp.planner import NoFeasiblePlan, plan_for_run
    from amsp.planner.__main__ import compose_config

    single = DistEnv(0, 1, 0, 1, "single")
    cfg = compose_config(["model=debug", "cluster.peak_tflops=0.05", "cluster.device_memory_gib=4"])
    with caplog.at_level(logging.INFO, logger="amsp.planner"):
        out = plan_for_run(cfg, single, run_dir=tmp_path)
    assert str(out.plan.blocks) == "1/1/1" and (tmp_path / "plan.txt").read_text() == out.table + "\n"
    assert "a single process has nothing to measure" in caplog.text
    tight = compose_config(["model=llama2_7b", "data.seq_len=1024", "trainer.micro_batch_size=1",
                            "trainer.global_batch_size=1", "cluster.peak_tflops=0.05", "cluster.device_memory_gib=4"])
    with pytest.raises(NoFeasiblePlan, match="smallest-memory plan 1/1/1"):
        plan_for_run(tight, single)
