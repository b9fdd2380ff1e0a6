"""configs/hydra/launcher: the hydra-submitit-launcher configs for sweeps on Slurm.

Composition is checked against the plugin's typed schema (a misspelt key fails); a real sweep on
the local Slurm is `slow` (submitit polls sacct, which the local cluster does not have, so it
waits out its back-off) and runs with `pytest -m slow tests/slurm`.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from slurm_cluster import ROOT

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher (extra 'slurm') not installed")


def launcher_config(name: str):
    # Composed in-process through Hydra's compose API (as `train.py hydra/launcher=<name>` would),
    # which merges the YAML onto the plugin's typed SlurmQueueConf: a misspelt key fails here.
    from hydra import compose, initialize_config_dir

    from configs.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(config_name="train", overrides=[f"hydra/launcher={name}"], return_hydra_config=True)
    return cfg.hydra.launcher


def test_gpu_launcher_is_one_task_per_gpu_with_requeue_on_timeout():
    cfg = launcher_config("slurm")
    assert cfg._target_.endswith("SlurmLauncher")
    assert (cfg.nodes, cfg.tasks_per_node, cfg.gpus_per_node) == (2, 8, 8)
    assert cfg.signal_delay_s == 120
    assert cfg.max_num_timeout > 0, "timeouts must requeue"


def test_cpu_launcher_overrides_the_gpu_one():
    cfg = launcher_config("slurm_cpu")
    assert (cfg.nodes, cfg.tasks_per_node, cfg.gpus_per_node) == (1, 2, None)
    assert cfg.max_num_timeout > 0


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sweep_runs_on_the_local_slurm(local_slurm, tmp_path):
    r = subprocess.run([sys.executable, "train.py", "-m", "hydra/launcher=slurm_cpu", "model=debug",
                        "model.vocab_size=8192", "data.seq_len=64", "trainer.max_steps=2", "trainer.global_batch_size=4",
                        "trainer.micro_batch_size=2", "logging.wandb.mode=disabled", "optim.lr=1e-3",
                        "trainer.run_name=lr${optim.lr}", f"trainer.output_dir={tmp_path / 'runs'}",
                        f"hydra.sweep.dir={tmp_path / 'multirun'}"],
                       cwd=ROOT, env=local_slurm.env, capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "multirun" / ".submitit").rglob("*_0_log.out"))
    assert re.search(r"p/g/os = .* on 2 ranks", logs), logs[-3000:]
    assert (tmp_path / "runs" / "lr0.001").is_dir()


def test_preemption_hands_the_signal_to_the_handler_installed_before_training():
    """What makes submitit requeue: train.py's PreemptionHandler takes over SIGUSR2 (finish the step,
    checkpoint), then hand_over() calls the handler submitit installed before the job started (its
    checkpoint-and-requeue). Default handlers (sbatch's USR1, plain runs) are not called."""
    from amsp.resilience import PreemptionHandler

    calls = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        handler = PreemptionHandler()
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert handler.received == signal.SIGUSR2 and calls == [], "the training loop must see the signal first"
        handler.hand_over(signal.SIGUSR2)
        assert calls == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) is not handler._on_signal, "previous handlers must be restored"
        handler = PreemptionHandler()
        handler.hand_over(signal.SIGUSR1)  # SIG_DFL before: nothing to call (it would kill the process)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, before)


class RankZeroLog:
    """Task 0's stdout and stderr as one text (train.py logs to one, submitit to the other); appended
    to, not truncated, when the job is requeued."""

    def __init__(self, *paths):
        self.paths = paths

    def exists(self) -> bool:
        return any(p.exists() for p in self.paths)

    def read_text(self) -> str:
        return "".join(p.read_text() for p in self.paths if p.exists())


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_usr2_under_submitit_checkpoints_requeues_and_resumes(local_slurm, tmp_path):
    """SIGUSR2 (what submitit's --signal=USR2@signal_delay_s sends before the time limit, here sent by
    hand): the ranks checkpoint, submitit requeues the job (same id), the requeued job resumes from
    that checkpoint; SIGUSR1 then ends it (checkpoint, no requeue) and the sweep returns."""
    sweep = tmp_path / "multirun"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm_cpu", "model=debug", "model.vocab_size=8192",
           "data.seq_len=64", "trainer.max_steps=100000", "trainer.checkpoint_interval=0", "trainer.log_interval=1",
           "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "logging.wandb.mode=disabled",
           "logging.plot=false", "trainer.val_samples=0", "trainer.run_name=requeue",
           f"trainer.output_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={sweep}"]
    sweep_proc = subprocess.Popen(cmd, cwd=ROOT, env=local_slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
    try:
        def job_and_log():
            for d in (sweep / ".submitit").glob("*"):
                if d.name.isdigit() and (d / f"{d.name}_0_log.out").exists():
                    return d.name, RankZeroLog(d / f"{d.name}_0_log.out", d / f"{d.name}_0_log.err")
            return None

        job, log = local_slurm.wait_for(job_and_log, "the submitit job to start", timeout=300)
        local_slurm.submitted.append(job)
        step_line = re.compile(r"step\s+(\d+)/\d+\b[^\n]*?\| loss")
        local_slurm.wait_for(lambda: len(step_line.findall(log.read_text())) >= 2, "training steps",
                             timeout=300, job_id=job, log=log)
        local_slurm.scancel("--signal=USR2", job)

        def resumed():
            parts = log.read_text().split("resumed from checkpoint", 1)
            return len(parts) == 2 and step_line.search(parts[1])

        local_slurm.wait_for(resumed, "the requeued job to resume and train", timeout=400, job_id=job, log=log)
        text = log.read_text()
        m = re.search(r"received SIGUSR2: saving checkpoint at step (\d+) and exiting", text)
        assert m, text[-4000:]
        stop = int(m.group(1))
        assert "handing SIGUSR2 to the handler installed before training" in text, text[-4000:]
        assert re.search(rf"resumed from checkpoint \S*step_{stop:08d} at step {stop}", text), text[-4000:]
        assert local_slurm.job(job).restarts == 1

        local_slurm.scancel("--signal=USR1", job)  # checkpoint and stop; submitit leaves USR1 alone: no requeue
        out, _ = sweep_proc.communicate(timeout=400)
        assert sweep_proc.returncode == 0, out[-3000:]
        assert local_slurm.job(job).restarts == 1
    finally:
        if sweep_proc.poll() is None:
            sweep_proc.kill()
            sweep_proc.wait()
