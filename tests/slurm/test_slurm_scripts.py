"""The Slurm shell scripts: syntax, shellcheck, and local_cluster.sh's start/status being idempotent."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from slurm_cluster import LOCAL_CLUSTER, SLURM_DIR, _run

pytestmark = pytest.mark.slurm

SCRIPTS = sorted([*SLURM_DIR.glob("*.sh"), *SLURM_DIR.glob("*.sbatch")])


def test_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {"pretrain.sbatch", "pretrain_srun.sbatch", "local_cluster.sh", "common.sh"} <= names, names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck(local_slurm):
    # local_slurm first: local_cluster.sh installs shellcheck from Debian along with Slurm.
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian package 'shellcheck')")
    # -x follows `source scripts/slurm/common.sh`, resolved from the repository root.
    r = subprocess.run(["shellcheck", "-x", *(str(p.relative_to(SLURM_DIR.parents[1])) for p in SCRIPTS)],
                       cwd=SLURM_DIR.parents[1], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_local_cluster_start_is_idempotent_and_status_reports(local_slurm):
    r = _run([str(LOCAL_CLUSTER), "start"], env=local_slurm.env, timeout=120)
    assert r.returncode == 0 and "already running (idle)" in r.stdout, r.stdout + r.stderr
    r = _run([str(LOCAL_CLUSTER), "status"], env=local_slurm.env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    for daemon in ("munged", "slurmctld", "slurmd"):
        assert f"{daemon} running" in r.stdout
    assert "idle" in r.stdout and f"export SLURM_CONF={local_slurm.env['SLURM_CONF']}" in r.stdout


def test_local_cluster_rejects_unknown_command():
    r = _run([str(LOCAL_CLUSTER), "restart"], timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr
