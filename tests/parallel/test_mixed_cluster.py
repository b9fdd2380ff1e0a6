"""parallel.cluster_file: a mixed cluster's file read and checked against the launch, each node group's
measurements kept apart (amsp/parallel/mixed_cluster.py, amsp/planner/joint/hetero.py), and a bad one
stopping every rank with its own message."""
from __future__ import annotations

import re

import pytest

from amsp.errors import InputError
from amsp.parallel.mixed_cluster import launch_problems
from amsp.planner.compute_profile import medians_by_group
from amsp.planner.device_preset import preset_for_device
from amsp.planner.joint.hetero import load_hetero, read_cluster_file
from tests.training.runs import train

TWO_KINDS = """name: two_kinds
node_groups:
  - {name: fast, preset: cpu, nodes: 1}
  - {name: slow, preset: cpu, nodes: 1}
"""


def _file(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_cluster_file_groups_named_apart_and_malformed_files_named(tmp_path):
    name, groups, inter = read_cluster_file(_file(tmp_path, TWO_KINDS))
    assert (name, groups, inter) == ("two_kinds", [("fast", "cpu", 1), ("slow", "cpu", 1)], {})
    mixed = load_hetero("configs/clusters_mixed/mixed_a100_v100.yaml")
    assert [(g.name, g.preset, g.nodes) for g in mixed.groups] == [("a100x8", "a100x8", 2), ("v100x8", "v100x8", 2)]
    assert mixed.group_names_by_rank() == ["a100x8"] * 16 + ["v100x8"] * 16
    bad = {
        "node_groups:\n  - {preset: a100x8}\n": "needs `preset` and `nodes`",
        "node_groups:\n  - {preset: a100x8, nodes: 0}\n": "a whole number >= 1",
        "node_groups: []\n": "node_groups is empty",
        "node_groups: [\n": "not readable as YAML",
        "- a100x8\n": "expected a mapping",
    }
    for text, why in bad.items():
        with pytest.raises(InputError, match=why):
            read_cluster_file(_file(tmp_path, text))
    with pytest.raises(InputError, match="does not exist"):
        read_cluster_file(tmp_path / "nope.yaml")
    # one name for two presets, or a bandwidth for a pair that is not in the file: refused, not guessed
    with pytest.raises(InputError, match="use different presets"):
        load_hetero(_file(tmp_path, "node_groups:\n  - {name: x, preset: a100x8, nodes: 1}\n"
                                    "  - {name: x, preset: v100x8, nodes: 1}\n"))
    with pytest.raises(InputError, match="inter_group_gbs names a100x8-h100x8"):
        load_hetero(_file(tmp_path, "node_groups:\n  - {preset: a100x8, nodes: 1}\n  - {preset: v100x8, nodes: 1}\n"
                                    "inter_group_gbs: {a100x8-h100x8: 25}\n"))


def test_every_malformed_key_is_named_with_the_file(tmp_path):
    """Wrong types and values in a cluster file: one InputError naming the file and the key, never a
    TypeError or ZeroDivisionError from inside the planner, and nothing accepted that would be misread."""
    two = "node_groups:\n  - {preset: a100x8, nodes: 2}\n  - {preset: v100x8, nodes: 2}\n"
    bad = {
        two + "inter_group_gbs: [1, 2]\n": "inter_group_gbs=[1, 2]; it maps",
        two + "inter_group_gbs: {a100x8-v100x8: 0}\n": "inter_group_gbs.a100x8-v100x8=0; a bandwidth",
        two + "inter_group_gbs: {a100x8-v100x8: -5}\n": "inter_group_gbs.a100x8-v100x8=-5; a bandwidth",
        two + "inter_group_gbs: {a100x8-v100x8: fast}\n": "inter_group_gbs.a100x8-v100x8='fast'",
        two + "inter_group_gbs: {a100x8-v100x8: .inf}\n": "inter_group_gbs.a100x8-v100x8=inf",
        "node_groups:\n  - {preset: a100x8, nodes: 2, name: [x]}\n": "node_groups[0].name=['x']",
        "node_groups:\n  - {preset: [a100x8], nodes: 2}\n": "node_groups[0].preset=",
        "node_groups:\n  - {preset: a100x8, nodes: 2, note: x}\n": "node_groups[0] has unknown key(s) note",
        "node_groups:\n  - {preset: a100x8, nodes: true}\n": "node_groups[0].nodes=True; a group has a whole number",
        "node_groups: {preset: a100x8, nodes: 2}\n": "node_groups is empty or not a list",
        two + "inter_gbs: {a100x8-v100x8: 5}\n": "unknown key(s) inter_gbs",
        "name: [x]\n" + two: "name=['x']; the cluster's name",
        "nodes: two\n": "nodes='two'; a cluster has a whole number of nodes",
    }
    for text, why in bad.items():
        path = _file(tmp_path, text)
        with pytest.raises(InputError, match="^" + re.escape(f"{path}: {why}")):
            read_cluster_file(path)
    from amsp.planner.joint.hetero import HeteroCluster

    mixed = load_hetero("configs/clusters_mixed/mixed_a100_v100.yaml")  # built in code: the same check
    with pytest.raises(InputError, match="inter_group_gbs.a100x8-v100x8=0; a bandwidth"):
        HeteroCluster("m", mixed.groups, {"a100x8-v100x8": 0})


def test_launch_checked_against_the_file():
    cluster = load_hetero("configs/clusters_mixed/mixed_a100_v100.yaml")  # 2 x a100x8 + 2 x v100x8
    a100, v100 = "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB"
    assert launch_problems(cluster, 32, [a100] * 16 + [v100] * 16, preset_for_device) == []
    assert launch_problems(cluster, 32, [None] * 32, preset_for_device) == []  # CPU: nothing tells kinds apart
    (size,) = launch_problems(cluster, 24, [a100] * 24, preset_for_device)
    assert "are 32 ranks, the launch has 24" in size
    # the hosts launched V100 nodes first: the A100 ranks sit in the v100x8 group's places
    (order,) = launch_problems(cluster, 32, [v100] * 16 + [a100] * 16, preset_for_device)
    # both kinds are recognised (v100x8 too), so every rank is out of place
    assert "rank 0 (node 0) runs on Tesla V100-SXM2-32GB (v100x8) but the file puts it in group a100x8" in order
    assert "and 28 more" in order and order.endswith("launch the hosts in the file's group order")


def test_each_group_keeps_the_median_of_its_own_ranks():
    rows = [[1.0, 10.0], [3.0, 30.0], [2.0, 20.0], [9.0, 90.0], [7.0, 70.0], [8.0, 80.0]]
    got = medians_by_group(rows, ["a", "a", "a", "b", "b", "b"])
    assert got == {"a": [2.0, 20.0], "b": [8.0, 80.0]} and list(got) == ["a", "b"]
    assert medians_by_group(rows[:2], ["only", "only"]) == {"only": [2.0, 20.0]}
    with pytest.raises(ValueError):
        medians_by_group(rows, ["a"] * 5)  # one group name per rank


def test_config_check_names_a_cluster_file_problem(tmp_path):
    from amsp.planner.__main__ import compose_config
    from configs.validate import ConfigError, validate_config

    def problem(*overrides) -> str:
        try:
            validate_config(compose_config(["model=debug", "amsp.plan=auto", *overrides]))
        except ConfigError as e:
            return str(e)
        return ""

    good = _file(tmp_path, TWO_KINDS)
    assert problem("parallel.auto=true", f"parallel.cluster_file={good}") == ""
    assert "without parallel.auto=true" in problem(f"parallel.cluster_file={good}")
    assert "does not exist" in problem("parallel.auto=true", f"parallel.cluster_file={tmp_path}/nope.yaml")
    unknown = _file(tmp_path, "node_groups:\n  - {preset: b200x8, nodes: 1}\n", "unknown.yaml")
    got = problem("parallel.auto=true", f"parallel.cluster_file={unknown}")
    assert got.startswith(f"parallel.cluster_file={unknown}: ") and "b200x8" in got and "not found" in got


ARGS = ["trainer.max_steps=3", "trainer.checkpoint_interval=0", "parallel.auto=true", "amsp.plan=auto",
        "amsp.ranks_per_node=2", "amsp.planner.probe_budget_s=1"]


# Slow (the suite's time budget): the file checks themselves run in the default run
# (test_config_check_names_a_cluster_file_problem and above).
@pytest.mark.slow
@pytest.mark.distributed
def test_a_bad_input_on_rank_0_of_the_joint_startup_stops_every_rank_with_its_message(tmp_path):
    """Rank 0 decides the joint plan; an input error there (a cluster file that is not this launch, no plan
    that fits) reaches every rank as itself. Before, rank 0 alone raised and the others died on a closed
    connection."""
    four_nodes = _file(tmp_path, TWO_KINDS.replace("nodes: 1", "nodes: 2"))
    cases = {"size": (f"parallel.cluster_file={four_nodes}", "does not describe this launch: its 4 nodes of 2 ranks"),
             "memory": ("cluster.device_memory_gib=0.001", "no joint plan fits")}
    for name, (override, message) in cases.items():
        proc = train(tmp_path / name, *ARGS, f"amsp.planner.cache_dir={tmp_path / 'cache'}", override, nproc=4,
                     check=False, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "Connection closed" not in out, out[-3000:]
        lines = proc.stderr.splitlines()
        for rank in range(4):  # rank 0's line has no prefix (amsp/errors.py)
            start = f"rank {rank}: input error: " if rank else "input error: "
            assert any(ln.startswith(start) and message in ln for ln in lines), (name, rank, out[-3000:])


@pytest.mark.distributed
@pytest.mark.slow  # one torchrun launch measuring two node groups: ~20 s
def test_parallel_auto_on_a_mixed_cluster_measures_each_group_and_trains(tmp_path):
    run = tmp_path / "mixed"
    proc = train(run, *ARGS, f"amsp.planner.cache_dir={tmp_path / 'cache'}",
                 f"parallel.cluster_file={_file(tmp_path, TWO_KINDS)}", nproc=4)
    out = proc.stdout + proc.stderr
    # timed at the run's micro-batch size (2) and at 1: the planner's other sizes lie on the line through them
    assert "micro-batch 1 x 32" in out and "micro-batch 2 x 32" in out, out[-3000:]
    for group in ("fast", "slow"):
        assert f"compute profile of node group {group} (" in out, out[-3000:]
        assert f"tensor-parallel profile of node group {group}: tp 2:" in out, out[-3000:]
    plan = (run / "plan.txt").read_text()
    assert plan.startswith("joint planner (compute: fast: measured on ") and "; slow: measured on " in plan
    assert "cluster two_kinds: 1 x fast" in plan and "why:" in plan
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
