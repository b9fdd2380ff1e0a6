"""Run settings the planners must price or honour as the run applies them: parallel.loss_parallel (the joint
and the AMSP planner's memory), amsp.planner.tp / pp under the joint planner (the CLI's --joint and train.py's
parallel.auto startup alike), and a pipeline whose micro-batches per step cannot fill it (simulate)."""
from __future__ import annotations

import json

import pytest

from amsp.planner.__main__ import main
from amsp.planner.workload import Workload
from amsp.schedule import Precision
from models.llama import get_preset

# One layout only: a global batch of 1 sample leaves out tp 1 (dp 2 does not split it) and pp 2 (1 micro-batch
# for 2 stages), so tp 2 x dp 1 is what fits or nothing does. A large vocabulary makes the logits count.
LOGITS_CASE = ["--joint", "--json", "model=tiny", "model.vocab_size=65536", "data.seq_len=1024", "cluster=h100x8",
               "cluster.ranks_per_node=2", "cluster.nodes=1", "cluster.device_memory_gib=0.95",
               "trainer.global_batch_size=1", "trainer.micro_batch_size=1", "amsp.planner.reserved_gib=0",
               "amsp.planner.memory_margin=0"]


def test_joint_planner_prices_the_full_logits_without_loss_parallel(capsys):
    """parallel.loss_parallel=false with tp > 1: the head all-gathers the full-vocabulary logits on every TP
    rank and the plain cross-entropy runs on them (its saved log-softmax and its backward's 2 fp32 tensors at
    the whole vocabulary). A tp 2 plan that fits only with the logits vocabulary-sharded was returned as
    feasible with loss parallelism off (0.83 GiB priced where 1.08 is needed, on a 0.95 GiB device)."""
    assert main(LOGITS_CASE + ["parallel.loss_parallel=true"]) == 0
    choice = json.loads(capsys.readouterr().out)["choice"]
    assert (choice["tp"], choice["pp"]) == (2, 1) and choice["stage_memory_gib"][0] <= 0.95
    assert main(LOGITS_CASE + ["parallel.loss_parallel=false"]) == 2
    out, err = capsys.readouterr()
    assert "no joint plan fits" in json.loads(out)["error"]
    assert "tp2 pp1 dp1 mbs1 did not fit with parallel.loss_parallel=false" in err.strip().splitlines()[-1]

    # the terms, against the plain cross-entropy of one rank holding the whole vocabulary (tp 1, pipelined)
    cfg = get_preset("tiny").with_overrides(vocab_size=32000)
    fp32 = Precision.named("fp32")
    t_v = 2 * 256 * 32000  # micro-batch x seq x vocabulary
    on = Workload(cfg, 256, 2, 4, fp32, tp=2)
    off = Workload(cfg, 256, 2, 4, fp32, tp=2, loss_parallel=False)
    assert off.loss_vocab == 32000 and on.loss_vocab == 16000
    assert on.loss_backward_transient_bytes() == 3 * t_v * 4 / 2  # DTensor's loss_parallel, a local shard
    assert off.loss_backward_transient_bytes() == 2 * t_v * 4
    assert off.loss_saved_bytes() == t_v * 4 == 2 * on.loss_saved_bytes()
    piped_on = Workload(cfg, 256, 2, 4, fp32, tp=2, pp=2)
    piped_off = Workload(cfg, 256, 2, 4, fp32, tp=2, pp=2, loss_parallel=False)
    # the stage's output: the gathered logits, then their log-softmax, each the whole vocabulary's
    assert piped_off.head_activation_bytes() - piped_on.head_activation_bytes() == t_v * 4
    # without tensor parallelism the setting changes nothing (there is nothing to shard)
    assert Workload(cfg, 256, 2, 4, fp32, pp=2, loss_parallel=False).head_activation_bytes() == \
        Workload(cfg, 256, 2, 4, fp32, pp=2).head_activation_bytes()
    # the head's time from FLOPs adds the logits' all-gather inside the node (measured units include it)
    from amsp.plan import Degrees
    from amsp.planner.joint.hetero import from_spec, load_preset
    from amsp.planner.joint.search import price_config

    step = {lp: price_config(cfg, from_spec(load_preset("a100x8", 1)), seq_len=256, global_batch=16, precision=fp32,
                             tp=2, pp=1, micro_batch_size=2, degrees=Degrees(1, 1, 1), loss_parallel=lp)[0]
            for lp in (True, False)}
    assert step[False] > step[True]


def test_amsp_planner_prices_a_hand_named_tp_without_loss_parallel(capsys):
    """The AMSP planner of a hand-named parallel.tp reads parallel.loss_parallel too (train.py's startup
    prices the run through the same workload_from_config)."""
    args = ["--json", "--price", "ddp", "model=tiny", "model.vocab_size=65536", "data.seq_len=1024",
            "cluster=h100x8", "cluster.nodes=1", "parallel.tp=2", "trainer.micro_batch_size=1",
            "trainer.global_batch_size=4"]
    memory = {}
    for lp in ("true", "false"):
        assert main(args + [f"parallel.loss_parallel={lp}"]) == 0
        memory[lp] = json.loads(capsys.readouterr().out)["priced"][0]["memory_total_bytes"]
    assert memory["false"] > memory["true"]


FIXED_CASE = ["model=tiny", "cluster=a100x8", "trainer.global_batch_size=64", "amsp.planner.tp=2",
              "amsp.planner.pp=2"]


def test_joint_cli_searches_only_the_layout_amsp_planner_tp_pp_fix(capsys):
    """amsp.planner.tp / pp with --joint fix the searched tp x pp (the rest is still chosen); they were read
    by nothing and the search ranged over every layout. A layout the search cannot take, or a given 1 x 1
    (their default, which cannot be told from unset at train.py's startup), is one line naming them."""
    assert main(["--joint", "--json", "amsp.planner.top_k=50"] + FIXED_CASE) == 0
    out = json.loads(capsys.readouterr().out)
    plans = [out["choice"]] + out["alternatives"]
    assert {(p["tp"], p["pp"]) for p in plans} == {(2, 2)} and len(plans) > 1
    assert any("fixed by amsp.planner.tp / amsp.planner.pp" in n for n in out["choice"]["notes"])
    assert out["inputs"]["fixed_layout"] == {"tp": 2, "pp": 2}
    for bad, message in ((["amsp.planner.tp=3"], "amsp.planner.tp=3, amsp.planner.pp=1: the joint planner cannot "
                                                 "run tp=3"),
                         (["amsp.planner.tp=16"], "amsp.planner.tp=16, amsp.planner.pp=1: the joint planner cannot"),
                         (["amsp.planner.pp=3"], "amsp.planner.tp=1, amsp.planner.pp=3: tp x pp must divide the 8"),
                         (["amsp.planner.tp=1"], "amsp.planner.tp=1: with --joint, amsp.planner.tp / "
                                                 "amsp.planner.pp fix the searched layout only other than tp 1")):
        assert main(["--joint", "model=tiny", "cluster=a100x8", "trainer.global_batch_size=64"] + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and message in err[-1], err


def test_joint_startup_searches_the_same_fixed_layout(capsys):
    """train.py's parallel.auto startup reads amsp.planner.tp / pp as the CLI does: it ignored them, and a
    later recheck (with_model_parallel) would have found them contradicting the chosen parallel.tp / pp."""
    from amsp.launch import DistEnv
    from amsp.parallel.joint_startup import joint_plan_for_run
    from amsp.planner.__main__ import compose_config
    from amsp.planner.from_config import with_model_parallel

    cfg = compose_config(FIXED_CASE + ["parallel.auto=true", "amsp.planner.probe=false",
                                       "amsp.planner.measure_compute=false"])
    denv = DistEnv(rank=0, world_size=8, local_rank=0, local_world_size=8, launcher="torchrun")
    run_cfg, plan, table = joint_plan_for_run(cfg, denv, "cpu", None)
    assert (plan.tp, plan.pp) == (2, 2) == (run_cfg.parallel.tp, run_cfg.parallel.pp)
    assert "fixed by amsp.planner.tp / amsp.planner.pp" in table
    with_model_parallel(run_cfg, what_if=False)  # the run's degrees agree with the planner's what-if ones
    assert main(["--joint", "--json"] + FIXED_CASE) == 0
    choice = json.loads(capsys.readouterr().out)["choice"]
    assert (choice["tp"], choice["pp"]) == (plan.tp, plan.pp)
    from amsp.errors import InputError

    with pytest.raises(InputError, match=r"amsp.planner.tp=3, amsp.planner.pp=2: the joint planner cannot run tp=3"):
        joint_plan_for_run(compose_config(FIXED_CASE[:-2] + ["amsp.planner.tp=3", "amsp.planner.pp=2",
                                                             "parallel.auto=true", "amsp.planner.probe=false",
                                                             "amsp.planner.measure_compute=false"]),
                           denv, "cpu", None)


# 64 samples of 1 over pp 4: 64 GPUs give dp 16 and 4 micro-batches a step (fills), 256 GPUs dp 64 and 1
SIM_CASE = ["simulate", "--json", "--gpus", "64,256", "model=llama2_7b", "cluster=a800x8", "parallel.pp=4",
            "trainer.global_batch_size=64", "trainer.micro_batch_size=1", "data.seq_len=2048"]


def test_simulate_flags_a_pipeline_with_fewer_micro_batches_than_stages(capsys):
    """simulate priced a GPU count whose micro-batches per step (1) were fewer than the pipeline's stages (4)
    as any other: 1F1B refuses it at train.py's startup (one row saying so, as the plan CLI refuses it);
    GPipe runs it with a bubble of (pp-1)/m = 300% of the compute (its rows carry a warning)."""
    assert main(SIM_CASE) == 0
    rows = json.loads(capsys.readouterr().out)["simulation"]
    at = {n: [r for r in rows if r["gpus"] == n] for n in (64, 256)}
    assert all("step_s" in r and "warning" not in r for r in at[64])
    assert len(at[256]) == 1 and "step_s" not in at[256][0]
    assert "parallel.schedule=1f1b needs at least parallel.pp=4 micro-batches per step, got 1" in at[256][0]["note"]
    assert main(SIM_CASE + ["parallel.schedule=gpipe"]) == 0
    rows = json.loads(capsys.readouterr().out)["simulation"]
    late = [r for r in rows if r["gpus"] == 256]
    assert late and all("step_s" in r and "pipeline never fills" in r["warning"] and "300%" in r["warning"]
                        for r in late)
    assert all("warning" not in r for r in rows if r["gpus"] == 64)
    assert main([a for a in SIM_CASE if a != "--json"] + ["parallel.schedule=gpipe"]) == 0
    text = capsys.readouterr().out
    assert text.count("warning: 1 micro-batch(es) per step < parallel.pp=4 stages") == 1
