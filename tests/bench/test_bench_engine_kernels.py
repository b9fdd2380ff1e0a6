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


def test_a_missing_wgrad_library_still_measures_adamw_then_fails(tmp_path, monkeypatch):
    """On a device without cuBLAS's headers the wgrad cases cannot run; the script used to exit there, so the
    AdamW case (a separate kernel, the optimizer's share of the step) was lost with them."""
    import importlib.util

    import pytest

    import amsp.wgrad_fusion

    monkeypatch.setattr(amsp.wgrad_fusion, "mixed_gemm_unavailable", lambda device: "no cublas_v2.h (test)")
    spec = importlib.util.spec_from_file_location("bench_engine_kernels",
                                                  os.path.join(ROOT, "scripts/bench/bench_engine_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "k.json"
    monkeypatch.setattr(sys, "argv", ["bench_engine_kernels.py", "--device", "cpu", "--small", "--repeats", "1",
                                      "--json", str(out), "--markdown", str(tmp_path / "k.md")])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 1
    report = json.loads(out.read_text())
    assert [r["case"].split()[0] for r in report["rows"]] == ["adamw"]
    assert "no cublas_v2.h (test)" in report["missing"] and "no cublas_v2.h (test)" in (tmp_path / "k.md").read_text()
