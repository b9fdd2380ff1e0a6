"""The two planes (amsp/control.py, amsp/routing_check.py), group timeouts and the pretend world.

The routing checker runs in every distributed test (tests/conftest.py sets AMSP_CHECK_ROUTING=1);
here it is tested itself: the bug class (a control value sent as a CPU tensor to WORLD, which gloo
accepts and NCCL refuses) must fail on CPU, and every legitimate route must pass.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

# Imported here, so before a spawned rank installs the checker: its aliases must be rebound then.
import amsp.collectives as collectives
from amsp import launch
from tests.distributed import run_distributed
from tests.training.runs import BASE, ROOT, losses, train

pytestmark = pytest.mark.distributed


def _raises(fn) -> str:
    """The RoutingError message fn raised ('' if none)."""
    from amsp.routing_check import RoutingError

    try:
        fn()
    except RoutingError as e:
        return str(e)
    return ""


def _checker_cases(rank: int, world: int) -> dict:
    from amsp import control, routing_check
    from amsp.collectives import Comm
    from amsp.groups import ensure_groups, process_group
    from amsp.metrics.stragglers import gather_rank_values
    from amsp.plan import Degrees
    from amsp.resilience import PreemptionHandler
    from amsp.topology import Topology

    assert routing_check.installed(), "the routing checker is not installed: AMSP_CHECK_ROUTING did not reach the rank"
    topo = Topology(world, world)
    ensure_groups([Degrees(world, world, world)], topo)
    ranks = tuple(range(world))
    comm = Comm(topo, rank)
    out = {}
    # The bug class, as resilience.py did it before the control plane: a CPU int64 to WORLD.
    out["raw_cpu_all_reduce"] = _raises(lambda: dist.all_reduce(torch.tensor([rank], dtype=torch.int64),
                                                                op=dist.ReduceOp.MAX))
    out["raw_all_reduce_on_subgroup"] = _raises(lambda: dist.all_reduce(torch.ones(1), group=process_group(ranks)))
    out["raw_barrier"] = _raises(lambda: dist.barrier())
    out["raw_all_gather_object"] = _raises(lambda: dist.all_gather_object([None] * world, rank))
    out["raw_broadcast_object_list"] = _raises(lambda: dist.broadcast_object_list([rank], src=0))
    # collectives.py took its alias at import: it must be checked as well.
    out["raw_alias_all_gather"] = _raises(lambda: collectives._all_gather(torch.empty(world), torch.ones(1),
                                                                           group=process_group(ranks)))
    # Plane mismatches: data-plane calls on the control group, wrong devices on either plane
    # ("meta" stands in for a device tensor on this CPU-only machine).
    with routing_check.data_plane():
        out["data_call_on_control_group"] = _raises(lambda: dist.all_reduce(torch.ones(1), group=control.group()))
        out["data_call_off_device"] = _raises(lambda: dist.all_reduce(torch.empty(1, device="meta")))
        out["object_call_on_data_plane"] = _raises(lambda: dist.all_gather_object([None] * world, rank))
    out["device_tensor_on_control_group"] = _raises(
        lambda: dist.all_reduce(torch.empty(1, device="meta"), group=control.group()))
    out["device_staged_object_on_control_group"] = _raises(
        lambda: dist.broadcast_object_list([rank], src=0, group=control.group(), device=torch.device("meta")))
    # Legitimate routes: nothing above was sent, so the group is still in step.
    handler = PreemptionHandler()
    handler.restore()  # only its flag is used here; the test process keeps its own signal handlers
    out["signal"] = handler.agreed_signal()
    handler.received = signal.SIGTERM if rank == world - 1 else 0  # as a signal sent to one process would
    out["one_receiver"] = (handler.agreed_signal(), handler.describe_receivers())
    out["max_int"] = control.all_reduce_max_int(rank)
    out["sum_floats"] = control.all_reduce_sum_floats([1.0, float(rank)])
    out["max_floats"] = control.all_reduce_max_floats([float(rank)])
    out["gather_floats"] = control.all_gather_floats([float(rank), 2.0 * rank])
    out["per_rank"] = gather_rank_values([float(rank)])
    out["objects"] = control.all_gather_object({"rank": rank})
    out["broadcast"] = control.broadcast_object(f"from {rank}", src=world - 1)
    control.barrier()
    t = torch.full((2,), float(rank + 1))
    comm.all_reduce(t, ranks, "test").wait()
    gathered = torch.empty(world)
    comm.all_gather(gathered, torch.full((1,), float(rank)), ranks, "test").wait()
    shard = torch.empty(1)
    comm.reduce_scatter(shard, torch.arange(float(world)), ranks, "test").wait()
    out["comm"] = (t.tolist(), gathered.tolist(), shard.tolist())
    return out


def test_checker_fails_control_values_off_the_control_plane_and_passes_both_planes():
    for rank, out in enumerate(run_distributed(_checker_cases, 2, timeout=120)):
        for case in ("raw_cpu_all_reduce", "raw_all_reduce_on_subgroup", "raw_barrier", "raw_all_gather_object",
                     "raw_broadcast_object_list", "raw_alias_all_gather"):
            assert "outside amsp.collectives.Comm" in out[case], (case, out[case])
        # the message names the call site, the tensor and the group
        assert "tests/amsp/test_routing.py" in out["raw_cpu_all_reduce"], out["raw_cpu_all_reduce"]
        assert "cpu/torch.int64 (1,)" in out["raw_cpu_all_reduce"] and "WORLD" in out["raw_cpu_all_reduce"]
        assert "group of ranks [0, 1]" in out["raw_all_reduce_on_subgroup"], out["raw_all_reduce_on_subgroup"]
        assert "on a control-plane group" in out["data_call_on_control_group"], out["data_call_on_control_group"]
        assert "data plane's device (cpu)" in out["data_call_off_device"], out["data_call_off_device"]
        assert "object collective on a data-plane group" in out["object_call_on_data_plane"]
        assert "CPU tensors only" in out["device_tensor_on_control_group"], out["device_tensor_on_control_group"]
        assert "staged on meta" in out["device_staged_object_on_control_group"]
        assert out["signal"] == 0 and out["max_int"] == 1
        assert out["one_receiver"] == (signal.SIGTERM, "rank 1"), out["one_receiver"]
        assert out["sum_floats"] == [2.0, 1.0] and out["max_floats"] == [1.0]
        assert out["gather_floats"] == [[0.0, 0.0], [1.0, 2.0]] and out["per_rank"] == [[0.0], [1.0]]
        assert out["objects"] == [{"rank": 0}, {"rank": 1}] and out["broadcast"] == "from 1"
        assert out["comm"] == ([3.0, 3.0], [0.0, 1.0], [2.0 * rank]), (rank, out["comm"])


def test_control_plane_is_the_local_value_in_a_single_process():
    from amsp import control

    assert not dist.is_initialized()
    assert control.group() is None and control.all_reduce_max_int(3) == 3
    assert control.all_reduce_sum_floats([1.5, 2]) == [1.5, 2.0]
    assert control.all_gather_floats([1.0]) == [[1.0]] and control.all_gather_object("x") == ["x"]
    assert control.broadcast_object({"a": 1}) == {"a": 1}
    control.barrier()


# ---- the regression: train.py on 2 ranks, every control value on the control plane ----
def test_train_py_on_two_ranks_keeps_every_collective_on_its_plane(tmp_path, monkeypatch):
    # A fresh probe cache so the startup probe runs too (its collectives are checked as well).
    monkeypatch.setenv("AMSP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AMSP_CHECK_ROUTING", "1")
    run = tmp_path / "run"
    proc = train(run, "trainer.max_steps=3", "trainer.val_interval=2", "trainer.val_samples=8",
                 "trainer.checkpoint_interval=2", "trainer.async_checkpoint=true", nproc=2, timeout=400)
    out = proc.stdout + proc.stderr
    assert "routing check on" in out, out[-3000:]  # the checker ran, so this test can fail
    assert "control plane gloo" in out and "data plane gloo" in out, out[-3000:]
    assert "bandwidth probe: 2 ranks" in out, out[-3000:]
    assert sorted(losses(run)) == [1, 2, 3]
    val = [json.loads(line)["step"] for line in (run / "validation.jsonl").read_text().splitlines()]
    assert val == [2, 3], val
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"


# ---- every group carries the configured timeout ----
TIMEOUT_S = 5


def _hung_member(rank: int, world: int):
    from amsp import control
    from amsp.collectives import Comm
    from amsp.groups import ensure_groups
    from amsp.plan import Degrees
    from amsp.topology import Topology

    assert control.collective_timeout().total_seconds() == TIMEOUT_S
    topo = Topology(world, world)
    ensure_groups([Degrees(world, world, world)], topo)  # the shard group of all ranks: not WORLD
    if rank == 1:  # never joins the subgroup's collective, then meets the others at the final barrier
        time.sleep(TIMEOUT_S + 2)
        return None
    t0 = time.monotonic()
    try:
        Comm(topo, rank).all_gather(torch.empty(world), torch.ones(1), tuple(range(world)), "test").wait()
    except RuntimeError as e:
        return time.monotonic() - t0, f"{type(e).__name__}: {str(e)[:200]}"
    return time.monotonic() - t0, None


def test_a_member_that_never_joins_fails_the_subgroup_collective_after_the_timeout():
    # Before subgroups carried the timeout, the waiting ranks sat in the collective for torch's
    # default (30 min for gloo) and this group was killed by run_distributed's timeout.
    results = run_distributed(_hung_member, 3, timeout=120, env={"TEST_PG_TIMEOUT": str(TIMEOUT_S)})
    for rank in (0, 2):
        waited, error = results[rank]
        assert error is not None, f"rank {rank}: the collective with a missing member returned"
        assert TIMEOUT_S - 1 <= waited <= TIMEOUT_S + 15, (rank, waited, error)


# ---- the pretend world (AMSP_PRETEND_WORLD): one process poses as one rank of N ----
def test_pretend_world_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("AMSP_PRETEND_WORLD", "8")
    monkeypatch.setenv("AMSP_PRETEND_RANK", "3")
    monkeypatch.setenv("RANK", "0")  # an explicit pretend world wins over a launcher's variables
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch.read_launch_env() == launch.DistEnv(3, 8, 0, 8, "pretend")
    monkeypatch.setenv("AMSP_PRETEND_RANK", "8")
    with pytest.raises(ValueError, match="0 <= rank < world"):
        launch.read_launch_env()


def test_pretend_world_runs_train_py_in_one_cpu_process(tmp_path):
    """The CPU twin of tests/gpu/test_pretend_world.py: the fake backend on "cpu:fake" for both
    planes, so the N-rank paths (groups, plan, both planes, validation) run in one process."""
    run = tmp_path / "pretend"
    args = [f"trainer.output_dir={tmp_path}", f"trainer.run_name={run.name}", *BASE, "trainer.max_steps=4",
            "trainer.val_interval=2", "trainer.val_samples=16", "trainer.global_batch_size=16", "amsp.plan=zero3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AMSP_PRETEND_WORLD": "4", "AMSP_CHECK_ROUTING": "1",
           "AMSP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "data plane cpu:fake" in out and "control plane cpu:fake" in out and "pretend world" in out, out[-3000:]
    assert "routing check on" in out
    assert sorted(losses(run)) == [1, 2, 3, 4]
    val = {json.loads(line)["step"] for line in (run / "validation.jsonl").read_text().splitlines()}
    assert val == {2, 4}, val
    # DCP cannot coordinate ranks that do not exist: said, and nothing half-written
    assert "step 4 is not checkpointed" in out and not (run / "checkpoints" / "latest").exists()


def test_pretend_world_refuses_pipeline_parallelism_in_one_line(tmp_path):
    """The pipeline's stages exchange tensor metadata the fake backend never delivers (a stage read garbage
    and tried to allocate terabytes): refused before any model state exists."""
    args = [f"trainer.output_dir={tmp_path}", "trainer.run_name=pp", *BASE, "trainer.max_steps=2", "parallel.pp=2",
            "trainer.micro_batch_size=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AMSP_PRETEND_WORLD": "4", "AMSP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2 and "input error: parallel.pp=2 cannot run in a pretend world" in proc.stderr, \
        proc.stderr[-3000:]
