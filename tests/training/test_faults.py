"""Non-finite steps are skipped and counted; too many stop the run; a dead rank stops everyone."""
import time

import pytest

from tests.training.runs import losses, records, train

pytestmark = pytest.mark.distributed


def test_nan_step_is_skipped_and_counted(tmp_path):
    run = tmp_path / "nan"
    proc = train(run, "trainer.max_steps=6", "debug.nan_loss_at_steps=[3]", "trainer.checkpoint_interval=0")
    recs = {r["step"]: r for r in records(run)}
    assert recs[2]["skipped_steps"] == 0 and recs[3]["skipped_steps"] == 1 and recs[6]["skipped_steps"] == 1
    assert "update skipped" in proc.stdout + proc.stderr
    ls = losses(run)
    assert ls[6] == ls[6] and ls[6] < 100  # training went on with finite losses


def test_too_many_consecutive_skips_stop_with_a_checkpoint(tmp_path):
    run = tmp_path / "nans"
    proc = train(run, "trainer.max_steps=10", "debug.nan_loss_at_steps=[2,3,4]", "trainer.max_consecutive_skips=3",
                 "trainer.checkpoint_interval=0", check=False)
    assert proc.returncode != 0
    assert "3 consecutive steps had a non-finite loss" in proc.stdout + proc.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_killed_rank_stops_every_rank_and_relaunch_resumes(tmp_path):
    run = tmp_path / "dead"
    t0 = time.monotonic()
    proc = train(run, "trainer.max_steps=8", "trainer.checkpoint_interval=2", "amsp.plan=zero2",
                 "debug.die_at_step=4", "debug.die_rank=2", "trainer.collective_timeout_s=60",
                 nproc=4, check=False, timeout=300)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "rank 2 exits abruptly in step 4" in out
    assert elapsed < 240, elapsed
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    proc = train(run, "trainer.max_steps=5", "trainer.checkpoint_interval=0", "amsp.plan=zero2", nproc=4)
    assert "resumed from checkpoint" in proc.stdout and "at step 2" in proc.stdout
    assert max(losses(run)) == 5
