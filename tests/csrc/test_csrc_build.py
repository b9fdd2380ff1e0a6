"""The extension loader: cached builds, one warning on failure, and model.fused selection."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from csrc import loader

ROOT = Path(__file__).resolve().parents[2]


def test_build_failure_warns_once_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "broken.cpp"
    bad.write_text("int broken( {\n")  # no includes: g++ fails in well under a second
    ext = loader.NativeExtension("amsp_broken_test", [bad])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ext.load() is None
        assert ext.load() is None  # the second call neither rebuilds nor warns again
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "amsp_broken_test" in msgs[0] and "error" in msgs[0]
    assert "error" in ext.error and "broken" in ext.error  # the compiler's own error line


def test_build_key_tracks_sources_and_flags(tmp_path):
    src = tmp_path / "a.cpp"
    src.write_text("// v1\n")
    k1 = loader.build_key([src], ["-O3"])
    assert loader.build_key([src], ["-O2"]) != k1
    src.write_text("// v2\n")
    assert loader.build_key([src], ["-O3"]) != k1


def test_second_process_reuses_the_cached_build(native_ext):
    so = Path(native_ext)
    before = so.stat().st_mtime_ns
    code = "from csrc.loader import load_extension; print(load_extension())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(so)
    assert so.stat().st_mtime_ns == before  # ninja found it up to date: nothing was recompiled


def test_fused_selection(native_ext, monkeypatch):
    from models.llama import fused

    assert fused.resolve_fused("off") == frozenset()
    assert fused.resolve_fused("on") == frozenset(fused.ALL_OPS)
    assert fused.resolve_fused("auto") == frozenset(fused.AUTO_OPS)
    assert set(fused.AUTO_OPS) <= set(fused.ALL_OPS)
    with pytest.raises(ValueError, match="model.fused"):
        fused.resolve_fused("yes")


def test_fused_on_errors_when_the_extension_is_unavailable(monkeypatch):
    from models.llama import fused

    ext = loader.NativeExtension("amsp_unavailable_test", [])
    ext.error = "simulated build failure"
    monkeypatch.setattr(loader, "CPU_EXTENSION", ext)
    with pytest.raises(RuntimeError, match="simulated build failure"):
        fused.resolve_fused("on")
    assert fused.resolve_fused("auto") == frozenset()  # auto falls back to eager (logged)


def test_config_rejects_unknown_fused_choice():
    from models.llama.config import LlamaConfig

    with pytest.raises(ValueError, match="model.fused"):
        LlamaConfig(fused="maybe")
