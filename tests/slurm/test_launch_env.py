"""amsp/launch.py reading the launcher's environment (no cluster needed, so not marked `slurm`)."""
from __future__ import annotations

import pytest

from amsp import launch

SLURM_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("SLURM_") or k in SLURM_KEYS:
            monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_srun_task_reads_rank_world_and_local_world(clean_env):
    for k, v in {"SLURM_STEP_ID": "0", "SLURM_PROCID": "11", "SLURM_LOCALID": "3", "SLURM_NTASKS": "16",
                 "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1"}.items():
        clean_env.setenv(k, v)
    assert launch.read_launch_env() == launch.DistEnv(11, 16, 3, 8, "slurm")


def test_uneven_step_counts_tasks_of_this_node(clean_env):
    for k, v in {"SLURM_STEP_ID": "2", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
                 "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_NODEID": "1"}.items():
        clean_env.setenv(k, v)
    assert launch.read_launch_env() == launch.DistEnv(2, 3, 0, 1, "slurm")


def test_batch_shell_is_not_a_distributed_launch(clean_env):
    # What an sbatch script itself sees with --ntasks=2: no step id, so one process, not rank 0 of 2.
    for k, v in {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2"}.items():
        clean_env.setenv(k, v)
    assert launch.read_launch_env().launcher == "single"


def test_torchrun_env_wins_over_slurm(clean_env):
    for k, v in {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
                 "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        clean_env.setenv(k, v)
    assert launch.read_launch_env() == launch.DistEnv(5, 8, 1, 4, "torchrun")


def test_master_port_is_stable_and_below_the_ephemeral_range():
    ports = {launch.slurm_master_port(j) for j in range(0, 200_000, 7)}
    assert min(ports) >= 20000 and max(ports) < 32768
    assert launch.slurm_master_port(123456) == launch.slurm_master_port(123456)


def test_master_addr_is_the_first_node_of_the_step(clean_env):
    clean_env.setenv("SLURM_STEP_NODELIST", "gpu007")
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[001-009]")
    assert launch._slurm_master_addr() == "gpu007"


def test_unexpandable_node_list_is_a_clear_error(clean_env):
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[001-002]")
    clean_env.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="set MASTER_ADDR"):
        launch._slurm_master_addr()
