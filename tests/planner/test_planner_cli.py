"""The command line and the Hydra cluster presets (no GPU, no ranks)."""
from __future__ import annotations

import pytest

from amsp.planner.__main__ import compose_config, main
from amsp.planner.from_config import cluster_spec, options_from_config, workload_from_config
from amsp.planner.solve import plan_cluster

ISSUE_ARGS = ["model=llama2_13b", "cluster=a800x8", "cluster.nodes=128", "data.seq_len=4096",
              "trainer.micro_batch_size=1", "trainer.global_batch_tokens=4194304"]


@pytest.mark.parametrize("name,peak,rpn", [("a100x8", 312, 8), ("a800x8", 312, 8), ("h100x8", 989, 8)])
def test_gpu_presets_load(name, peak, rpn):
    c = cluster_spec(compose_config([f"cluster={name}"]))
    assert c.peak_flops == peak * 1e12 and c.ranks_per_node == rpn and c.device_memory_bytes == 80 * 2**30
    assert c.source == "preset" and c.dtype == "bf16"
    for scope in ("intra", "inter"):  # every collective has a measured-style curve, no fallback
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert c.curves[(kind, scope)].gbps(2**30) > 50


def test_cpu_preset_measures_what_it_lacks():
    c = cluster_spec(compose_config(["cluster=cpu", "cluster.peak_tflops=0.1"]), nodes=2, ranks_per_node=2,
                     local_ranks=4)
    assert c.world == 4 and c.device_memory_bytes > 0 and c.source == "alpha-beta"


def test_cli_prints_the_table(capsys):
    assert main(ISSUE_ARGS) == 0
    out = capsys.readouterr().out
    assert "cluster a800x8: 128 node(s) x 8 ranks" in out
    assert "chosen plan: auto" in out and "best alternatives" in out
    for preset in ("ddp", "zero1", "zero2", "zero3", "hsdp"):
        assert f" {preset} " in out


def test_cli_simulate(capsys):
    assert main(["simulate", "--gpus", "8,1024"] + ISSUE_ARGS[:2] + ISSUE_ARGS[3:]) == 0
    out = capsys.readouterr().out
    for gpus in (8, 1024):
        rows = [line.split() for line in out.splitlines() if line.split()[:1] == [str(gpus)]]
        assert [r[1] for r in rows] == ["ddp", "zero1", "zero2", "zero3", "hsdp", "auto"]


def test_cli_prices_deepspeed_style_collectives_as_a_what_if(capsys):
    """--collectives tensor: the sharded plans' collectives as DeepSpeed ZeRO-3 issues them (BENCHMARKS.md,
    "Partitioner at A800 scale"): ZeRO-3 at 1024 GPUs falls far below this engine's per-unit collectives,
    ZeRO-1 (no parameter gathers) does not move; --joint refuses the switch instead of ignoring it."""
    import json

    args = ["simulate", "--gpus", "1024", "--json", "model=llama2_7b", "cluster=a800x8", "data.seq_len=4096",
            "trainer.micro_batch_size=1", "trainer.global_batch_tokens=4194304", "amsp.overlap_spread=true"]
    mfu = {}
    for granularity in ("unit", "tensor"):
        assert main(args + ["--collectives", granularity]) == 0
        rows = json.loads(capsys.readouterr().out)["simulation"]
        mfu[granularity] = {r["plan"]: r["mfu"] for r in rows}
    assert mfu["tensor"]["zero3"] < 0.5 * mfu["unit"]["zero3"]
    assert mfu["tensor"]["zero1"] == pytest.approx(mfu["unit"]["zero1"])
    assert main(["--joint", "--collectives", "tensor", "model=llama2_7b"]) == 2
    assert "--collectives tensor: not available with --joint" in capsys.readouterr().err


def test_cli_reports_no_feasible_plan(capsys):
    assert main(["model=llama2_70b", "cluster=a100x8", "data.seq_len=4096", "trainer.micro_batch_size=2",
                 "trainer.global_batch_size=16"]) == 2
    err = capsys.readouterr().err
    assert "no sharding plan fits" in err and "GiB over" in err


def test_paper_finding_at_scale():
    """AMSP (arXiv 2311.00257): at 1024 GPUs on 4x200 Gb/s nodes, with the parameter spread
    overlapped as AMSP does, a plan that shards the optimizer states across nodes but keeps P and G
    inside a node beats ZeRO-3 clearly."""
    cfg = compose_config(["model=llama2_7b", "cluster=a800x8", "cluster.nodes=128", "data.seq_len=2048",
                          "trainer.micro_batch_size=1", "trainer.global_batch_tokens=4194304",
                          "amsp.overlap_spread=true"])
    c = cluster_spec(cfg)
    res = plan_cluster(workload_from_config(cfg, c), c, options_from_config(cfg))
    zero3 = next(p for p in res.presets if p.plan.name == "zero3")
    assert res.chosen.step_time_s < 0.8 * zero3.step_time_s
    b = res.plan.blocks
    assert b.p <= 8 and b.g <= 8 and b.os > 8


def test_wandb_rows_match_columns():
    cfg = compose_config(ISSUE_ARGS)
    c = cluster_spec(cfg)
    columns, rows = plan_cluster(workload_from_config(cfg, c), c, options_from_config(cfg)).wandb_table()
    assert rows and all(len(r) == len(columns) for r in rows)
    assert rows[0][0] == 1 and rows[0][2] == "auto"


def test_spread_window_reaches_the_planner():
    assert options_from_config(compose_config(["model=debug"])).spread_window == 2
    assert options_from_config(compose_config(["model=debug", "amsp.spread_window=5"])).spread_window == 5
    with pytest.raises(ValueError, match="amsp.spread_window=0 must be >= 1"):
        options_from_config(compose_config(["model=debug", "amsp.spread_window=0"]))


def test_cli_json_has_the_choice_every_candidate_and_the_inputs(capsys):
    import json

    assert main(["--json"] + ISSUE_ARGS) == 0
    out = json.loads(capsys.readouterr().out)  # stdout is JSON only (logs go to stderr)
    chosen = out["chosen"]
    assert chosen["name"] == "auto" and chosen["fits"] and 0 < chosen["mfu"] < 1
    assert set(chosen["degrees"]) == {"blocks", "embed_head"} and set(chosen["degrees"]["blocks"]) == {"p", "g", "os"}
    assert chosen["step_time_s"] == pytest.approx(chosen["compute_s"] + sum(chosen["exposed_s"].values()))
    assert chosen["memory_total_bytes"] == pytest.approx(sum(chosen["memory_bytes"].values()))
    assert {"params", "grads", "optim", "activations"} <= set(chosen["memory_bytes"])
    assert len(out["ranked"]) >= 2 and [c["name"] for c in out["presets"]] == ["ddp", "zero1", "zero2", "zero3", "hsdp"]
    assert out["ranked"][0]["plan"] == chosen["plan"]
    assert all(out["ranked"][i]["step_time_s"] <= out["ranked"][i + 1]["step_time_s"] + 1e-12
               for i in range(1, len(out["ranked"]) - 1))
    # every candidate of each unit group with its terms, beyond the ranked top_k
    cands = out["candidates"]
    assert len(cands["blocks"]) == len(cands["embed_head"]) == out["candidates_per_group"] > len(out["ranked"])
    b = chosen["degrees"]["blocks"]
    row = next(c for c in cands["blocks"] if (c["p"], c["g"], c["os"]) == (b["p"], b["g"], b["os"]))
    assert row["exposed_s"] >= 0 and row["state_bytes"] > 0 and "block" in row["gathered_bytes"]
    e = chosen["degrees"]["embed_head"]
    erow = next(c for c in cands["embed_head"] if (c["p"], c["g"], c["os"]) == (e["p"], e["g"], e["os"]))
    assert chosen["step_time_s"] == pytest.approx(cands["constant_s"] + row["exposed_s"] + erow["exposed_s"])
    inputs = out["inputs"]
    assert inputs["workload"]["seq_len"] == 4096 and inputs["workload"]["model"]["dim"] == 5120
    assert inputs["cluster"]["name"] == "a800x8" and "all_gather|inter" in inputs["cluster"]["curves"]
    assert inputs["compute_source"].startswith("FLOPs at 45% MFU") and inputs["bandwidth_source"] == "preset"
    assert "mfu" in inputs["options"]
    # what the activations were priced for (the CLI assumes; train.py's startup asks its device)
    assert inputs["workload"]["kernels"] == {"fused": ["linear_cross_entropy", "rms_norm", "rope", "swiglu"],
                                             "kv_repeated": False, "compiled": False}


def test_cli_plans_without_importing_torch():
    """The CLI starts fast because nothing it imports loads torch (the planner's memory model reads the
    fused ops' names from models/llama/fused_ops.py, not fused.py). Both planners, in a fresh process."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from amsp.planner.__main__ import main\n"
            f"assert main({ISSUE_ARGS!r}) == 0\n"
            "assert main(['--joint', 'model=llama2_7b', 'cluster=h100x8', 'cluster.nodes=2', 'data.seq_len=4096',"
            " 'trainer.global_batch_size=64']) == 0\n"
            "assert 'torch' not in sys.modules, 'the planner CLI imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["cluster=nosuch"], "Could not find 'cluster/nosuch'"),
    (["cluster=h100x8", "trainer.micro_batch_size=0"], "trainer.micro_batch_size=0 is not allowed"),
    (["data.seq_len=abc"], "could not be converted to Integer"),
    (["amsp.planner.top_k=0"], "amsp.planner.top_k=0 is not allowed"),
    (["simulate", "--gpus", "8,x"], "--gpus 8,x: expected comma-separated GPU counts"),
    (["--hetero", "configs/clusters_mixed/mixed_a100_v100.yaml"], "--hetero applies only with --joint"),
    (["--efficiency", "eff.json", "--hetero", "h.yaml"], "--hetero and --efficiency apply only with --joint"),
    (["--joint", "--price", "zero3"], "--price: not available with --joint"),
    (["simulate", "--joint"], "simulate: not available with --joint"),
    (["--joint", "model.activation_checkpointing=full"], "model.activation_checkpointing=full: not available"),
])
def test_cli_input_errors_are_one_line(capsys, args, message):
    """Bad input ends with one line and exit status 2, as train.py's does, never a traceback or an option
    silently dropped."""
    mode = args[:1] if args[0] == "simulate" else []
    assert main(mode + args[len(mode):] + ["model=debug"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and message in err[-1], err


def test_cli_prices_under_the_runs_model_parallel_degrees(capsys):
    """parallel.tp / pp reach the AMSP planner as they do at train.py's startup (its DP group's plan)."""
    import json

    assert main(["--json", "model=llama2_7b", "cluster=h100x8", "cluster.nodes=2", "parallel.tp=2",
                 "parallel.pp=2"]) == 0
    w = json.loads(capsys.readouterr().out)["inputs"]["workload"]
    assert (w["tp"], w["pp"]) == (2, 2)


def test_cli_prices_named_plans(capsys):
    import json

    assert main(["--json", "--price", "zero3", "--price", "8/8/1024|1/1/1024"] + ISSUE_ARGS) == 0
    priced = json.loads(capsys.readouterr().out)["priced"]
    assert [p["plan"] for p in priced] == ["1024/1024/1024", "8/8/1024 | 1/1/1024"]
    assert priced[0]["name"] == "zero3" and priced[1]["degrees"]["embed_head"] == {"p": 1, "g": 1, "os": 1024}
    assert priced[0]["step_time_s"] != priced[1]["step_time_s"]
    assert main(["--price", "hsdp"] + ISSUE_ARGS) == 0
    assert "priced plans" in capsys.readouterr().out


@pytest.mark.parametrize("plan,message", [("zero9", "cannot read plan 'zero9'"),
                                          ("3/3/3", "breaks the divisibility rule")])
def test_cli_bad_plan_is_a_one_line_error(capsys, plan, message):
    assert main(["--price", plan] + ISSUE_ARGS) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_cli_large_top_k_is_fast(capsys):
    """A long ranked table comes from the vectorised enumeration, not from re-solving: top_k=200 at
    1024 ranks stays within seconds: one cost-model evaluation per listed plan, no ILP per alternative."""
    import time

    t0 = time.perf_counter()
    assert main(["--json", "amsp.planner.top_k=200"] + ISSUE_ARGS) == 0
    ranked = __import__("json").loads(capsys.readouterr().out)["ranked"]
    assert len(ranked) == 200 and time.perf_counter() - t0 < 60


def test_joint_cli_prices_a_given_compute_profile(tmp_path, capsys):
    """--joint --compute-profile: the tp 1 units of the file, per node group or for every group, as train.py's
    startup prices what it measures (amsp/planner/joint_inputs.py); a group the cluster lacks is refused."""
    import json

    fields = {"block_forward_s": 0.002, "block_backward_s": 0.004, "head_forward_backward_s": 0.001,
              "embedding_s": 1e-4}
    args = ["--joint", "--json", "model=debug", "cluster=a100x8", "trainer.global_batch_size=64",
            "trainer.micro_batch_size=2"]
    assert main(args) == 0
    flops = json.loads(capsys.readouterr().out)
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"profile": fields}))
    assert main(["--compute-profile", str(one)] + args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["compute"][0].startswith(f"file:{one}") and flops["inputs"]["compute"] == [
        "amsp.planner.mfu=0.45"]
    assert out["choice"]["step_s"] != flops["choice"]["step_s"]
    slower = tmp_path / "slower.json"
    slower.write_text(json.dumps({"profile": {k: 10 * v for k, v in fields.items()}}))
    assert main(["--compute-profile", str(slower)] + args) == 0
    assert json.loads(capsys.readouterr().out)["choice"]["step_s"] > out["choice"]["step_s"]
    mixed = ["--joint", "--hetero", "configs/clusters_mixed/mixed_a100_v100.yaml", "model=debug",
             "trainer.global_batch_size=64"]
    per_group = tmp_path / "groups.json"
    per_group.write_text(json.dumps({"profiles": {"a100x8": fields, "v100x8": {k: 3 * v for k, v in fields.items()}}}))
    assert main(["--json", "--compute-profile", str(per_group)] + mixed) == 0
    sources = json.loads(capsys.readouterr().out)["inputs"]["compute"]
    assert [s.split(":")[0] for s in sources] == ["a100x8", "v100x8"]
    per_group.write_text(json.dumps({"profiles": {"h100x8": fields}}))
    assert main(["--compute-profile", str(per_group)] + mixed) == 2
    assert "node group 'h100x8' is not in the cluster" in capsys.readouterr().err
    eff = tmp_path / "eff.json"
    for bad, message in (({"a100x8": 0}, "a fraction of peak in (0, 1]"), ({"zzz": 0.5}, "'zzz' is not a node group"),
                         ([0.5], "expected a JSON object")):
        eff.write_text(json.dumps(bad))
        assert main(["--efficiency", str(eff)] + mixed) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [["model=debug", "--gpus=8", "simulate"], ["--json", "simulate", "model=debug",
                                                                          "--gpus", "8"]])
def test_cli_mode_word_may_stand_anywhere(capsys, args):
    """After the first argument it was an override (a Hydra grammar error) or made --gpus look misplaced."""
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ('"simulation"' in out) if "--json" in args else ("auto" in out)


@pytest.mark.parametrize("args, message", [
    (["--joint", "--gpus", "8"], "--gpus 8: not available with --joint"),  # was "applies only with simulate"
    (["plan", "simulate"], "plan and simulate: give one mode"),
])
def test_cli_mode_errors_say_what_is_wrong(capsys, args, message):
    assert main(args + ["model=debug"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err


def test_simulate_refuses_before_printing_the_cluster(capsys):
    """The cluster's header came before the error line; a refused run prints its one error line only."""
    assert main(["simulate", "model=debug", "parallel.tp=2", "--gpus", "3,4"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "tp=2 must divide ranks_per_node=1" in cap.err.strip().splitlines()[-1]


def test_count_text_does_not_claim_train_py_format():
    """train.py logs 0.16M parameters; the CLI's 164.16K is its own format, so the docstring must not say
    otherwise."""
    from amsp.planner.__main__ import count_text

    assert count_text(164_160) == "164.16K" and "as train.py logs it" not in count_text.__doc__
