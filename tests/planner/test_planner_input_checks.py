"""Planner inputs that used to crash deep in the pricing or be used silently: cluster figures, compute
profiles, cluster files, options the joint planner does not read, the gradient dtype and a rounded
batch. Each is one line and exit status 2, or is honoured and said (python -m amsp.planner, in-process)."""
from __future__ import annotations

import json

import pytest

from amsp.errors import InputError
from amsp.planner.__main__ import main
from amsp.planner.joint.hetero import load_hetero

V100 = ["model=llama2_7b", "cluster=v100x8", "cluster.nodes=4", "data.seq_len=4096", "trainer.micro_batch_size=1",
        "trainer.global_batch_tokens=4194304"]
JOINT = ["--joint", "--json", "model=llama2_7b", "cluster=h100x8", "cluster.nodes=4", "data.seq_len=4096",
         "trainer.global_batch_size=256"]
PROFILE = {"block_forward_s": 0.002, "block_backward_s": 0.004, "head_forward_backward_s": 0.001,
           "embedding_s": 1e-4}


def _last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    return err[-1]


# The config check (configs/validate.py, as train.py's) names them before the planner's own checks are reached
@pytest.mark.parametrize("override, message", [
    ("cluster.inter_bandwidth_gbs=0", "cluster.inter_bandwidth_gbs=0.0 is not allowed: expected a finite number > 0"),
    ("cluster.intra_bandwidth_gbs=-5", "cluster.intra_bandwidth_gbs=-5.0 is not allowed: expected a finite number > 0"),
    ("cluster.inter_bandwidth_gbs=inf", "cluster.inter_bandwidth_gbs=inf is not allowed"),
    ("cluster.inter_latency_us=-1000",
     "cluster.inter_latency_us=-1000.0 is not allowed: expected a finite number >= 0"),
    ("cluster.intra_latency_us=nan", "cluster.intra_latency_us=nan is not allowed"),
    ("cluster.memory_bandwidth_gbs=0", "cluster.memory_bandwidth_gbs=0.0 is not allowed: expected a finite number > 0"),
    ("cluster.memory_bandwidth_gbs=-3", "cluster.memory_bandwidth_gbs=-3.0 is not allowed"),
])
def test_cluster_bandwidths_and_latencies_are_checked(capsys, override, message):
    """A zero bandwidth divided the collective or optimizer time (ZeroDivisionError); a negative one or a
    negative latency priced communication as gaining time (MFU above 100%)."""
    assert main(V100 + [override]) == 2
    assert message in _last_error(capsys)


@pytest.mark.parametrize("change, message", [
    ({"block_forward_s": 0, "block_backward_s": 0, "head_forward_backward_s": 0, "embedding_s": 0},
     "block_forward_s, block_backward_s, head_forward_backward_s, embedding_s must be finite seconds > 0"),
    ({"embedding_s": 0}, "embedding_s must be finite seconds > 0"),
    ({"overlap_slowdown": 3}, "overlap_slowdown=3 must be in [0, 1]"),
    ({"overlap_slowdown": -0.5}, "overlap_slowdown=-0.5 must be in [0, 1]"),
    ({"optimizer_s_per_elem": -1e-9}, "optimizer_s_per_elem=-1e-09 must be finite seconds > 0"),
    ({"optimizer_s_per_elem": 0}, "optimizer_s_per_elem=0 must be finite seconds > 0"),
])
@pytest.mark.parametrize("joint", [False, True])
def test_compute_profile_values_are_checked(tmp_path, capsys, change, message, joint):
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({**PROFILE, **change}))
    args = ["--compute-profile", str(path), "model=debug", "cluster=h100x8"]
    assert main((["--joint"] if joint else []) + args) == 2
    assert f"--compute-profile {path}: {message}" in _last_error(capsys)


def test_overlap_slowdown_from_a_profile_file_is_labelled_as_the_file(tmp_path, capsys):
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({**PROFILE, "overlap_slowdown": 0.3}))
    assert main(["--compute-profile", str(path), "model=debug", "cluster=h100x8"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert f"slows compute by 0.30 s/s (--compute-profile {path})" in header and "measured at startup" not in header


def test_joint_planner_prices_gradients_in_grad_comm(capsys):
    """auto (the engine's default) reduces in fp32 on GPU; the joint planner priced bf16 whatever was set.
    Its stage memory for a plan is now the data-parallel planner's (--price) for the same plan."""
    out = {}
    for grad in ("fp32", "bf16"):
        assert main(JOINT + [f"amsp.grad_comm={grad}"]) == 0
        out[grad] = json.loads(capsys.readouterr().out)
    assert out["fp32"]["inputs"]["grad_bytes"] == 4 and out["bf16"]["inputs"]["grad_bytes"] == 2
    assert out["fp32"]["choice"]["stage_memory_gib"] != out["bf16"]["choice"]["stage_memory_gib"]
    for grad, res in out.items():
        c = res["choice"]
        if (c["tp"], c["pp"]) != (1, 1) or any(c["recompute"]):
            continue  # the data-parallel planner prices a plan without model parallelism at the same setting
        p, g, os_ = c["stage_plans"][0]
        assert main(["--json", "--price", f"{p}/{g}/{os_}", "model=llama2_7b", "cluster=h100x8", "cluster.nodes=4",
                     "data.seq_len=4096", "trainer.global_batch_size=256",
                     f"trainer.micro_batch_size={c['micro_batch_size']}", f"amsp.grad_comm={grad}"]) == 0
        priced = json.loads(capsys.readouterr().out)["priced"][0]
        assert priced["memory_total_bytes"] / 2**30 == pytest.approx(c["stage_memory_gib"][0], rel=1e-6)


def test_hetero_single_type_file_is_priced_from_its_own_figures(tmp_path, capsys):
    """A plain cluster file took only `nodes` from itself and the rest from the repository preset of its
    file name; a 16 GiB copy of h100x8 now plans against 16 GiB."""
    path = tmp_path / "h100x8.yaml"
    text = open("configs/cluster/h100x8.yaml").read()
    path.write_text(text.replace("device_memory_gib: 80", "device_memory_gib: 16").replace("nodes: 1", "nodes: 4"))
    cluster = load_hetero(path)
    assert [(g.nodes, g.spec.device_memory_bytes) for g in cluster.groups] == [(4, 16 * 2**30)]
    assert main(["--joint", "--json", "--hetero", str(path), "model=llama2_7b", "data.seq_len=4096",
                 "trainer.global_batch_size=256"]) == 0
    choice = json.loads(capsys.readouterr().out)["choice"]
    assert max(choice["stage_budget_gib"]) <= 16


@pytest.mark.parametrize("text, message", [
    ("", "neither node_groups nor a node type's figures"),
    ("name: x\n", "neither node_groups nor a node type's figures"),
    ("name: x\nnode_group:\n  - {preset: a100x8, nodes: 2}\n", "unknown key(s) node_group;"),
    ("name: x\npeak_tflop: 100\n", "unknown key(s) peak_tflop;"),
])
def test_hetero_file_without_groups_or_figures_names_what_is_wrong(tmp_path, capsys, text, message):
    path = tmp_path / "h3.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_hetero(path)
    assert message in str(e.value) and "no cluster preset" not in str(e.value)
    assert main(["--joint", "--hetero", str(path), "model=debug"]) == 2
    assert message in _last_error(capsys)


# What train.py refuses with parallel.auto=true (configs/validate.py): the schedule, virtual stages,
# recomputation per stage, AMSP degrees and a named plan were silently replaced by the joint planner's choice.
@pytest.mark.parametrize("override", ["parallel.tp=2", "parallel.pp=2", "parallel.layer_split=[16,16]",
                                      "++parallel.tp=1", "parallel.schedule=gpipe", "parallel.virtual_stages=2",
                                      "parallel.recompute_stages=[true]", "amsp.p=2", "amsp.embed_head_os=2",
                                      "amsp.plan=zero3"])
def test_joint_refuses_degrees_it_chooses(capsys, override):
    assert main(["--joint", "model=llama2_7b", "cluster=h100x8", override]) == 2
    assert f"{override}: not available with --joint" in _last_error(capsys)


def test_joint_takes_what_train_py_takes_with_parallel_auto(capsys):
    """Not chosen by the joint planner, so not refused: loss parallelism and amsp.plan=auto."""
    args = ["--joint", "--json", "model=debug", "cluster=h100x8", "trainer.global_batch_size=16"]
    assert main(args + ["parallel.loss_parallel=false", "amsp.plan=auto"]) == 0, capsys.readouterr().err


def test_joint_considers_tp_for_a_sequence_it_does_not_split(capsys):
    """Without sequence parallelism the sequence need not divide by tp (tensor_parallel.check_divisible):
    tp > 1 was left out for data.seq_len=63 as if it were split."""
    args = ["--joint", "--json", "model=debug", "cluster=h100x8", "data.seq_len=63", "trainer.global_batch_size=16",
            "amsp.planner.top_k=100"]
    for sp, tps in (("false", {1, 2}), ("true", {1})):  # the debug model's 2 kv heads: tp <= 2
        assert main(args + [f"parallel.sequence_parallel={sp}"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert {p["tp"] for p in [out["choice"], *out["alternatives"]]} == tps, (sp, out["choice"])


def test_a_pipeline_train_py_refuses_is_not_priced(capsys):
    """1F1B needs a micro-batch per stage: 2 samples on dp 2 are one each (the batch rounded up to the
    micro-batch size), which train.py refuses and the planner had priced."""
    args = ["model=debug", "cluster=h100x8", "parallel.tp=2", "parallel.pp=2", "trainer.global_batch_size=2"]
    assert main(args) == 2
    assert _last_error(capsys) == ("error: parallel.schedule=1f1b needs at least parallel.pp=2 micro-batches per "
                                   "step, got 1: lower trainer.micro_batch_size or raise trainer.global_batch_size")
    assert main(["--price", "zero3", *args[:-1], "trainer.micro_batch_size=1", "trainer.global_batch_size=4"]) == 0


def test_rounded_batch_is_said_and_in_the_json(capsys):
    """1024 samples on 6 ranks is priced as 1026: said once on stderr, both figures in inputs.workload."""
    args = ["--json", "model=llama2_7b", "cluster=h100x8", "cluster.nodes=1", "cluster.ranks_per_node=6",
            "data.seq_len=4096", "trainer.micro_batch_size=1", "trainer.global_batch_tokens=4194304"]
    assert main(args) == 0
    captured = capsys.readouterr()
    workload = json.loads(captured.out)["inputs"]["workload"]
    assert (workload["global_batch"], workload["requested_global_batch"]) == (1026, 1024)
    notes = [line for line in captured.err.splitlines() if "global batch 1024 samples" in line]
    assert len(notes) == 1 and "priced as 1026" in notes[0]
    assert main(args[:-1] + ["trainer.global_batch_size=1026"]) == 0  # nothing to say when it splits
    captured = capsys.readouterr()
    assert "global batch" not in captured.err
    assert json.loads(captured.out)["inputs"]["workload"]["requested_global_batch"] == 1026


def test_simulate_says_which_gpu_counts_round_the_batch(capsys):
    """simulate prices each GPU count at the batch train.py would take there: 1024 samples split on 8 and
    16 ranks, not on 24 (priced as 1032); said for 24 only, and every JSON row carries its batch."""
    args = ["simulate", "--json", "--gpus", "8,16,24", "model=llama2_7b", "cluster=h100x8", "data.seq_len=4096",
            "trainer.micro_batch_size=1", "trainer.global_batch_size=1024"]
    assert main(args) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "global batch 1024 samples" in line]
    assert len(notes) == 1 and notes[0].startswith("note: at 24 GPUs,") and "priced as 1032" in notes[0], notes
    batches = {(row["gpus"], row["global_batch"]) for row in json.loads(captured.out)["simulation"]}
    assert batches == {(8, 1024), (16, 1024), (24, 1032)}, batches


@pytest.mark.parametrize("joint", [False, True])
def test_json_without_a_fitting_plan_is_still_json(capsys, joint):
    args = ["--json", "model=llama2_70b", "cluster=v100x8", "data.seq_len=4096", "trainer.global_batch_size=16"]
    assert main((["--joint"] if joint else []) + args) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "fits" in out["error"] and out["inputs"]
    assert captured.err.strip().splitlines()[-1] == f"error: {out['error']}"


def test_joint_terms_say_tp_comm_is_within_the_compute():
    from amsp.planner.joint.search import _TERM_WORDS

    assert "within the stage compute" in _TERM_WORDS["tp_comm_s"]



def _cluster_file(tmp_path, name: str, edit) -> list[str]:
    """Overrides selecting a copy of the a100x8 preset with `edit` applied to its text (a config dir on
    Hydra's search path): a table Hydra's override grammar cannot write (a size key like 128KiB)."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[2] / "configs" / "cluster" / "a100x8.yaml").read_text()
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / f"{name}.yaml").write_text(edit(text))
    return [f"hydra.searchpath=[file://{tmp_path}]", f"cluster={name}"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-5"])
def test_a_non_finite_bandwidth_point_is_one_line(tmp_path, capsys, value):
    """NaN passed `bw <= 0` and reached the ILP, where CBC died with a traceback."""
    cluster = _cluster_file(tmp_path, "badx8", lambda t: t.replace("all_gather: {128KiB: 60,",
                                                                 f"all_gather: {{128KiB: {value},", 1))
    assert main(["model=debug"] + cluster) == 2
    assert "cluster.intra_node.all_gather: 128KiB:" in _last_error(capsys)


@pytest.mark.parametrize("points", [{"1MiB": float("nan")}, {"1MiB": float("inf")}, {"1MiB": 0}, {"1MiB": "x"},
                                    {"0": 5.0}, {float("inf"): 5.0}])
def test_curves_from_config_names_the_bad_point(points):
    from amsp.planner.cluster import BandwidthCurve, curves_from_config

    with pytest.raises(ValueError, match=r"^cluster\.inter_node\.reduce_scatter: "):
        curves_from_config({"reduce_scatter": points}, "inter")
    with pytest.raises(ValueError, match="finite"):  # the curve itself, as a probe or cache builds it
        BandwidthCurve(((1024, float("nan")),))


@pytest.mark.parametrize("table, message", [
    ({"all_gather": 5}, "cluster.intra_node.all_gather=5: expected a mapping of message size to GB/s"),
    (5, "cluster.intra_node=5: expected a mapping of collective kind"),
])
def test_a_scalar_where_a_table_belongs_names_its_key(table, message):
    """It was "'int' object has no attribute 'items'" (configs/validate.py shows the planner's reader's message)."""
    from amsp.planner.cluster import curves_from_config

    with pytest.raises(ValueError) as e:
        curves_from_config(table, "intra")
    assert str(e.value).startswith(message) and "attribute" not in str(e.value)


def test_a_scalar_bandwidth_table_on_the_command_line(capsys):
    assert main(["model=debug", "cluster=a100x8", "cluster.intra_node.all_gather=5"]) == 2
    err = _last_error(capsys)
    assert "cluster.intra_node.all_gather=5: expected a mapping of message size to GB/s" in err
    assert "has no attribute" not in err


def test_joint_refuses_tokens_that_are_no_whole_number_of_sequences(capsys):
    """The joint path floored 4000 / 256 to 15 samples; the data-parallel one refuses it (batch_geometry)."""
    assert main(["--joint", "model=debug", "trainer.global_batch_tokens=4000"]) == 2
    assert "trainer.global_batch_tokens=4000 is not a multiple of data.seq_len=256" in _last_error(capsys)


def test_no_fit_names_the_reserve_when_it_alone_fills_the_device(capsys):
    """It offered recomputation, a smaller micro-batch and a shorter sequence (0.02 GiB of activations
    against 0.52 GiB over) and never named amsp.planner.reserved_gib, the 1 GiB that is the whole excess."""
    assert main(["model=debug", "cluster.device_memory_gib=0.5"]) == 2
    err = _last_error(capsys)
    assert "amsp.planner.reserved_gib" in err
    assert not any(h in err for h in ("recomputation", "micro-batch", "shorter sequence", "more nodes")), err
    capsys.readouterr()
    assert main(["model=debug", "cluster.device_memory_gib=0.5", "amsp.planner.reserved_gib=0.1"]) == 0


def test_parallel_auto_without_joint_is_refused(capsys):
    """It printed the data-parallel table for parallel.tp / pp, where train.py runs the joint search."""
    assert main(["model=debug", "parallel.auto=true", "cluster.ranks_per_node=2"]) == 2
    err = _last_error(capsys)
    assert err.startswith("error: parallel.auto=true") and "--joint" in err


def test_state_budget_under_joint_advises_what_that_context_accepts(capsys):
    """The advice was "name parallel.tp / parallel.pp", which --joint (and parallel.auto=true) refuse."""
    from omegaconf import OmegaConf

    from amsp.planner.from_config import refuse_state_budget_for_joint
    from configs.schema import PlannerConfig

    assert main(["--joint", "model=debug", "amsp.planner.state_budget_gib=3"]) == 2
    err = _last_error(capsys)
    assert "drop --joint" in err and "name parallel.tp" not in err
    p = OmegaConf.merge(OmegaConf.structured(PlannerConfig), {"state_budget_gib": 3})
    with pytest.raises(ValueError, match="set parallel.auto=false and name parallel.tp / parallel.pp"):
        refuse_state_budget_for_joint(p)  # train.py's parallel.auto=true (amsp/parallel/joint_startup.py)


def test_model_parallel_degrees_too_large_for_the_world_name_the_key_given(capsys):
    """It named amsp.planner.tp*pp, which the CLI derives from the parallel.tp the user set."""
    assert main(["model=llama2_7b", "cluster=a100x8", "cluster.ranks_per_node=1", "parallel.tp=2"]) == 2
    err = _last_error(capsys)
    assert "parallel.tp x parallel.pp = 2 x 1 = 2 must divide the world size 1" in err
    assert "amsp.planner" not in err
