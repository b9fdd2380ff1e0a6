"""scripts/bench/bench_pipeline_schedules.py runs train.py under each schedule it is given and reports them
side by side; through train.py, zero bubble's losses equal 1F1B's (the same arithmetic in another order)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Slow (the suite's time budget): zero bubble's equality with 1F1B runs in the default run in-process
# (tests/parallel/test_pp_engine.py), and the script's flags are checked by tests/test_benchmarks_commands.py.
@pytest.mark.slow
def test_small_run_reports_both_schedules_with_equal_losses(tmp_path):
    md = tmp_path / "s.md"
    proc = subprocess.run([sys.executable, "scripts/bench/bench_pipeline_schedules.py", "--rounds", "1", "--steps", "3",
                           "--dim", "128", "--layers", "2", "--seq", "64", "--markdown", str(md)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in md.read_text().splitlines()
            if line.startswith("| 1f1b") or line.startswith("| zero_bubble")}
    assert set(rows) == {"1f1b", "zero_bubble"}, md.read_text()
    assert float(rows["zero_bubble"][3]) > 0 and float(rows["zero_bubble"][-2]) <= 1e-5, rows


# Slow (the suite's time budget): the default run keeps the script's small run
# (test_small_run_reports_both_schedules_with_equal_losses).
@pytest.mark.slow
def test_recheck_mode_tabulates_the_planners_prediction_against_the_run(tmp_path):
    md = tmp_path / "r.md"
    proc = subprocess.run([sys.executable, "scripts/bench/bench_pipeline_schedules.py", "--recheck", "2", "--schedules",
                           "gpipe", "--dim", "128", "--layers", "2", "--seq", "64", "--markdown", str(md)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(line.split("|") for line in md.read_text().splitlines() if line.startswith("| gpipe"))
    predicted_step, measured_step, predicted_gib, measured_gib = (float(row[i]) for i in (2, 3, 5, 6))
    assert min(predicted_step, measured_step, predicted_gib, measured_gib) > 0, row
