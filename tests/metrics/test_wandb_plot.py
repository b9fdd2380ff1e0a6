"""wandb logger in offline and disabled modes (no network), secret scrubbing, and the plot CLI."""
import json
import os
import subprocess
import sys

import pytest

from amsp.metrics.plot import main as plot_main
from amsp.metrics.wandb_logger import WandbLogger, scrub_secrets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "test-api-key-0123456789abcdef0123456789"


def _all_bytes(root):
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                yield os.path.join(dirpath, f), fh.read()


def test_scrub_secrets_keeps_ordinary_keys():
    cfg = {"trainer": {"global_batch_tokens": 4096, "max_steps": 3},
           "logging": {"wandb": {"api_key": "x", "project": "p"}, "hf_token": "y", "password": "z"},
           "notes": [SECRET, "ok"]}
    out = scrub_secrets(cfg, frozenset({SECRET}))
    assert out == {"trainer": {"global_batch_tokens": 4096, "max_steps": 3},
                   "logging": {"wandb": {"project": "p"}}, "notes": ["<redacted>", "ok"]}


def test_offline_run_logs_resumes_and_never_stores_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {"model": {"dim": 64}, "logging": {"wandb": {"mode": "offline", "api_key": SECRET}}}
    w = WandbLogger(mode="offline", run_dir=tmp_path, config=cfg, project="proj", name="unit",
                    tags=["a", "b"], group="grp")
    run_id = w.run_id
    assert run_id and w.active
    w.log_metrics({"loss": 2.0, "mfu": None, "step": 5, "tokens_per_s": 10.0}, step=5)
    w.log_metrics({"val/loss": 2.5}, step=5)
    w.log_table("plans", ["plan", "time_s"], [["ddp", 1.5], ["zero3", 2.5]])
    with pytest.raises(ValueError, match="expected 2"):
        w.log_table("plans", ["plan", "time_s"], [["ddp"]])
    summary = dict(w._run.summary)
    assert summary["train/loss"] == 2.0 and summary["val/loss"] == 2.5 and "train/mfu" not in summary
    w.finish()
    runs = sorted(p.name for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-"))
    assert len(runs) == 1 and runs[0].endswith(run_id)
    tables = list((tmp_path / "wandb" / runs[0]).rglob("plans_*.table.json"))
    assert tables and json.loads(tables[0].read_text())["data"] == [["ddp", 1.5], ["zero3", 2.5]]
    # A restart with the stored id continues the same run.
    w2 = WandbLogger(mode="offline", run_dir=tmp_path, config=cfg, resume_id=run_id)
    assert w2.run_id == run_id
    w2.finish()
    for path, data in _all_bytes(tmp_path):
        assert SECRET.encode() not in data, f"API key leaked into {path}"


def test_disabled_and_non_zero_ranks_do_nothing(tmp_path):
    for kw in ({"mode": "disabled"}, {"mode": "offline", "rank": 1}):
        w = WandbLogger(run_dir=tmp_path, config={}, **kw)
        assert w.run_id is None and not w.active
        w.log_metrics({"loss": 1.0}, step=1)
        w.log_table("t", ["a"], [[1]])
        w.finish()
    assert not (tmp_path / "wandb").exists()
    with pytest.raises(ValueError, match="online\\|offline\\|disabled"):
        WandbLogger(mode="cloud", run_dir=tmp_path, config={})


def test_plot_cli_writes_png(tmp_path):
    recs = [{"step": s, "total_steps": 30, "world_size": 1, "loss": 5.0 - s / 10,
             "tokens_per_s": 1000.0 + s, "mfu": 0.1} for s in (10, 20)]
    recs.append({"step": 20, "total_steps": 30, "world_size": 1, "loss": 3.0, "tokens_per_s": 900.0,
                 "mfu": None})  # a resumed run re-logged step 20 without a known peak
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = subprocess.run([sys.executable, "-m", "amsp.metrics.plot", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    png = (tmp_path / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plot_main([str(empty)]) == 1
