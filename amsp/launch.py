"""Process-group initialisation from the launcher's environment.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE; Slurm's srun sets SLURM_PROCID /
SLURM_STEP_NUM_TASKS / SLURM_LOCALID (and the node list). With neither, the process runs alone.
Only an srun step (SLURM_STEP_ID set) counts as a Slurm launch: a batch script also carries
SLURM_PROCID=0 and the job's SLURM_NTASKS, and treating it as rank 0 of N would wait forever for
ranks that were never started.

AMSP_PRETEND_WORLD=N (rank from AMSP_PRETEND_RANK, default 0) runs one process as one rank of an
N-rank world on torch's fake backend, whose collectives return at once and move no data: a way to
run the N-rank code paths (plans, groups, both planes) on one device. Its numbers are not a real
run's.

Two planes (DESIGN.md section 2): the default group is the data plane, on the device's backend
(NCCL on CUDA, gloo on CPU); control values travel on amsp.control's own CPU group. Both, and every
group made later, carry the configured collective timeout.
"""
from __future__ import annotations

import datetime
import logging
import os
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import control, routing_check

log = logging.getLogger(__name__)
_CHOICES: list[str] = []  # what init_distributed chose, for log_backend_choices


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # torchrun | slurm | single | pretend

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
    if env.get("AMSP_PRETEND_WORLD"):
        world, rank = int(env["AMSP_PRETEND_WORLD"]), int(env.get("AMSP_PRETEND_RANK", "0"))
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"AMSP_PRETEND_WORLD={world} / AMSP_PRETEND_RANK={rank}: need 0 <= rank < world")
        # One process, one device: it poses as one rank of a single node of `world` ranks.
        return DistEnv(rank, world, 0, world, "pretend")
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
    """Initialise torch.distributed when launched with several ranks (no-op for one process):
    the default group (data plane), then the control plane, then the routing checker if asked."""
    denv = read_launch_env()
    if denv.world_size == 1 or dist.is_initialized():
        return denv
    timeout = datetime.timedelta(seconds=timeout_s)
    if denv.launcher == "pretend":
        data_backend, control_backend, device_type = _init_pretend_world(denv, timeout)
    else:
        if denv.launcher == "slurm":
            os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
            os.environ.setdefault("MASTER_PORT", str(slurm_master_port(int(os.environ.get("SLURM_JOB_ID", "0")))))
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(denv.rank), str(denv.world_size)
            os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(denv.local_rank), str(denv.local_world_size)
        data_backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        device_type = "cuda" if "nccl" in data_backend else "cpu"
        if device_type == "cuda":
            torch.cuda.set_device(denv.local_rank)
        dist.init_process_group(backend=data_backend, rank=denv.rank, world_size=denv.world_size, timeout=timeout)
        control_backend = "gloo"
    control.setup(timeout, control_backend)
    checking = routing_check.install_if_requested(device_type)
    _CHOICES[:] = [f"distributed: {denv.world_size} ranks ({denv.local_world_size} per node), launcher "
                   f"{denv.launcher}; data plane {data_backend} ({device_type} tensors), control plane "
                   f"{control_backend}, collective timeout {timeout_s:.0f} s on every group"
                   + (f"; routing check on ({routing_check.ENV}=1)" if checking else "")]
    if denv.launcher == "pretend":
        _CHOICES.append(f"pretend world: this process is rank {denv.rank} of {denv.world_size} on the fake backend; "
                        f"collectives move no data, so losses, norms and timings are not a real run's")
    return denv


def log_backend_choices(denv: DistEnv) -> None:
    """Log what init_distributed chose, once logging is set up (it runs before the logging setup,
    which needs the rank)."""
    if _CHOICES and denv.is_main:
        log.info(_CHOICES[0])
    for line in _CHOICES[1:]:
        log.warning(line)
    _CHOICES.clear()


def _init_pretend_world(denv: DistEnv, timeout: datetime.timedelta) -> tuple[str, str, str]:
    # The fake backend's creator is registered by this testing module, not by torch.distributed.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(0)
    # "cuda:fake" serves CUDA tensors only and refuses CPU ones, as NCCL does. The control plane
    # is fake too: gloo cannot rendezvous with ranks that do not exist.
    data_backend = f"{device_type}:fake"
    dist.init_process_group(data_backend, store=dist.HashStore(), rank=denv.rank, world_size=denv.world_size,
                            timeout=timeout)
    return data_backend, "cpu:fake", device_type
