"""scripts/bench/bench_engine_kernels.py runs (CPU, small shapes) and reports each case for both variants: the
script check.sh's `kernels` part runs on a GPU, kept from rotting where there is none."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_small_cpu_run_reports_every_case(tmp_path):
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "scripts/bench/bench_engine_kernels.py", "--device", "cpu", "--small",
                           "--repeats", "2", "--json", str(out), "--markdown", str(tmp_path / "k.md")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"].split()[0] for r in rows] == ["wgrad", "wgrad", "adamw"]
    assert all(r["default_ms"] > 0 and r["ours_ms"] > 0 for r in rows)
    assert "| adamw 1M elements + bf16 weights |" in (tmp_path / "k.md").read_text()
