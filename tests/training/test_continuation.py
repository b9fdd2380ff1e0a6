"""Exact continuation: 20 steps straight equal 10 steps, stop, resume, 10 more (fp32, CPU)."""
import pytest

from tests.training.runs import losses, train

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    train(run, "trainer.max_steps=20", "trainer.checkpoint_interval=0", "amsp.plan=ddp")
    return losses(run)


def test_resume_same_plan_is_bitwise_identical(straight, tmp_path):
    run = tmp_path / "resumed"
    train(run, "trainer.max_steps=10", "trainer.checkpoint_interval=0", "amsp.plan=ddp")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    proc = train(run, "trainer.max_steps=20", "trainer.checkpoint_interval=0", "amsp.plan=ddp")
    assert "resumed from checkpoint" in proc.stdout and "at step 10" in proc.stdout
    resumed = losses(run)
    for step in range(11, 21):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])


def test_resume_across_plan_and_world_size(straight, tmp_path):
    # Written by zero3 on 2 ranks, continued by a single process: same losses within 1e-6.
    run = tmp_path / "resharded"
    train(run, "trainer.max_steps=10", "trainer.checkpoint_interval=0", "amsp.plan=zero3", nproc=2)
    proc = train(run, "trainer.max_steps=20", "trainer.checkpoint_interval=0", "amsp.plan=ddp")
    assert "written by plan zero3" in proc.stdout
    resumed = losses(run)
    for step in range(11, 21):
        assert abs(resumed[step] - straight[step]) <= 1e-6 * abs(straight[step]), (step, resumed[step], straight[step])


def test_rerun_of_a_finished_run_resumes_instead_of_starting_over(straight, tmp_path):
    run = tmp_path / "again"
    train(run, "trainer.max_steps=3", "trainer.checkpoint_interval=0")
    proc = train(run, "trainer.max_steps=3", "trainer.checkpoint_interval=0")
    assert "resumed from checkpoint" in proc.stdout and "at step 3" in proc.stdout


# Slow (the suite's time budget): the default run keeps the bitwise resume
# (test_resume_same_plan_is_bitwise_identical) and the overlapped update's equality
# (tests/amsp/test_amsp_engine.py).
@pytest.mark.slow
def test_overlapped_update_run_and_its_resume_are_bitwise_identical(straight, tmp_path):
    """amsp.overlap_update defers each unit's update to its next forward: the checkpoint written at step 10
    must hold the updated masters (the save completes the pending updates) and the losses stay the same."""
    run = tmp_path / "overlapped"
    overlapped = ("trainer.checkpoint_interval=0", "amsp.plan=ddp", "amsp.overlap_update=true")
    proc = train(run, "trainer.max_steps=10", *overlapped)
    assert "optimizer update: deferred unit by unit to the next forward" in proc.stdout + proc.stderr
    train(run, "trainer.max_steps=20", *overlapped)
    got = losses(run)
    for step in range(1, 21):
        assert got[step] == straight[step], (step, got[step], straight[step])
