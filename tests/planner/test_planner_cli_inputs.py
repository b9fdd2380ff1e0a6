"""The planner CLI's inputs (python -m amsp.planner): options a mode does not read refused, overrides
anywhere, input errors before any output and naming their key, a compute profile checked against the
planned shape, the no-fit error's hints by context, parameter counts in a unit that shows them."""
from __future__ import annotations

import json
import logging

import pytest

from amsp.planner.__main__ import main

H100 = ["cluster=h100x8"]  # a GPU preset: nothing measured on this machine


@pytest.mark.parametrize("args, message", [
    (["--gpus", "64"], "--gpus 64 applies only with simulate"),
    (["simulate", "--price", "8/8/8"], "--price 8/8/8: not available with simulate"),
])
def test_an_option_the_mode_does_not_read_is_refused(capsys, args, message):
    """--gpus planned one node and --price under simulate was dropped, silently."""
    assert main(args + ["model=debug"] + H100) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [f"error: {err.strip().split('error: ', 1)[1]}"]
    assert message in err


def test_overrides_may_follow_an_option(capsys):
    """`model=... --json cluster=...` was 'unrecognized arguments: cluster=...'."""
    assert main(["model=debug", "--json", "cluster=h100x8", "--price", "zero3", "cluster.nodes=2"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["cluster"]["name"] == "h100x8" and inputs["cluster"]["nodes"] == 2


@pytest.mark.parametrize("args, message", [
    (["simulate", "--gpus", "0"], "--gpus 0: expected comma-separated GPU counts"),
    (["--price", "nonsense"], "cannot read plan 'nonsense'"),
    (["cluster.dtype=fp8"], "cluster.dtype"),
    (["amsp.planner.mfu=1.5"], "amsp.planner.mfu"),
])
def test_an_input_error_comes_before_any_output(capsys, args, message):
    """The cluster's 12-line header was printed before these errors."""
    assert main(args + ["model=debug"] + H100) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert err.strip().splitlines()[-1].startswith("error: ") and message in err


@pytest.mark.parametrize("model, count", [("debug", "164.16K"), ("tiny", "7.34M")])
def test_small_parameter_counts_show_their_digits(capsys, model, count):
    """model=debug was '0.00B parameters per rank' (train.py logs 0.16M)."""
    assert main([f"model={model}"] + H100) == 0
    assert f"model {model}: {count} parameters per rank" in capsys.readouterr().out


def test_no_fit_names_the_cli_keys_and_skips_activation_hints_when_states_are_over(capsys):
    """A 7B model's states are ~113 of 125 GiB: recomputation cannot help, and the CLI's keys are named."""
    assert main(["model=llama2_7b", "cluster=h100x8", "cluster.ranks_per_node=1", "cluster.device_memory_gib=20"]) == 2
    err = capsys.readouterr().err
    assert "no sharding plan fits" in err and "model states (params + grads + optim) are" in err
    assert "activation_checkpointing" not in err and "data.seq_len" not in err
    assert "cluster.nodes" in err and "parallel.tp / parallel.pp" in err and "amsp.planner.tp" not in err


def test_no_fit_under_activations_suggests_shrinking_them(capsys):
    assert main(["model=tiny", "cluster=h100x8", "cluster.device_memory_gib=2", "data.seq_len=1024",
                 "trainer.micro_batch_size=64", "trainer.global_batch_size=512"]) == 2
    err = capsys.readouterr().err
    assert "Try: more activation recomputation" in err and "trainer.micro_batch_size < 64" in err


def test_startup_refuses_a_plan_that_cannot_fit_before_timing_the_compute(monkeypatch):
    """train.py timed the compute profile (~44 s for a 7B block on a CPU) before a memory failure that does
    not depend on it; its hints named the CLI's amsp.planner.tp / pp and recomputation for states."""
    from amsp.launch import DistEnv
    from amsp.planner import NoFeasiblePlan, plan_for_run, startup
    from amsp.planner.__main__ import compose_config

    def not_timed(*a, **k):
        raise AssertionError("the compute profile was timed before the memory check")

    monkeypatch.setattr(startup, "measured_compute", not_timed)
    cfg = compose_config(["model=llama2_7b", "data.seq_len=256", "trainer.micro_batch_size=1",
                          "trainer.global_batch_size=1", "cluster.peak_tflops=0.05", "cluster.device_memory_gib=20",
                          "amsp.planner.measure_compute=true"])
    with pytest.raises(NoFeasiblePlan) as e:
        plan_for_run(cfg, DistEnv(0, 1, 0, 1, "single"))
    msg = str(e.value)
    assert "parallel.tp / parallel.pp" in msg and "more GPUs" in msg
    assert "amsp.planner.tp" not in msg and "activation_checkpointing" not in msg


# ---- --compute-profile FILE against the planned model ------------------------------------------------

TIMES = {"block_forward_s": 0.01, "block_backward_s": 0.02, "head_forward_backward_s": 0.01, "embedding_s": 0.001}
def _planned_debug_shape() -> dict:
    """model=debug on h100x8 as the CLI plans it (the record is compared field by field)."""
    from amsp.planner.__main__ import compose_config, planned_shape
    from amsp.planner.from_config import cluster_spec

    cfg = compose_config(["model=debug"] + H100)
    return {**planned_shape(cfg, cluster_spec(cfg)), "device_name": "NVIDIA H100 80GB HBM3"}


def _profile_file(tmp_path, shape):
    path = tmp_path / "compute-x.json"
    path.write_text(json.dumps({"key": "x", **({} if shape is None else {"shape": shape}), "profile": TIMES}))
    return str(path)


def test_a_profile_measured_for_another_model_is_refused(tmp_path, capsys):
    path = _profile_file(tmp_path, {**_planned_debug_shape(), "dim": 4096, "heads": 32})
    assert main(["--compute-profile", path, "model=debug"] + H100) == 2
    out, err = capsys.readouterr()
    assert out == "" and "measured for dim 4096, heads 32, the planned run is dim 64, heads 4" in err


def test_a_profile_measured_on_another_gpu_is_refused(tmp_path, capsys):
    path = _profile_file(tmp_path, {**_planned_debug_shape(), "device_name": "NVIDIA A100-SXM4-80GB"})
    assert main(["--compute-profile", path, "model=debug"] + H100) == 2
    err = capsys.readouterr().err
    assert "measured on NVIDIA A100-SXM4-80GB (cluster=a100x8), the planned cluster is h100x8" in err


def test_a_matching_profile_is_used_and_its_source_printed(tmp_path, capsys):
    path = _profile_file(tmp_path, _planned_debug_shape())
    assert main(["--compute-profile", path, "model=debug"] + H100) == 0
    out = capsys.readouterr().out
    assert f"compute from file:{path} (measured for dim 64," in out
    assert main(["simulate", "--gpus", "8", "--compute-profile", path, "model=debug"] + H100) == 0
    assert f"compute from file:{path} (measured for dim 64," in capsys.readouterr().out


def test_a_profile_without_a_shape_is_accepted_with_a_warning(tmp_path, capsys, caplog):
    path = _profile_file(tmp_path, None)
    with caplog.at_level(logging.WARNING, logger="amsp.planner"):
        assert main(["--compute-profile", path, "model=debug"] + H100) == 0
    assert "records no model shape" in caplog.text and "cannot be checked" in caplog.text
    assert f"compute from file:{path} (shape not recorded: not checked)" in capsys.readouterr().out


def test_a_new_cache_file_records_the_shape_it_was_measured_for(tmp_path):
    """What train.py's startup writes (and reads: the "profile" field under the same key) now says what
    was timed, so the CLI can check it."""
    from amsp.planner.__main__ import compose_config
    from amsp.planner.compute_profile import measure_profile
    from configs.schema import to_llama_config

    cfg = compose_config(["model=debug", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
                          "model.n_kv_heads=4", "data.seq_len=32", "trainer.micro_batch_size=1"])
    model = to_llama_config(cfg.model)
    first = measure_profile(model, 32, 1, "fp32", "none", "cpu", 1, 0, tmp_path)
    (path,) = tmp_path.glob("compute-*.json")
    shape = json.loads(path.read_text())["shape"]
    assert {k: shape[k] for k in ("dim", "n_layers", "heads", "seq_len", "micro_batch", "dtype", "device")} == {
        "dim": 64, "n_layers": 2, "heads": 4, "seq_len": 32, "micro_batch": 1, "dtype": "fp32", "device": "cpu"}
    again = measure_profile(model, 32, 1, "fp32", "none", "cpu", 1, 0, tmp_path)  # the run's read is unchanged
    assert again.source.startswith("cache") and again.block_forward_s == first.block_forward_s
