"""A run that finished must exit 0 on every rank.

The audit's case: after the last checkpoint of a 2-rank tp=2 run, rank 1 sometimes aborted at interpreter
exit with "terminate called without an active exception" (SIGABRT, exit -6; torchrun exit 1) in about half
of the runs. The cause: the heartbeat's daemon I/O thread (amsp.resilience.Heartbeat) was still inside a
c10d Store call, which releases the GIL, when the interpreter finalized. Coming back into Python it is ended
by pthread_exit, whose unwind crosses pybind11's noexcept gil_scoped_release: std::terminate. The end of a
run (train.py) therefore closes the heartbeat, which waits until that thread has left the store.

The first test reproduces the mechanism deterministically in one process (its I/O thread is held inside a
store call at exit); the second runs the audit's command a few times.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_HELD_IN_STORE = textwrap.dedent("""
    import datetime, os, sys
    import torch.distributed as dist
    from amsp import control
    from amsp.resilience import Heartbeat

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
    dist.init_process_group("gloo", store=server, rank=0, world_size=1)
    control.setup(datetime.timedelta(seconds=30))
    hb = Heartbeat(0, 2, timeout_s=4.0, interval=0.2)  # posing as rank 0 of 2: the I/O thread reads rank 1
    assert hb.store is not None and hb.store is not server  # its own client, 2 s timeout

    class HeldStore:
        # Once the run is over, every read sits 1.5 s in C++ with the GIL released, as a store call that
        # is still on its way back does when the main thread reaches the interpreter's exit.
        def __init__(self, real):
            self.real = real
        def set(self, key, value):
            return self.real.set(key, value)
        def check(self, keys):
            if hb.state != "run":
                try:
                    self.real.wait(["never-set"], datetime.timedelta(seconds=1.5))
                except Exception:
                    pass
            return self.real.check(keys)
        def get(self, key):
            return self.real.get(key)

    hb.store = HeldStore(hb.store)
    getattr(hb, sys.argv[1])("done")
    dist.destroy_process_group()
    print("main thread done", flush=True)
""")


def _run_held(method: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("AMSP_CHECK_ROUTING", None)
    return subprocess.run([sys.executable, "-c", _HELD_IN_STORE, method], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)


def test_heartbeat_close_leaves_no_thread_inside_a_store_call_at_exit():
    proc = _run_held("close")
    assert "main thread done" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])


def test_heartbeat_stop_alone_is_the_abort_this_guards_against():
    """The mechanism itself: stop() leaves the I/O thread running, and a process that exits while it is
    inside a store call aborts. If torch or Python ever stop doing that, this test says so."""
    proc = _run_held("stop")
    assert "main thread done" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == -6 and "terminate called without an active exception" in proc.stderr, \
        (proc.returncode, proc.stderr[-3000:])


@pytest.mark.distributed
@pytest.mark.slow  # three torchrun launches of 2 ranks: 25-60 s on 2 busy cores
def test_tp2_run_on_two_ranks_exits_zero_every_time(tmp_path):
    """The audit's command, three times (it failed in ~half of the runs before the fix)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("AMSP_CHECK_ROUTING", None)
    for i in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--log-dir={tmp_path / f'torchrun{i}'}", "train.py",  # not a /tmp/torchelastic_* per launch
               "model=debug", "parallel.tp=2", "amsp.plan=zero1", "trainer.max_steps=2",
               "logging.wandb.mode=disabled", f"trainer.output_dir={tmp_path}", f"trainer.run_name=r{i}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in out, (i, proc.returncode, out[-4000:])
        assert (tmp_path / f"r{i}" / "checkpoints" / "step_00000002").is_dir()
