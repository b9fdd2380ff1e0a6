"""train.py end to end with metrics on: JSONL with MFU, tokens seen, memory and the step-time
breakdown, an offline wandb run holding the chosen plan and the planner's table, and the plot, all
inside the run directory."""
import json
import os
import subprocess
import sys

import pytest

from amsp.metrics.plan_config import PLANS_TABLE
from amsp.metrics.wandb_offline import read_offline_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_writes_metrics_wandb_offline_and_plot(tmp_path):
    env = dict(os.environ, AMSP_CACHE_DIR=str(tmp_path / "cache"), WANDB_SILENT="true")
    cmd = [sys.executable, "train.py", f"trainer.output_dir={tmp_path}", "trainer.run_name=m", "model=debug",
           # the debug preset's 512 vocabulary is below the default tokenizer's 8000 pieces
           "model.vocab_size=8192", "trainer.max_steps=2", "trainer.global_batch_size=4",
           "trainer.micro_batch_size=2", "trainer.log_interval=1", "data.seq_len=64", "logging.wandb.mode=offline",
           "logging.wandb.tags=[unit,cpu]"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    run = tmp_path / "m"
    recs = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2]
    for rec in recs:
        assert rec["tokens_per_s"] > 0 and 0 < rec["mfu"] < 1
        assert rec["tokens"] == rec["step"] * 4 * 64  # steps x global batch x seq_len
        assert rec["memory_kind"] == "cpu_rss" and 0 < rec["memory_current_bytes"] <= rec["memory_peak_bytes"]
        assert rec["time_forward_backward_s"] > 0 and rec["time_optimizer_s"] > 0
        assert rec["time_data_wait_s"] >= 0
        assert rec["step_time_s"] >= rec["time_forward_backward_s"] + rec["time_optimizer_s"]
        assert rec["slowest_rank"] == 0 and rec["skipped_steps"] == 0
    assert "measured matmul peak" in r.stdout and "ETA 0:00:00" in r.stdout and "| 512 tok |" in r.stdout
    assert "| rss " in r.stdout
    offline = [p for p in (run / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(offline) == 1
    # wandb: the plan amsp.plan=auto chose (1 rank: everything replicated) with the planner's
    # prediction in the run config, its ranked table, and the step records.
    wb = read_offline_run(run, wait_finished_s=60)
    assert wb.finished
    chosen = wb.config["chosen_plan"]
    assert chosen["chosen_by"] == "planner" and chosen["blocks"] == {"p": 1, "g": 1, "os": 1}
    assert chosen["predicted"]["step_time_s"] > 0 and chosen["predicted"]["memory_gib_per_rank"] > 0
    # one rank talks to nobody: its optimizer step is not reported as exposed communication
    assert chosen["predicted"]["exposed_comm_s"] == 0 and chosen["predicted"]["optimizer_s"] > 0
    assert chosen["bandwidth_source"] in ("preset", "alpha-beta", "probe", "cache")
    table = wb.table(PLANS_TABLE)
    assert table["data"][0][table["columns"].index("rank")] == 1 and len(table["data"]) == chosen["alternatives"]
    logged = [r for r in wb.history if "train/tokens" in r]
    assert [r["train/tokens"] for r in logged] == [x["tokens"] for x in recs]
    assert all(r["train/memory_peak_bytes"] > 0 and r["train/mfu"] > 0 for r in logged)
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_tokens_seen_continue_across_a_resume_with_another_batch(tmp_path):
    """2 steps of 4 samples, then resumed for 1 step of 8: 2 x 256 + 512 tokens, where steps x the
    current batch would claim 1536."""
    env = dict(os.environ, AMSP_CACHE_DIR=str(tmp_path / "cache"), WANDB_SILENT="true")
    base = [sys.executable, "train.py", f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "model=debug",
            "model.vocab_size=8192", "trainer.micro_batch_size=2", "trainer.log_interval=1", "data.seq_len=64",
            "logging.wandb.mode=disabled", "logging.plot=false",
            # the decay horizon pinned: a longer max_steps alone would change the lr schedule, refused on resume
            "optim.decay_steps=3"]
    for steps, batch in ((2, 4), (3, 8)):
        r = subprocess.run(base + [f"trainer.max_steps={steps}", f"trainer.global_batch_size={batch}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    recs = [json.loads(s) for s in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["tokens"]) for x in recs] == [(1, 256), (2, 512), (3, 1024)]


def test_the_logged_loss_is_the_intervals_mean_skipped_steps_excluded(tmp_path):
    """log_interval=3 logs the mean of its three steps' losses (it logged the last step's alone: two of every
    three losses were never recorded), as the times and tokens/s beside it; a skipped (NaN) step is left out."""
    from tests.training.runs import losses, train

    train(tmp_path / "every", "trainer.max_steps=6")
    every = losses(tmp_path / "every")
    proc = train(tmp_path / "thirds", "trainer.max_steps=6", "trainer.log_interval=3", "debug.nan_loss_at_steps=[6]")
    thirds = losses(tmp_path / "thirds")
    assert sorted(thirds) == [3, 6] and "update skipped" in proc.stdout + proc.stderr, thirds
    for step, steps in ((3, (1, 2, 3)), (6, (4, 5))):  # step 6's NaN is not part of the mean
        want = sum(every[s] for s in steps) / len(steps)
        assert abs(thirds[step] - want) <= 1e-6 * want, (step, thirds, every)
