"""End to end on a real (local, one-host) Slurm: the sbatch scripts as users submit them.

Tiny CPU runs with 2 ranks: pretrain.sbatch (torchrun per node) trains, checkpoints, shows the
plan, and a second submission (through the srun variant) resumes the same run directory; SIGUSR1
to the batch shell (what `--signal=B:USR1@120` sends before the time limit) checkpoints and
requeues, and the requeued job resumes; SIGUSR1 to the steps checkpoints and stops; a Hydra
override typo fails the job at startup; missing GPUs / Python are clear errors.
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

# Generous limits: on a busy 2-core machine one 2-rank startup alone can take a minute.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

# The debug model with a vocabulary that holds the built-in corpus tokenizer (8000 pieces).
# No plot and no validation pass: seconds per job that these tests do not look at.
TINY = ["model=debug", "model.vocab_size=8192", "data.seq_len=64", "trainer.log_interval=1",
        "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "logging.wandb.mode=disabled",
        "logging.plot=false", "trainer.val_samples=0"]
CPU_TORCHRUN = {"NPROC_PER_NODE": "2"}
CPU_SBATCH = ["--nodes=1", "--gpus-per-node=0"]

PLAN_LINE = re.compile(r"plan.*p/g/os = ")
STEP_LINE = re.compile(r"step\s+(\d+)/\d+\b[^\n]*?\| loss")


def log_of(cwd: pathlib.Path, job_name: str, job_id: str) -> pathlib.Path:
    # pretrain*.sbatch write their log to %x-%j.out in the submit directory.
    return cwd / f"{job_name}-{job_id}.out"


def latest_checkpoint(run_dir: pathlib.Path) -> str:
    latest = run_dir / "checkpoints" / "latest"
    assert latest.exists(), f"no {latest}; run dir holds {sorted(p.name for p in run_dir.rglob('*'))}"
    name = latest.read_text().strip()
    assert (run_dir / "checkpoints" / name).is_dir(), f"latest names {name}, which does not exist"
    return name


def assert_succeeded(info, log: pathlib.Path) -> str:
    text = log.read_text() if log.exists() else "(no log)"
    assert info.state == "COMPLETED" and info.exit_code == "0:0", f"{info.raw}\n--- log tail\n{text[-4000:]}"
    return text


def test_pretrain_sbatch_trains_and_checkpoints_then_the_srun_variant_resumes_it(local_slurm, tmp_path):
    job_name = "e2e"
    first = local_slurm.sbatch("pretrain.sbatch", *TINY, "trainer.max_steps=4", "trainer.checkpoint_interval=2",
                               f"trainer.output_dir={tmp_path / 'runs'}", sbatch_args=[*CPU_SBATCH, f"--job-name={job_name}"],
                               env=CPU_TORCHRUN, cwd=tmp_path)
    log = log_of(tmp_path, job_name, first)
    text = assert_succeeded(local_slurm.wait_done(first, timeout=300), log)
    assert PLAN_LINE.search(text), f"no plan line in the log:\n{text[-4000:]}"
    assert re.search(r"p/g/os = .* on 2 ranks", text), "torchrun must have started 2 ranks"
    # torchrun's folder is the job's (beside its log), one <run id>_<random> folder for the one node.
    torchrun_logs = tmp_path / "torchrun-logs" / first
    assert f"torchrun logs: {torchrun_logs}" in text, text[-4000:]
    folders = sorted(d.name for d in torchrun_logs.iterdir())
    assert len(folders) == 1 and folders[0].startswith(f"{first}_"), folders
    # The run directory is named after the job, so every rank (and a requeue) agrees on it.
    run_dir = tmp_path / "runs" / f"{job_name}-{first}"
    assert latest_checkpoint(run_dir) == "step_00000004"
    assert re.search(r"saved checkpoint step 4 to \S*step_00000004", text), text[-4000:]

    # Submitted again into the same run directory with a longer schedule, this time through the
    # srun variant (one task per rank, no torchrun): it continues from step 4. One job covers both
    # the resubmission and the srun launcher, to keep the suite short on 2 cores.
    second = local_slurm.sbatch("pretrain_srun.sbatch", *TINY, "trainer.max_steps=6", f"trainer.run_name={job_name}-{first}",
                                f"trainer.output_dir={tmp_path / 'runs'}",
                                sbatch_args=["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", f"--job-name={job_name}"],
                                cwd=tmp_path)
    log2 = log_of(tmp_path, job_name, second)
    text2 = assert_succeeded(local_slurm.wait_done(second, timeout=300), log2)
    # Rank, world size and master address came from SLURM_* (amsp/launch.py).
    assert re.search(r"p/g/os = .* on 2 ranks", text2), "the 2 srun tasks must have formed one 2-rank job"
    assert re.search(r"resumed from checkpoint \S*step_00000004 at step 4", text2), text2[-4000:]
    steps = [int(s) for s in STEP_LINE.findall(text2)]
    assert steps and min(steps) == 5 and max(steps) == 6, steps
    assert latest_checkpoint(run_dir) == "step_00000006"


# Slow (the suite's time budget): the requeue path also runs in
# test_time_limit_signal_requeues_with_a_checkpoint (slow); the default run keeps the sbatch train-and-resume
# job.
@pytest.mark.slow
def test_usr1_before_time_limit_requeues_and_resumes_then_usr1_to_steps_stops(local_slurm, tmp_path):
    job_name = "preempt"
    job = local_slurm.sbatch("pretrain.sbatch", *TINY, "trainer.max_steps=100000", "trainer.checkpoint_interval=0",
                             f"trainer.output_dir={tmp_path / 'runs'}", sbatch_args=[*CPU_SBATCH, f"--job-name={job_name}"],
                             env=CPU_TORCHRUN, cwd=tmp_path)
    log = log_of(tmp_path, job_name, job)
    run_dir = tmp_path / "runs" / f"{job_name}-{job}"

    def steps_logged():
        return log.exists() and len(STEP_LINE.findall(log.read_text())) >= 2

    local_slurm.wait_for(steps_logged, "training steps in the log", timeout=300, job_id=job, log=log)
    # What --signal=B:USR1@120 delivers 120 s before the time limit: SIGUSR1 to the batch shell only.
    local_slurm.scancel("--batch", "--signal=USR1", job)

    def requeued():
        info = local_slurm.job(job)
        return info if info.restarts == 1 and info.state == "PENDING" else None

    local_slurm.wait_for(requeued, "the job to requeue itself", timeout=180, job_id=job, log=log)
    text = log.read_text()
    m = re.search(r"received SIGUSR1: saving checkpoint at step (\d+) and exiting", text)
    assert m, text[-4000:]
    stop_step = int(m.group(1))
    assert re.search(rf"saved checkpoint step {stop_step} to ", text), text[-4000:]
    assert latest_checkpoint(run_dir) == f"step_{stop_step:08d}"
    assert "requeueing job" in text

    # Slurm holds a requeued job back for cred_expire (10 s in local_cluster.sh's slurm.conf); releasing it
    # sooner by hand races slurmd's revoked credential and kills the restart ("Job credential revoked").

    def resumed():
        t = log.read_text()
        after = t.split("resumed from checkpoint", 1)
        return len(after) == 2 and len(STEP_LINE.findall(after[1])) >= 1

    local_slurm.wait_for(resumed, "the requeued job to resume and train", timeout=300, job_id=job, log=log)
    text = log.read_text()
    assert re.search(rf"resumed from checkpoint \S*step_{stop_step:08d} at step {stop_step}", text), text[-4000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [run_dir.name], \
        "the requeued job must use the same run directory"

    # SIGUSR1 to the steps only (scancel without --batch): checkpoint and stop, no requeue.
    local_slurm.scancel("--signal=USR1", job)
    info = local_slurm.wait_done(job, timeout=300)
    text = assert_succeeded(info, log)
    assert info.restarts == 1, info.raw
    stops = re.findall(r"received SIGUSR1: saving checkpoint at step (\d+) and exiting", text)
    assert len(stops) == 2 and int(stops[1]) > stop_step, stops
    assert latest_checkpoint(run_dir) == f"step_{int(stops[1]):08d}"
    assert text.count("requeueing job") == 1, "SIGUSR1 to the steps must not requeue"


def test_override_typo_fails_the_job_at_startup_with_hydras_message(local_slurm, tmp_path):
    job_name = "typo"
    # One rank is enough to see Hydra refuse the override (and prints its message once).
    job = local_slurm.sbatch("pretrain.sbatch", *TINY, "trainer.max_stepz=3", f"trainer.output_dir={tmp_path / 'runs'}",
                             sbatch_args=[*CPU_SBATCH, f"--job-name={job_name}"], env={"NPROC_PER_NODE": "1"}, cwd=tmp_path)
    info = local_slurm.wait_done(job, timeout=300)
    text = log_of(tmp_path, job_name, job).read_text()
    # An input error (2), not torchrun's 1 for any failed worker: the ranks' code (scripts/slurm/common.sh)
    assert info.state == "FAILED" and info.exit_code == "2:0", info.raw
    assert "exiting 2 (input error)" in log_of(tmp_path, job_name, job).read_text()
    # Hydra's own message, naming the key, from config composition ...
    assert "Could not override 'trainer.max_stepz'" in text, text[-4000:]
    assert re.search(r"Key 'max_stepz' (is )?not in", text), text[-4000:]
    # ... before anything was built: no run directory, no model, no plan.
    assert not (tmp_path / "runs").exists()
    assert not PLAN_LINE.search(text) and "parameters" not in text, text[-4000:]


def test_pretrain_sbatch_without_gpus_or_rank_count_is_a_clear_error(local_slurm, tmp_path):
    job = local_slurm.sbatch("pretrain.sbatch", *TINY, sbatch_args=[*CPU_SBATCH, "--job-name=nogpu"],
                             env={"NPROC_PER_NODE": ""}, cwd=tmp_path)
    info = local_slurm.wait_done(job, timeout=60)
    text = log_of(tmp_path, "nogpu", job).read_text()
    assert info.state == "FAILED", info.raw
    assert "no GPUs in this allocation; for a CPU run set NPROC_PER_NODE" in text, text


def test_python_without_torch_is_a_clear_error(local_slurm, tmp_path):
    # The interpreter the venv was made from: the same Python, without the venv's packages.
    base = sys._base_executable
    if subprocess.run([base, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{base} can import torch, so it cannot stand for a Python without it")
    job = local_slurm.sbatch("pretrain.sbatch", *TINY, sbatch_args=[*CPU_SBATCH, "--job-name=nopython"],
                             env={**CPU_TORCHRUN, "PYTHON": base}, cwd=tmp_path)
    info = local_slurm.wait_done(job, timeout=60)
    text = log_of(tmp_path, "nopython", job).read_text()
    assert info.state == "FAILED", info.raw
    assert f"{base} has no torch or no hydra; run 'make venv'" in text, text



@pytest.mark.slow
def test_time_limit_signal_requeues_with_a_checkpoint(local_slurm, tmp_path):
    # The real --signal path: Slurm itself signals the batch shell when the remaining time drops
    # below the margin (checked about every 30 s, hence `slow`). The margin is wide so the signal
    # may land while the ranks are still starting, which the repeated SIGUSR1 covers.
    job_name = "timelimit"
    job = local_slurm.sbatch("pretrain.sbatch", *TINY, "trainer.max_steps=100000", "trainer.checkpoint_interval=0",
                             f"trainer.output_dir={tmp_path / 'runs'}",
                             sbatch_args=[*CPU_SBATCH, f"--job-name={job_name}", "--time=3", "--signal=B:USR1@150"],
                             env=CPU_TORCHRUN, cwd=tmp_path)
    log = log_of(tmp_path, job_name, job)

    def requeued():
        info = local_slurm.job(job)
        return info if info.restarts >= 1 else None

    local_slurm.wait_for(requeued, "the job to checkpoint and requeue before its time limit", timeout=240,
                         job_id=job, log=log)
    local_slurm.scancel(job)  # the requeued run is not needed
    text = log.read_text()
    m = re.search(r"received SIGUSR1: saving checkpoint at step (\d+) and exiting", text)
    assert m and "requeueing job" in text, text[-4000:]
    assert latest_checkpoint(tmp_path / "runs" / f"{job_name}-{job}") == f"step_{int(m.group(1)):08d}"
