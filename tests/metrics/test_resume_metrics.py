"""Metrics across a resume: elapsed_s continues from the checkpoint's value (it restarted at 0), and wandb
keeps the steps a resumed run logs again (it dropped them: wandb refuses a step below its current one)."""
import json
import logging
import re

import pytest
import torch

from amsp.metrics import MetricsLogger
from amsp.metrics.wandb_logger import WandbLogger
from amsp.metrics.wandb_offline import read_offline_run

STEP_METRIC = "train/step"  # the axis the README names


class FakeClock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self):
        return self.t


def make_logger(run_dir, clock, rank=0):
    return MetricsLogger(run_dir, rank=rank, world_size=1, total_steps=10, tokens_per_step=100,
                         flops_per_token=1.0, device=torch.device("cpu"), peak=None, clock=clock)


def log_one_step(m, clock, step, seconds):
    clock.t += seconds
    m.record_step({"step": seconds})
    return m.log(step, loss=1.0, lr=1e-3, grad_norm=1.0)


def test_elapsed_s_continues_from_the_checkpoint(tmp_path):
    clock = FakeClock(100.0)
    first = make_logger(tmp_path, clock)
    assert log_one_step(first, clock, 1, 30.0)["elapsed_s"] == pytest.approx(30.0)
    clock.t += 10.0  # the checkpoint of step 1 is taken 40 s into the run
    meta = json.loads(json.dumps({"step": 1, **first.checkpoint_state()}))  # as meta.json holds it
    assert meta["elapsed_s"] == pytest.approx(40.0)
    clock.t += 500.0  # trained on past the checkpoint, then killed: this time is not counted

    # The resumed process: another clock origin (perf_counter is per process).
    clock = FakeClock(7.0)
    resumed = make_logger(tmp_path, clock)
    resumed.restore_checkpoint_state(meta, tmp_path / "checkpoints" / "step_00000001")
    assert resumed.elapsed_s() == pytest.approx(40.0)
    assert log_one_step(resumed, clock, 2, 5.0)["elapsed_s"] == pytest.approx(45.0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["elapsed_s"]) for r in rows] == [(1, pytest.approx(30.0)), (2, pytest.approx(45.0))]
    clock.t += 1.0
    assert resumed.checkpoint_state() == {"elapsed_s": pytest.approx(46.0)}  # the next checkpoint's value


def test_a_checkpoint_without_elapsed_s_resumes_from_zero_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="metrics")
    clock = FakeClock(50.0)
    m = make_logger(tmp_path, clock)
    m.restore_checkpoint_state({"step": 3, "consumed_samples": 48}, "ckpt/step_00000003")
    assert log_one_step(m, clock, 4, 2.0)["elapsed_s"] == pytest.approx(2.0)
    notes = [r.getMessage() for r in caplog.records if "elapsed_s" in r.getMessage()]
    assert notes == ["checkpoint ckpt/step_00000003 holds no elapsed_s (written before it was recorded): "
                     "elapsed_s restarts at 0"]
    caplog.clear()
    make_logger(tmp_path, FakeClock(0.0), rank=1).restore_checkpoint_state({"step": 3}, "ckpt/step_00000003")
    assert not caplog.records  # rank 0 says it once


@pytest.mark.parametrize("value", ["12.5", -1.0, float("nan"), float("inf"), True, None])
def test_a_bad_stored_elapsed_s_is_named_and_restarts_at_zero(tmp_path, value, caplog):
    clock = FakeClock(0.0)
    m = make_logger(tmp_path, clock)
    with caplog.at_level("WARNING", logger="metrics"):
        m.restore_checkpoint_state({"elapsed_s": value}, "ckpt/step_00000003")
    assert re.search(r"checkpoint ckpt/step_00000003: meta.json elapsed_s=.* finite number", caplog.text), caplog.text
    clock.t = 5.0
    assert m.elapsed_s() == 5.0


def test_wandb_keeps_the_steps_a_resumed_run_logs_again(tmp_path, monkeypatch):
    """A run killed at step 5 with its last checkpoint at step 2 logs steps 3.. again after the resume, while
    wandb's step counter is past them (online, a resumed run starts at the server's last step + 1; here one
    offline run logs both). With log(step=step) wandb dropped steps 3 and 4 of the resumed run (and let step 5
    overwrite the killed run's); logged over the train/step metric, every row is there."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    w = WandbLogger(mode="offline", run_dir=tmp_path, config={})
    for step in range(1, 6):
        w.log_metrics({"step": step, "loss": float(step)}, step=step)
    w.log_table("planner/plans", ["plan"], [["ddp"]])  # the resumed run's startup logs the plan table again
    for step in range(3, 7):
        w.log_metrics({"step": step, "loss": 10.0 + step}, step=step)
    w.log_metrics({"val/loss": 2.5}, step=6)
    w.finish()
    run = read_offline_run(tmp_path, wait_finished_s=60)
    assert run.finished
    assert [r["train/loss"] for r in run.history if "train/loss" in r] == [1, 2, 3, 4, 5, 13, 14, 15, 16]
    assert run.step_metrics == {"train/*": STEP_METRIC, "val/*": STEP_METRIC}
    train = [(r[STEP_METRIC], r["train/loss"]) for r in run.history if "train/loss" in r]
    assert train == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (3, 13.0), (4, 14.0), (5, 15.0), (6, 16.0)]
    assert [(r[STEP_METRIC], r["val/loss"]) for r in run.history if "val/loss" in r] == [(6, 2.5)]
    # A restart with the run id defines the axis again.
    w2 = WandbLogger(mode="offline", run_dir=tmp_path / "again", config={}, resume_id=run.run_id)
    w2.log_metrics({"loss": 1.0}, step=7)
    w2.finish()
    again = read_offline_run(tmp_path / "again", wait_finished_s=60)
    assert again.step_metrics == {"train/*": STEP_METRIC, "val/*": STEP_METRIC}
    assert [(r[STEP_METRIC], r["train/loss"]) for r in again.history] == [(7, 1.0)]
    with pytest.raises(TypeError, match="trainer step"):  # a float would be a silently odd axis value
        w2.log_metrics({"loss": 1.0}, step=7.0)


@pytest.mark.slow  # two train.py runs (~20 s); the in-process tests above cover the logger itself
def test_train_py_stores_elapsed_s_and_a_resume_continues_it(tmp_path):
    from tests.training.runs import records, train

    run = tmp_path / "r"
    train(run, "trainer.max_steps=2")
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    before = {r["step"]: r["elapsed_s"] for r in records(run)}
    assert meta["elapsed_s"] >= before[2] > 0
    proc = train(run, "trainer.max_steps=3")
    assert "holds no elapsed_s" not in proc.stdout + proc.stderr
    after = {r["step"]: r["elapsed_s"] for r in records(run)}
    assert after[2] == before[2] and after[3] > meta["elapsed_s"]
    meta3 = json.loads((run / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta3["elapsed_s"] >= after[3]
