"""Process-group initialisation from the launcher's environment.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE; Slurm's srun sets SLURM_PROCID /
SLURM_STEP_NUM_TASKS / SLURM_LOCALID (and the node list). With neither, the process runs alone.
Only an srun step (SLURM_STEP_ID set) counts as a Slurm launch: a batch script also carries
SLURM_PROCID=0 and the job's SLURM_NTASKS, and treating it as rank 0 of N would wait forever for
ranks that were never started.
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


def slurm_master_port(job_id: int) -> int:
    # Same on every rank and across a requeue (the job id is kept); below the Linux ephemeral
    # range (32768+) so it cannot collide with an outgoing connection's port.
    return 20000 + job_id % 10000


def _slurm_master_addr() -> str:
    # Rank 0 runs on the first node of the step (srun's default block distribution).
    nodelist = (os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
                or os.environ.get("SLURM_NODELIST"))
    if not nodelist:
        raise RuntimeError("launched by srun but no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST to find rank 0's node")
    if not any(c in nodelist for c in "[,"):
        return nodelist
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot expand the Slurm node list {nodelist!r} with 'scontrol show hostnames' "
                           f"({e}); set MASTER_ADDR to the first node") from e
    if not out:
        raise RuntimeError(f"'scontrol show hostnames {nodelist}' printed no host; set MASTER_ADDR")
    return out[0]


def _slurm_tasks_on_this_node(env) -> int:
    # SLURM_STEP_TASKS_PER_NODE reads like "8(x2)" or "2,1": tasks on each node of the step, in
    # node order; SLURM_NODEID is this node's index in the step.
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return int(env.get("SLURM_STEP_NUM_TASKS", env["SLURM_NTASKS"]))
    counts: list[int] = []
    for part in spec.split(","):
        n, _, rep = part.partition("(x")
        counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    node = int(env.get("SLURM_NODEID", 0))
    if node >= len(counts):
        raise RuntimeError(f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE={spec!r} lists {len(counts)} nodes")
    return counts[node]


def read_launch_env() -> DistEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                       int(env.get("LOCAL_WORLD_SIZE", world)), "torchrun")
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        world = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1)))
        return DistEnv(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)),
                       _slurm_tasks_on_this_node(env), "slurm")
    return DistEnv(0, 1, 0, 1, "single")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Initialise torch.distributed when launched with several ranks (no-op for one process)."""
    denv = read_launch_env()
    if denv.world_size == 1 or dist.is_initialized():
        return denv
    if denv.launcher == "slurm":
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        os.environ.setdefault("MASTER_PORT", str(slurm_master_port(int(os.environ.get("SLURM_JOB_ID", "0")))))
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
