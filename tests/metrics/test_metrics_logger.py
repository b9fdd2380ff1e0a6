"""MetricsLogger: the JSONL record's numbers, the console line, and the straggler view on 2 ranks."""
import json
import math

import pytest
import torch

from amsp.metrics import MetricsLogger, Peak, straggler_summary
from tests.distributed import run_distributed


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class ListSink:
    def __init__(self):
        self.got = []

    def log_metrics(self, record, step):
        self.got.append((step, record))


def make_logger(tmp_path, clock, **kw):
    args = dict(rank=0, world_size=1, total_steps=100, tokens_per_step=1000, flops_per_token=1e6,
                device=torch.device("cpu"), peak=Peak(1e10, "test"), clock=clock)
    args.update(kw)
    return MetricsLogger(tmp_path, **args)


def test_record_numbers_eta_and_jsonl(tmp_path):
    clock, sink = FakeClock(), ListSink()
    m = make_logger(tmp_path, clock, sink=sink)
    for _ in range(4):  # four steps of 0.5 s each: 0.1 data, 0.3 fwd+bwd, 0.05 optimizer
        clock.t += 0.5
        m.record_step({"data_wait": 0.1, "forward_backward": 0.3, "optimizer": 0.05, "step": 0.5},
                      comm={"bytes_intra_node": 1000.0, "bytes_inter_node": 10.0, "exposed_s": 0.02})
    rec = m.log(4, loss=2.5, lr=1e-3, grad_norm=0.7, skipped_steps=1)
    assert rec["tokens_per_s"] == pytest.approx(4 * 1000 / 2.0)
    assert rec["tflops_per_device"] == pytest.approx(2000 * 1e6 / 1e12)
    assert rec["mfu"] == pytest.approx(2000 * 1e6 / 1e10)
    assert rec["time_data_wait_s"] == pytest.approx(0.1) and rec["time_optimizer_s"] == pytest.approx(0.05)
    assert rec["time_other_s"] == pytest.approx(0.05)
    assert rec["time_exposed_comm_s"] == pytest.approx(0.02)
    assert rec["comm_bytes_intra_node"] == 1000.0 and rec["comm_bytes_inter_node"] == 10.0
    assert rec["eta_s"] == pytest.approx(96 * 0.5)
    assert rec["skipped_steps"] == 1 and rec["slowest_rank"] == 0 and rec["tokens"] == 4000
    # CPU memory: RSS now and the process's peak RSS (a process with torch loaded holds > 10 MiB).
    assert rec["memory_kind"] == "cpu_rss" and rec["memory_reserved_peak_bytes"] is None
    assert 10 * 2**20 < rec["memory_current_bytes"] <= rec["memory_peak_bytes"] and rec["memory_peak_rank"] == 0
    assert sink.got == [(4, rec)]
    line = m.console_line(rec)
    for piece in ("step     4/100", "| 4.00k tok |", "| loss 2.5000 |", "2000 tok/s", "MFU 20.0%",
                  "comm wait 0.020", "| rss ", "skipped 1", "ETA 0:00:48"):
        assert piece in line, (piece, line)
    # A second interval without comm stats and with a diverged loss: appended, strict JSON, nulls.
    clock.t += 0.25  # time between intervals (the logging itself) counts against throughput
    clock.t += 1.0
    m.record_step({"step": 1.0})
    # tokens_seen (the loader's consumed samples x seq_len) wins over step x tokens_per_step: a run
    # resumed with another batch size has seen other than 5 x 1000 tokens by step 5.
    rec2 = m.log(5, loss=float("nan"), lr=1e-3, grad_norm=float("inf"), tokens_seen=123_456)
    assert rec2["tokens"] == 123_456 and "| 123.46k tok |" in m.console_line(rec2)
    assert rec2["tokens_per_s"] == pytest.approx(1000.0 / 1.25)
    assert rec2["comm_bytes_intra_node"] is None and rec2["time_exposed_comm_s"] is None
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    parsed = [json.loads(s) for s in lines]
    assert parsed[0]["step"] == 4 and parsed[1]["loss"] is None and parsed[1]["grad_norm"] is None
    assert "nan" in m.console_line(rec2)


def test_bad_inputs_are_named(tmp_path):
    m = make_logger(tmp_path, FakeClock(), peak=None)
    with pytest.raises(RuntimeError, match="no recorded step"):
        m.log(1, loss=1.0, lr=1.0, grad_norm=1.0)
    with pytest.raises(KeyError, match="bytes_total"):
        m.record_step({"step": 1.0}, comm={"bytes_total": 1})
    with pytest.raises(KeyError, match="'step'"):
        m.record_step({"data_wait": 1.0})
    m.record_step({"step": 1.0})
    rec = m.log(1, loss=1.0, lr=1.0, grad_norm=1.0)
    assert rec["mfu"] is None and "MFU n/a" in m.console_line(rec)


def test_straggler_summary():
    s = straggler_summary([1.0, 1.1, 3.0, 1.0])
    assert s["slowest_rank"] == 2 and s["rank_busy_spread_s"] == pytest.approx(2.0)
    assert s["rank_busy_max_over_median"] == pytest.approx(3.0 / 1.05)
    assert straggler_summary([2.0, 2.0])["slowest_rank"] == 0


def _two_rank_intervals(rank, world, run_dir):
    clock = FakeClock()
    m = MetricsLogger(run_dir, rank=rank, world_size=world, total_steps=10, tokens_per_step=100,
                      flops_per_token=1.0, device=torch.device("cpu"), peak=None, clock=clock)
    out = []
    # Rank 1 holds 256 MiB more (touched, so resident): the memory fields must name it.
    ballast = torch.ones(64 * 2**20) if rank == 1 else None
    for slow_rank in (1, 0):
        for _ in range(2):
            # Both ranks take 1.0 s per step (collectives make the fast one wait); the slow one
            # computes 0.9 s of it, the fast one 0.3 s, of which the engine reports 0.1 s exposed wait.
            work = 0.9 if rank == slow_rank else 0.4
            exposed = 0.0 if rank == slow_rank else 0.1
            clock.t += 1.0
            m.record_step({"data_wait": 0.1, "forward_backward": work - 0.1, "step": 1.0},
                          comm={"bytes_intra_node": 0, "bytes_inter_node": 0, "exposed_s": exposed})
        out.append(m.log(2 * len(out) + 2, loss=1.0, lr=1.0, grad_norm=1.0))
    del ballast
    return out


def test_slowest_rank_is_named_across_ranks(tmp_path):
    res = run_distributed(_two_rank_intervals, 2, str(tmp_path), timeout=120)
    assert res[1] == [None, None]  # only rank 0 reports
    first, second = res[0]
    assert first["slowest_rank"] == 1 and second["slowest_rank"] == 0
    assert first["rank_busy_max_s"] == pytest.approx(0.9) and first["rank_busy_min_s"] == pytest.approx(0.3)
    assert first["step_time_max_rank_s"] == pytest.approx(1.0)
    assert math.isclose(first["rank_busy_max_over_median"], 0.9 / 0.6)
    assert "slowest rank 1 (busy 1.50x median)" in MetricsLogger.console_line(first)
    assert first["memory_peak_rank"] == 1 and first["memory_current_bytes"] >= 256 * 2**20
    assert "on rank 1" in MetricsLogger.console_line(first)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.gpu
def test_cuda_memory_is_the_allocator_peak_per_log_window(tmp_path):
    dev = torch.device("cuda", 0)
    clock = FakeClock()
    m = make_logger(tmp_path, clock, device=dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    big = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    clock.t += 1.0
    m.record_step({"step": 1.0})
    rec = m.log(1, loss=1.0, lr=1.0, grad_norm=1.0)
    assert rec["memory_kind"] == "cuda_allocator"
    assert rec["memory_peak_bytes"] >= base + 512 * 2**20
    assert rec["memory_reserved_peak_bytes"] >= rec["memory_peak_bytes"]
    assert rec["memory_current_bytes"] >= 512 * 2**20
    assert "mem peak" in m.console_line(rec) and "reserved" in m.console_line(rec)
    del big
    # The peak restarts at each log step from what is allocated then: the window in which the 512 MiB
    # were freed still shows them, the one after does not.
    peaks = []
    for step in (2, 3):
        clock.t += 1.0
        m.record_step({"step": 1.0})
        peaks.append(m.log(step, loss=1.0, lr=1.0, grad_norm=1.0)["memory_peak_bytes"])
    assert peaks[0] >= base + 512 * 2**20 and peaks[1] < peaks[0] - 256 * 2**20
