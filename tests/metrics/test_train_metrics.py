"""train.py end to end with metrics on: JSONL with MFU and the step-time breakdown, an offline wandb
run directory and the plot, all inside the run directory."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_writes_metrics_wandb_offline_and_plot(tmp_path):
    env = dict(os.environ, AMSP_CACHE_DIR=str(tmp_path / "cache"), WANDB_SILENT="true")
    cmd = [sys.executable, "train.py", f"trainer.output_dir={tmp_path}", "trainer.run_name=m", "model=debug",
           # the debug preset's 512 vocabulary is below the default tokenizer's 8000 pieces
           "model.vocab_size=8192", "trainer.max_steps=2", "trainer.log_interval=1", "data.seq_len=64", "logging.wandb.mode=offline",
           "logging.wandb.tags=[unit,cpu]"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    run = tmp_path / "m"
    recs = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2]
    for rec in recs:
        assert rec["tokens_per_s"] > 0 and 0 < rec["mfu"] < 1 and rec["peak_memory_bytes"] > 0
        assert rec["time_forward_backward_s"] > 0 and rec["time_optimizer_s"] > 0
        assert rec["time_data_wait_s"] >= 0
        assert rec["step_time_s"] >= rec["time_forward_backward_s"] + rec["time_optimizer_s"]
        assert rec["slowest_rank"] == 0 and rec["skipped_steps"] == 0
    assert "measured matmul peak" in r.stdout and "ETA 0:00:00" in r.stdout
    offline = [p for p in (run / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(offline) == 1
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"
