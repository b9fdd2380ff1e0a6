"""train.py end to end with model parallelism: a run at (tp 2, pp 2) on 4 ranks trains the same losses as
a single process, and its checkpoint resumes in a single process, continuing the same losses."""
import pytest

from tests.training.runs import losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two torchrun launches and two single runs: ~1 min


def test_tp2_pp2_run_matches_single_process_and_resumes_without_model_parallelism(tmp_path):
    straight = tmp_path / "straight"
    train(straight, "trainer.max_steps=8", "trainer.checkpoint_interval=0", "amsp.plan=ddp")
    want = losses(straight)
    run = tmp_path / "tp2pp2"
    proc = train(run, "trainer.max_steps=4", "trainer.checkpoint_interval=0", "amsp.plan=ddp", "parallel.tp=2",
                 "parallel.pp=2", nproc=4)
    assert "mesh pp=2 x dp=1 x tp=2" in proc.stdout + proc.stderr
    got = losses(run)
    for step in range(1, 5):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    proc = train(run, "trainer.max_steps=8", "trainer.checkpoint_interval=0", "amsp.plan=ddp")
    assert "resumed from checkpoint" in proc.stdout and "at step 4" in proc.stdout
    resumed = losses(run)
    for step in range(5, 9):
        assert abs(resumed[step] - want[step]) <= 1e-5 * abs(want[step]), (step, resumed[step], want[step])
