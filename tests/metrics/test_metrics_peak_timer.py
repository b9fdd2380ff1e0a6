"""Peak FLOP/s resolution (measured CPU peak with its disk cache, GPU table, override) and StepTimer."""
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from amsp.metrics import peak as peak_mod
from amsp.metrics import StepTimer, resolve_peak
from amsp.metrics.memory import peak_memory_bytes


def test_cpu_peak_is_measured_once_then_read_from_cache(tmp_path, monkeypatch):
    calls = []
    real = peak_mod.measure_matmul_flops

    def counting(dtype, sizes=(256, 512), min_time_s=0.05):
        calls.append(dtype)
        return real(dtype, sizes=sizes, min_time_s=min_time_s)

    monkeypatch.setattr(peak_mod, "measure_matmul_flops", counting)
    # On a busy machine the measurement is used but not cached.
    monkeypatch.setattr(peak_mod.os, "getloadavg", lambda: (1000.0, 0.0, 0.0))
    busy = resolve_peak(torch.device("cpu"), torch.float32, cache_dir=tmp_path)
    assert "not cached" in busy.source and not (tmp_path / "cpu_matmul_peak.json").exists()
    calls.clear()
    monkeypatch.setattr(peak_mod.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    first = resolve_peak(torch.device("cpu"), torch.float32, cache_dir=tmp_path)
    # A real sgemm on any machine this runs on is between 1 GFLOP/s and 100 TFLOP/s.
    assert 1e9 < first.flops < 1e14, first
    second = resolve_peak(torch.device("cpu"), torch.float32, cache_dir=tmp_path)
    assert second.flops == first.flops and "cached" in second.source
    assert len(calls) == 1
    # The cache key holds the thread count: another thread count measures again.
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if old != 1 else 2)
        resolve_peak(torch.device("cpu"), torch.float32, cache_dir=tmp_path)
    finally:
        torch.set_num_threads(old)
    assert len(calls) == 2
    assert f"threads={old}" in (tmp_path / "cpu_matmul_peak.json").read_text()


def test_override_and_gpu_table():
    p = resolve_peak(torch.device("cpu"), torch.float32, override_tflops=123.0)
    assert p.flops == 123e12 and "override" in p.source
    with pytest.raises(ValueError, match="peak_tflops"):
        resolve_peak(torch.device("cpu"), torch.float32, override_tflops=0.0)
    assert resolve_peak(torch.device("cpu"), torch.float32, cluster_tflops=50.0).flops == 50e12
    assert resolve_peak(torch.device("cpu"), torch.float32, 7.0, cluster_tflops=50.0).flops == 7e12
    assert peak_mod.cuda_table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert peak_mod.cuda_table_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert peak_mod.cuda_table_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert peak_mod.cuda_table_peak("NVIDIA H100 80GB HBM3", torch.float32) is None
    assert peak_mod.cuda_table_peak("Some Future GPU", torch.bfloat16) is None


def test_step_timer_phases_accumulate_and_sum_below_step():
    t = StepTimer()
    t.start_step()
    for _ in range(2):  # a phase entered per micro-batch accumulates
        with t.phase("data_wait"):
            time.sleep(0.01)
    with t.phase("forward_backward"):
        time.sleep(0.03)
    out = t.end_step()
    assert out["data_wait"] >= 0.02 and out["forward_backward"] >= 0.03 and out["optimizer"] == 0.0
    assert out["step"] >= out["data_wait"] + out["forward_backward"]
    # lap() charges the time since the previous mark, so one line after each part is enough.
    t.start_step()
    time.sleep(0.01)
    t.lap("data_wait")
    time.sleep(0.02)
    t.lap("optimizer")
    laps = t.end_step()
    assert laps["data_wait"] >= 0.01 and laps["optimizer"] >= 0.02 and laps["forward_backward"] == 0.0
    assert laps["data_wait"] + laps["optimizer"] <= laps["step"]
    with pytest.raises(RuntimeError, match="start_step"):
        with t.phase("optimizer"):
            pass
    t.start_step()
    with pytest.raises(KeyError, match="unknown step phase 'fwd'"):
        with t.phase("fwd"):
            pass


_PEAK_PROBE = """
import torch
from amsp.metrics.memory import peak_memory_bytes, reset_cpu_peak
cpu = torch.device("cpu")
MiB = 2**20
reset_cpu_peak()
before = peak_memory_bytes(cpu)
assert before > 10 * MiB, before  # a Python process with torch loaded holds more than 10 MiB
big = torch.ones(128 * MiB // 4)  # touched, and above glibc's mmap threshold: fresh resident pages
grown = peak_memory_bytes(cpu)
assert grown >= before + 100 * MiB, (before, grown)
del big
assert peak_memory_bytes(cpu) >= grown - MiB  # a high-water mark: freeing does not lower it
reset_cpu_peak()
assert peak_memory_bytes(cpu) <= grown - 100 * MiB  # the reset restarts it from the current RSS
# The recheck's CPU peak (amsp/replan_switch.py): anonymous memory only. A memory-mapped file read after
# the baseline (a dataset as training reads it) is not the model's; a freed tensor's peak is.
import mmap, tempfile
from amsp.metrics.memory import anon_peak_bytes, anon_rss_bytes
base = anon_rss_bytes()
with tempfile.TemporaryFile() as f:
    f.write(b"x" * (64 * MiB)); f.flush()
    mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    assert sum(mapped[i] for i in range(0, 64 * MiB, 4096)) == ord("x") * 16384  # every page resident
    big = torch.ones(128 * MiB // 4)
    del big
    got = anon_peak_bytes() - base
    assert 120 * MiB <= got <= 150 * MiB, got / MiB
    assert anon_rss_bytes() - base < 16 * MiB
    mapped.close()
print("ok")
"""


def test_cpu_peak_memory_is_this_process_hwm_and_resets():
    # A fresh process: the high-water mark of this pytest process depends on every earlier test.
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE], capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.gpu
def test_cuda_peak_memory_and_peak_lookup():
    dev = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(dev)
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    assert peak_memory_bytes(dev) >= 256 * 2**20
    del x
    # A known GPU gets its datasheet peak; an unknown one reports no MFU rather than a guess.
    p = resolve_peak(dev, torch.bfloat16)
    name = torch.cuda.get_device_name(dev)
    assert (p is None) == (peak_mod.cuda_table_peak(name, torch.bfloat16) is None)
    t = StepTimer(sync=torch.cuda.synchronize)
    t.start_step()
    with t.phase("forward_backward"):
        a = torch.randn(2048, 2048, device=dev)
        for _ in range(10):
            a = a @ a.T / 2048
    assert t.end_step()["forward_backward"] > 0
