"""wandb logger in offline and disabled modes (no network), secret scrubbing, the chosen plan in the
run config read back from the offline files, and the plot CLI comparing runs."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from amsp.metrics.plan_config import PLANS_TABLE, log_plan, log_switch, plan_summary
from amsp.metrics.plot import build_figure, load_run, main as plot_main, run_labels
from amsp.metrics.wandb_logger import WandbLogger, scrub_secrets
from amsp.metrics.wandb_offline import read_offline_run
from amsp.plan import make_plan
from amsp.planner.report import COLUMNS

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


def test_an_online_run_without_credentials_is_one_line_with_the_way_out(tmp_path, monkeypatch):
    """wandb's own error (a UsageError traceback, exit 1) becomes the project's input error: one line,
    exit 2, naming offline and disabled."""
    from amsp.errors import InputError

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login either
    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(InputError) as e:
        WandbLogger(mode="online", run_dir=tmp_path / "run", config={})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("wandb could not start the run in online mode (")
    assert "logging.wandb.mode=offline" in msg and "logging.wandb.mode=disabled" in msg


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
    recs = [{"step": s, "total_steps": 30, "world_size": 1, "loss": 5.0 - s / 10, "tokens": 64 * s,
             "tokens_per_s": 1000.0 + s, "mfu": 0.1} for s in (10, 20)]
    recs.append({"step": 20, "total_steps": 30, "world_size": 1, "loss": 3.0, "tokens": 64 * 20,
                 "tokens_per_s": 900.0, "mfu": None})  # a resumed run re-logged step 20 without a known peak
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = subprocess.run([sys.executable, "-m", "amsp.metrics.plot", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    png = (tmp_path / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plot_main([str(empty)]) == 2


def _write_run(run_dir, tokens_per_step, losses, mfu=0.1, memory=2**30, val=None):
    run_dir.mkdir(parents=True)
    recs = [{"step": 10 * (i + 1), "total_steps": 10 * len(losses), "world_size": 2, "loss": loss,
             "tokens": 10 * (i + 1) * tokens_per_step, "tokens_per_s": 1000.0 * (i + 1), "mfu": mfu,
             "memory_peak_bytes": memory, "step_time_s": 0.5} for i, loss in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if val:
        (run_dir / "validation.jsonl").write_text("".join(json.dumps({"step": s, "val_loss": v}) + "\n"
                                                          for s, v in val))


def test_plot_compares_runs_on_one_figure(tmp_path, capsys):
    a, b = tmp_path / "sweep1" / "m", tmp_path / "sweep2" / "m"  # same run name, other sweeps
    _write_run(a, 100, [5.0, 4.0, 3.5], val=[(15, 4.5), (30, 3.6)])
    _write_run(b, 200, [5.5, 4.5], mfu=None, memory=3 * 2**30)
    labels = run_labels([a, b])
    assert labels == ["sweep1/m", "sweep2/m"]
    fig = build_figure([load_run(a, labels[0]), load_run(b, labels[1])], x="tokens")
    axes = {ax.get_ylabel(): ax for ax in fig.axes}
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == labels
    loss_lines = axes["training loss"].get_lines()
    assert [ln.get_label() for ln in loss_lines] == labels
    # Over tokens seen: run b's batch is twice run a's.
    assert list(loss_lines[0].get_xdata()) == [1000, 2000, 3000] and list(loss_lines[1].get_xdata()) == [2000, 4000]
    # Validation at step 15 (between two log steps) lies at the interpolated 1500 tokens; only run a has it.
    (val_line,) = axes["validation loss"].get_lines()
    assert val_line.get_label() == "sweep1/m" and list(val_line.get_xdata()) == [1500, 3000]
    (mfu_line,) = axes["MFU (%)"].get_lines()  # run b knows no peak: no line, not a line of zeros
    assert list(mfu_line.get_ydata()) == [10.0] * 3
    mem = axes["peak memory per rank (GiB)"].get_lines()
    assert [list(ln.get_ydata()) for ln in mem] == [[1.0] * 3, [3.0] * 2]
    steps = build_figure([load_run(a)], x="step")
    assert list(steps.axes[0].get_lines()[0].get_xdata()) == [10, 20, 30]

    out = tmp_path / "cmp.png"
    r = subprocess.run([sys.executable, "-m", "amsp.metrics.plot", str(a), str(b), "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Several runs need --out; a directory without metrics.jsonl is named.
    assert plot_main([str(a), str(b)]) == 2 and "--out" in capsys.readouterr().err
    (tmp_path / "nothing").mkdir()
    assert plot_main([str(a), str(tmp_path / "nothing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nothing/metrics.jsonl does not exist" in err and err.count("\n") == 1


def _planned(plan, step_time_s=1.25, rows=2):
    """A planner outcome (amsp/planner/startup.py PlanOutcome) whose rank-1 row is `plan`."""
    def row(rank, p):
        r = dict.fromkeys(COLUMNS, 0.0)
        r.update(rank=rank, plan=str(p.blocks), name=p.name, blocks_p=p.blocks.p, blocks_g=p.blocks.g,
                 blocks_os=p.blocks.os, mem_total_gib=3.5, step_time_s=step_time_s * rank, mfu=0.4 / rank)
        return [r[c] for c in COLUMNS]
    other = make_plan("ddp", 4, 2)
    table = ("cluster cpu: 2 node(s) x 2 ranks, 8.0 GiB/device, peak 1 TFLOP/s (fp32), bandwidths from probe "
             "(bus GB/s by per-rank chunk; inter = per node), hidden ...\n  intra ...")
    return SimpleNamespace(plan=plan, table=table, columns=list(COLUMNS), cluster=SimpleNamespace(source="probe"),
                           rows=[row(1, plan)] + [row(i + 2, other) for i in range(rows - 1)])


def test_chosen_plan_and_planner_table_in_offline_wandb_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    auto = make_plan("zero2", 4, 2)
    by_hand = make_plan("zero3", 4, 2)
    with pytest.raises(ValueError, match="not the plan the run uses"):
        plan_summary(by_hand, "auto", _planned(auto))
    w = WandbLogger(mode="offline", run_dir=tmp_path / "auto", config={"amsp": {"plan": "auto"}})
    log_plan(w, auto, "auto", _planned(auto, rows=3))
    w.finish()
    run = read_offline_run(tmp_path / "auto", wait_finished_s=60)
    assert run.finished
    chosen = run.config["chosen_plan"]
    assert chosen["chosen_by"] == "planner" and chosen["name"] == "zero2" and chosen["amsp_plan"] == "auto"
    assert chosen["blocks"] == {"p": auto.blocks.p, "g": auto.blocks.g, "os": auto.blocks.os}
    assert chosen["embed_head"] == {"p": auto.embed_head.p, "g": auto.embed_head.g, "os": auto.embed_head.os}
    assert chosen["predicted"]["step_time_s"] == 1.25 and chosen["predicted"]["memory_gib_per_rank"] == 3.5
    assert chosen["bandwidth_source"] == "probe" and chosen["cluster"].startswith("cluster cpu: 2 node(s)")
    assert run.config["amsp"] == {"plan": "auto"}  # the initial config is still there
    table = run.table(PLANS_TABLE)
    assert table["columns"] == list(COLUMNS) and [r[0] for r in table["data"]] == [1, 2, 3]
    # A plan named by hand: degrees in the config, no prediction, no table.
    w = WandbLogger(mode="offline", run_dir=tmp_path / "hand", config={})
    log_plan(w, by_hand, "zero3")
    w.finish()
    run = read_offline_run(tmp_path / "hand", wait_finished_s=60)
    assert run.finished
    chosen = run.config["chosen_plan"]
    assert chosen["chosen_by"] == "config" and chosen["name"] == "zero3" and "predicted" not in chosen
    assert chosen["blocks"] == {"p": by_hand.blocks.p, "g": by_hand.blocks.g, "os": by_hand.blocks.os}
    assert run.tables == {}
    with pytest.raises(KeyError, match="no table"):
        run.table(PLANS_TABLE)
    # The re-planner switched mid-run: the config names the plan trained from then on, and the one before.
    w = WandbLogger(mode="offline", run_dir=tmp_path / "switched", config={})
    log_plan(w, auto, "auto", _planned(auto))
    log_switch(w, by_hand, auto, "auto", 7, "zero3 predicted 12% faster")
    w.finish()
    chosen = read_offline_run(tmp_path / "switched", wait_finished_s=60).config["chosen_plan"]
    assert chosen["chosen_by"] == "replanner" and chosen["name"] == "zero3" and chosen["switched_at_step"] == 7
    assert chosen["blocks"] == {"p": by_hand.blocks.p, "g": by_hand.blocks.g, "os": by_hand.blocks.os}
    assert chosen["replaced"]["name"] == "zero2" and chosen["reason"] == "zero3 predicted 12% faster"
    assert "predicted" not in chosen  # the startup's prediction was for the plan replaced


def test_a_start_wandb_refuses_writes_nothing_to_the_run_directory(tmp_path, monkeypatch):
    """train.py with logging.wandb.mode=online and no login: exit 2, and the run directory holds no config.yaml
    or plan.txt of a run that never started (they were written before wandb was asked)."""
    from amsp.errors import EXIT_INPUT
    from tests.training.runs import train

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "runs" / "r"
    proc = train(run, "trainer.max_steps=1", "logging.wandb.mode=online", check=False)
    assert proc.returncode == EXIT_INPUT and "wandb could not start the run" in proc.stderr, proc.stderr[-2000:]
    assert not (run / "config.yaml").exists() and not (run / "plan.txt").exists(), sorted(run.iterdir())
