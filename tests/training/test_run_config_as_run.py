"""RUN_DIR/config.yaml is the config as run: a parallel.auto run recorded the layout before the joint plan
(tp 1, pp 1, micro_batch_size 8) beside a run that trained another (pp 2, micro-batch 4)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.training.runs import train


@pytest.mark.distributed
@pytest.mark.slow  # one 2-rank torchrun with the joint planner's measurements: ~30 s
def test_parallel_auto_run_config_holds_the_joint_plan(tmp_path):
    run = tmp_path / "auto"
    # the default micro-batch size (8): the joint planner on 2 CPU ranks picks another, so a config taken before
    # the plan differs from the checkpoint's, which is taken after it
    train(run, "trainer.micro_batch_size=8", "trainer.max_steps=1", "parallel.auto=true",
          f"amsp.planner.cache_dir={tmp_path / 'cache'}", nproc=2)
    as_run = OmegaConf.load(run / "config.yaml")
    (ckpt,) = (run / "checkpoints").glob("step_*")
    trained = OmegaConf.load(ckpt / "config.yaml")
    assert as_run.parallel == trained.parallel and as_run.model == trained.model
    assert as_run.trainer.micro_batch_size == trained.trainer.micro_batch_size
    assert as_run.amsp == trained.amsp
