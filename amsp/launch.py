"""Process-group initialisation from the launcher's environment.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE; Slurm's srun sets SLURM_PROCID /
SLURM_NTASKS / SLURM_LOCALID (and the node list). With neither, the process runs alone.
"""
from __future__ import annotations

import datetime
import logging
import os
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # torchrun | slurm | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _slurm_master_addr() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
        return out[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return nodelist.split(",")[0]


def read_launch_env() -> DistEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                       int(env.get("LOCAL_WORLD_SIZE", world)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", 1)))
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or max(1, world // nodes)
        return DistEnv(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), local_world, "slurm")
    return DistEnv(0, 1, 0, 1, "single")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Initialise torch.distributed when launched with several ranks (no-op for one process)."""
    denv = read_launch_env()
    if denv.world_size == 1 or dist.is_initialized():
        return denv
    if denv.launcher == "slurm":
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        job = int(os.environ.get("SLURM_JOB_ID", "0"))
        os.environ.setdefault("MASTER_PORT", str(15000 + job % 20000))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(denv.rank), str(denv.world_size)
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(denv.local_rank), str(denv.local_world_size)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(denv.local_rank)
    dist.init_process_group(backend=backend, rank=denv.rank, world_size=denv.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if denv.is_main:
        log.info("distributed backend: %s, %d ranks (%d per node), launcher %s", backend,
                 denv.world_size, denv.local_world_size, denv.launcher)
    return denv
