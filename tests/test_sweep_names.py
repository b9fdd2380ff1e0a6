"""configs/sweep.py: each job of a multirun sweep without a trainer.run_name gets its own run directory (they
shared `runs/<model>`, and the second job resumed the first's finished run, trained nothing, exited 0)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from configs.sweep import MAX_NAME, gives_run_name, job_run_name, swept_keys
from tests.training.runs import BASE, ROOT


def test_names_come_from_the_swept_keys_and_stay_short():
    swept = swept_keys(["-m", "hydra.sweep.dir=/x", "model=debug", "optim.lr=1e-3,2e-3", "+x=range(1,3)"])
    assert swept == {"optim.lr", "x"}
    task = ["model=debug", "optim.lr=0.002", "+x=2", "data.prefix=/data/a"]
    assert job_run_name("debug", task, "model=debug,optim.lr=0.002", swept) == "debug-optim.lr=0.002,x=2"
    # a launcher in another process (the command line is not the sweep's): all the job's overrides
    assert job_run_name("debug", task, "data.prefix=/data/a,model=debug", set()) == \
        "debug-data.prefix=_data_a,model=debug"
    long_a = job_run_name("m", [], "k=" + "a" * 300, set())
    long_b = job_run_name("m", [], "k=" + "a" * 299 + "b", set())
    assert len(long_a) == MAX_NAME and long_a != long_b
    assert gives_run_name(["model=debug", "trainer.run_name=x"]) and gives_run_name(["++trainer.run_name=x"])
    assert not gives_run_name(["trainer.run_names=x"])


# Slow (the suite's time budget): the default run keeps the naming itself
# (test_names_come_from_the_swept_keys_and_stay_short).
@pytest.mark.slow
def test_a_sweep_trains_every_point_in_its_own_run_directory(tmp_path):
    cmd = [sys.executable, "train.py", "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           f"trainer.output_dir={tmp_path / 'runs'}", *BASE, "trainer.max_steps=2", "optim.lr=1e-3,2e-3"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = sorted(d.name for d in (tmp_path / "runs").iterdir())
    assert runs == ["debug-optim.lr=0.001", "debug-optim.lr=0.002"], runs
    assert all((tmp_path / "runs" / r / "metrics.jsonl").read_text().count("\n") == 2 for r in runs)
    assert "nothing to train" not in p.stdout + p.stderr
