"""configs/hydra/launcher: the hydra-submitit-launcher configs for sweeps on Slurm.

Composition is checked against the plugin's typed schema (a misspelt key fails); a real sweep on
the local Slurm is `slow` (submitit polls sacct, which the local cluster does not have, so it
waits out its back-off) and runs with `pytest -m slow tests/slurm`.
"""
from __future__ import annotations

import re
import subprocess
import sys

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
