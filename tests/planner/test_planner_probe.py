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
                          f"amsp.planner.cache_dir={tmp}", "amsp.planner.top_k=3", "amsp.planner.probe_budget_s=1",
                          "amsp.planner.probe_max_mib=4", "amsp.planner.measure_compute=false"])
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
            assert 1 <= len(values) <= 6 and all(v > 0 for v in values), line  # 64KiB..4MiB, budget-cut
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
    assert base != cache_key(Topology(4, 2), ["a"] * 4, "gloo", cpu, sizes=(2**16,))  # the sizes tried
    assert base != cache_key(Topology(4, 2), ["a"] * 4, "gloo", cpu, budget_s=1.0)


def test_network_identity_tells_other_links_apart(monkeypatch):
    """The same host behind another network namespace or interface (the emulated cluster's shaped links)
    must not reuse the loopback probe's cache."""
    from amsp.planner.probe import network_identity

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    plain = network_identity()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert network_identity() != plain
    monkeypatch.setattr("os.readlink", lambda path: "net:[4026532999]")
    shaped = network_identity()
    monkeypatch.setattr("os.readlink", lambda path: "net:[4026531840]")
    assert network_identity() != shaped


def test_probe_sizes_reach_256mib():
    from amsp.planner.probe import PROBE_SIZES, probe_sizes

    assert PROBE_SIZES[0] == 64 * 2**10 and PROBE_SIZES[-1] == 256 * 2**20
    assert probe_sizes(4 * 2**20) == (2**16, 2**18, 2**20, 2**22)


def test_merge_keeps_the_measured_range_and_joins_the_preset_continuously():
    from amsp.planner.cluster import BandwidthCurve
    from amsp.planner.probe import merge_curve

    preset = BandwidthCurve(((2**10, 10.0), (2**14, 40.0), (2**18, 100.0), (2**22, 200.0), (2**26, 220.0)))
    measured = [(2**15, 30.0), (2**17, 60.0), (2**19, 90.0)]  # slower than the preset here
    merged = merge_curve(preset, measured)
    for size, gbps in measured:  # inside the measured range the measurement wins
        assert merged.gbps(size) == pytest.approx(gbps)
    assert merged.gbps(2**16) == pytest.approx(45.0)  # interpolated between measured points only
    # outside: the preset's shape scaled to meet the measurement at each end
    low_scale, high_scale = 30.0 / preset.gbps(2**15), 90.0 / preset.gbps(2**19)
    assert merged.gbps(2**10) == pytest.approx(10.0 * low_scale)
    assert merged.gbps(2**26) == pytest.approx(220.0 * high_scale)
    assert merged.gbps(2**22) / merged.gbps(2**26) == pytest.approx(200.0 / 220.0)
    for edge in (2**15, 2**19):  # continuous at the joins: no jump just outside the measured range
        assert merged.gbps(edge * 0.999) == pytest.approx(merged.gbps(edge), rel=1e-2)
        assert merged.gbps(edge * 1.001) == pytest.approx(merged.gbps(edge), rel=1e-2)
    assert merge_curve(None, measured).points == tuple(measured)  # nothing to merge with


@pytest.mark.parametrize("device,preset", [
    ("NVIDIA H100 80GB HBM3", "h100x8"), ("NVIDIA H100 PCIe", "h100x8"), ("NVIDIA H200", "h200x8"),
    ("NVIDIA H800", "h100x8"), ("NVIDIA A100-SXM4-40GB", "a100x8"), ("NVIDIA A800-SXM4-80GB", "a800x8"),
    ("Tesla V100-SXM2-32GB", "v100x8"), ("NVIDIA L40S", None)])
def test_gpu_device_recognised(device, preset):
    from omegaconf import OmegaConf

    from amsp.planner.cluster import cluster_from_config
    from amsp.planner.device_preset import load_preset, preset_for_device, recognise
    from configs.schema import ClusterConfig

    assert preset_for_device(device) == preset
    cpu = OmegaConf.structured(ClusterConfig)  # the default (configs/train.yaml: cluster: cpu): none named
    assert cpu.name == "cpu"
    chosen = recognise(cpu, device, device_memory_gib=39.5)
    if preset is None:
        assert chosen is cpu  # unknown GPU: said so in the log, the cpu figures stay
        return
    spec = cluster_from_config(chosen, nodes=1, ranks_per_node=1)
    # v100x8 gives alpha-beta figures, the others measured curves
    assert spec.name == preset and spec.dtype == "bf16" and spec.source in ("preset", "alpha-beta")
    assert spec.device_memory_bytes == int(39.5 * 2**30)  # the real device's memory, not the preset's
    assert spec.busbw_gbps("all_gather", "intra", 2**20) > 20  # not the cpu preset's 2 GB/s
    named = load_preset("a100x8")
    assert recognise(named, device) is named  # a cluster the user named is kept
    # a PCIe H100 shares the SXM preset's links, not its chip: its own datasheet peak and HBM bandwidth
    pcie = "PCIe" in device
    assert spec.peak_flops == (756e12 if pcie else load_preset(preset).peak_tflops * 1e12)
    assert spec.memory_bandwidth_gbs == (2000 if pcie else load_preset(preset).memory_bandwidth_gbs)


def test_measured_points_replace_only_their_curves():
    from amsp.planner.probe import apply_points
    from planner_cases import flat_cluster

    c = flat_cluster(1, 4, curves=False)
    measured = apply_points(c, {("all_gather", "intra"): [(2**20, 1.5), (2**16, 0.5)],
                                ("all_gather", "inter_one_group"): [(2**16, 9.0)]}, "probe")
    assert measured.source == "probe" and measured.curves[("all_gather", "intra")].points == ((2**16, 0.5), (2**20, 1.5))
    assert ("all_reduce", "intra") not in measured.curves  # still the alpha-beta figures
    assert not any(scope == "inter_one_group" for _, scope in measured.curves)  # logged, not priced


def test_plan_for_run_single_process(tmp_path, caplog):
    """One process: nothing to probe (said so), a plan and RUN_DIR/plan.txt; too little memory is
    the NoFeasiblePlan error before anything is allocated."""
    import logging

    from amsp.launch import DistEnv
    from amsp.planner import NoFeasiblePlan, plan_for_run
    from amsp.planner.__main__ import compose_config

    single = DistEnv(0, 1, 0, 1, "single")
    cfg = compose_config(["model=debug", "cluster.peak_tflops=0.05", "cluster.device_memory_gib=4",
                          "amsp.planner.measure_compute=false"])  # measured in test_compute_profile.py
    with caplog.at_level(logging.INFO, logger="amsp.planner"):
        out = plan_for_run(cfg, single, run_dir=tmp_path)
    assert str(out.plan.blocks) == "1/1/1" and (tmp_path / "plan.txt").read_text() == out.table + "\n"
    assert "a single process has nothing to measure" in caplog.text
    tight = compose_config(["model=llama2_7b", "data.seq_len=1024", "trainer.micro_batch_size=1",
                            "trainer.global_batch_size=1", "cluster.peak_tflops=0.05", "cluster.device_memory_gib=4",
                            "amsp.planner.measure_compute=false"])
    with pytest.raises(NoFeasiblePlan, match="smallest-memory plan 1/1/1"):
        plan_for_run(tight, single)
