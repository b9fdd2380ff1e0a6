"""The GPU-vs-transformers benchmark's code path, on CPU with a tiny shape (the real run needs a GPU:
scripts/gpu/check.sh). Runs the script as a user would, in a subprocess, and reads its JSON."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench", "bench_gpu_vs_hf.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu_vs_hf", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_cpu_run_measures_every_requested_variant(tmp_path):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    # The eager compile backend traces hf_compiled with dynamo without inductor's C++ build, which
    # alone takes a minute on two cores; the GPU run uses inductor.
    cmd = [sys.executable, SCRIPT, "--tiny", "--device", "cpu", "--threads", "1", "--variants",
           "ours,ours_overlap_update,ours_fuse_wgrad,ours_fast,ours_no_optimizer,hf,hf_compiled",
           "--compile-backend", "eager", "--peak-tflops", "0.05", "--json", str(out_json), "--markdown", str(out_md)]
    env = {**os.environ, "AMSP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out_json.read_text())
    summary = report["summary"]
    assert set(summary) == {"ours", "ours_overlap_update", "ours_fuse_wgrad", "ours_fast", "ours_no_optimizer", "hf",
                            "hf_compiled"}
    for name, s in summary.items():
        assert s["status"] == "ok", (name, s)
        assert s["tokens_per_s"] > 0 and 0 < s["mfu"] < 1, (name, s)
        assert 0 < s["optimizer_share"] < 1, (name, s)
        assert s["first_step_s_round1"] >= s["build_s_round1"] > 0, (name, s)
    # The floor takes every step out of the optimizer; the others are read against it.
    assert summary["ours_no_optimizer"]["skipped_steps"] == 2 and summary["ours"]["skipped_steps"] == 0
    for name in ("ours", "ours_overlap_update", "ours_fuse_wgrad", "ours_fast"):
        assert summary[name]["exposed_optimizer_share"] < 1, summary[name]
    assert "exposed_optimizer_share" not in summary["hf"]
    rounds = report["rounds"]["ours"][0]
    assert len(rounds["step_s"]) == 2 and rounds["skipped_steps"] == 0
    table = out_md.read_text()
    for name in ("| ours |", "| hf |", "| hf_compiled |"):
        assert name in table
    # The same numbers reach the table: tokens/s of ours as printed.
    assert f"{summary['ours']['tokens_per_s']:,.0f}" in table


def test_transformers_config_is_checked_field_by_field():
    bench = _load_script()
    from models.llama import get_preset

    cfg = get_preset("debug")
    hf = bench.hf_config(cfg)
    bench.check_same_config(cfg, hf)  # identical by construction
    hf.rms_norm_eps = cfg.norm_eps * 10
    with pytest.raises(SystemExit, match="norm eps"):
        bench.check_same_config(cfg, hf)


def test_model_overrides_are_typed_and_checked():
    bench = _load_script()
    args = bench.parse_args(["--tiny", "--device", "cpu", "--set", "fused=off", "--set", "vocab_size=1024"])
    cfg = bench.model_config(args)
    assert cfg.fused == "off" and cfg.vocab_size == 1024 and cfg.max_seq_len >= 64
    with pytest.raises(SystemExit, match="not a model config field"):
        bench.model_config(bench.parse_args(["--tiny", "--device", "cpu", "--set", "no_such_field=1"]))
