"""A real one-host Slurm for the `slurm` tests, started by scripts/slurm/local_cluster.sh.

Helpers and the session fixture (re-exported by conftest.py; a uniquely named module, so the test
files can import the helpers without clashing with the other conftest.py files).

The session fixture starts the cluster (installing slurm-wlm and munge with apt-get when missing)
and stops it at the end, unless it was already running before the session: then it is left as it
was. Jobs run one after another (the local node is allocated exclusively), so each test waits for
its own jobs to finish and cancels them if it fails half-way.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import time
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "scripts" / "slurm"
LOCAL_CLUSTER = SLURM_DIR / "local_cluster.sh"
STATE_DIR = os.environ.get("AMSP_SLURM_DIR", "/tmp/amsp-local-slurm")
CONF = os.path.join(STATE_DIR, "slurm.conf")


def _run(cmd, env=None, timeout=120, check=False, cwd=None):
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=check)


@dataclass
class JobInfo:
    job_id: str
    state: str
    exit_code: str  # "<status>:<signal>" as scontrol prints it
    restarts: int
    raw: str


class LocalSlurm:
    """Submits and watches jobs on the local cluster; every job it submitted is cancelled at the end."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.submitted: list[str] = []

    def sbatch(self, script: str, *overrides: str, sbatch_args=(), env=None, cwd) -> str:
        job_env = dict(self.env, **(env or {}))
        r = _run(["sbatch", "--parsable", *sbatch_args, str(SLURM_DIR / script), *overrides],
                 env=job_env, cwd=cwd, timeout=60)
        assert r.returncode == 0, f"sbatch failed: {r.stderr}"
        job_id = r.stdout.strip().split(";")[0]
        assert job_id.isdigit(), r.stdout
        self.submitted.append(job_id)
        return job_id

    def scontrol(self, *args: str) -> str:
        r = _run(["scontrol", *args], env=self.env, timeout=60)
        assert r.returncode == 0, f"scontrol {' '.join(args)} failed: {r.stderr}"
        return r.stdout

    def scancel(self, *args: str) -> None:
        r = _run(["scancel", *args], env=self.env, timeout=60)
        assert r.returncode == 0, f"scancel {' '.join(args)} failed: {r.stderr}"

    def job(self, job_id: str) -> JobInfo:
        raw = self.scontrol("show", "job", "-o", job_id)
        fields = dict(re.findall(r"(\w+)=(\S*)", raw))
        return JobInfo(job_id, fields["JobState"], fields["ExitCode"], int(fields.get("Restarts", 0)), raw)

    def wait_done(self, job_id: str, timeout: float) -> JobInfo:
        """Waits until the job has left PENDING/RUNNING (and any transitional state)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                              "BOOT_FAIL", "DEADLINE", "PREEMPTED"):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {info.state} after {timeout:.0f}s:\n{info.raw}")
            time.sleep(1.0)

    def wait_for(self, predicate, what: str, timeout: float, job_id: str | None = None, log: pathlib.Path | None = None):
        """Polls predicate() until it returns something truthy; fails with the job state and log tail."""
        deadline = time.monotonic() + timeout
        while True:
            got = predicate()
            if got:
                return got
            if time.monotonic() > deadline:
                detail = self.job(job_id).raw if job_id else ""
                tail = log.read_text()[-4000:] if log and log.exists() else "(no log)"
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{detail}\n--- log tail\n{tail}")
            time.sleep(0.5)

    def cancel_leftovers(self) -> None:
        for job_id in self.submitted:
            r = _run(["scontrol", "show", "job", "-o", job_id], env=self.env, timeout=60)
            if re.search(r"JobState=(PENDING|RUNNING|REQUEUED|SUSPENDED|COMPLETING)", r.stdout):
                _run(["scancel", job_id], env=self.env, timeout=60)


@pytest.fixture(scope="session")
def local_slurm():
    if os.geteuid() != 0:
        pytest.skip("the local Slurm needs root (slurmd, slurmctld and munged are started by local_cluster.sh)")
    env = dict(os.environ, SLURM_CONF=CONF, AMSP_SLURM_DIR=STATE_DIR)
    was_running = _run([str(LOCAL_CLUSTER), "status"], env=env).returncode == 0
    t0 = time.monotonic()
    r = _run([str(LOCAL_CLUSTER), "start"], env=env, timeout=600)
    if r.returncode != 0:
        if "apt-get could not install" in r.stderr or "no apt-get" in r.stderr:
            pytest.skip(f"Slurm is not installed and could not be installed here: {r.stderr.strip()[-500:]}")
        pytest.fail(f"local_cluster.sh start failed:\n{r.stdout}\n{r.stderr}")
    print(f"local Slurm up in {time.monotonic() - t0:.1f}s ({'already running' if was_running else 'started'})")
    slurm = LocalSlurm(env)
    try:
        yield slurm
    finally:
        slurm.cancel_leftovers()
        if not was_running:
            stop = _run([str(LOCAL_CLUSTER), "stop"], env=env, timeout=120)
            assert stop.returncode == 0, f"local_cluster.sh stop failed:\n{stop.stdout}\n{stop.stderr}"
