"""CUDA-event timing: the step timer (amsp/metrics/timer.py) and the exposed-communication stall
(amsp/collectives.py). Work is queued asynchronously with a known ordering; the measured times must
follow the device's timeline, and nothing may call torch.cuda.synchronize on the way."""
from __future__ import annotations

import pytest
import torch

from amsp.collectives import Comm
from amsp.metrics import StepTimer
from amsp.topology import Topology

pytestmark = pytest.mark.gpu

N = 4096


def _matmuls(a: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        a = a @ a.T / N
    return a


@pytest.fixture
def sync_calls(monkeypatch):
    """Counts torch.cuda.synchronize calls (the thing the event timer must not do)."""
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def test_event_timer_follows_device_timeline_without_synchronize(sync_calls):
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(N, N, device=dev)
    _matmuls(a, 3)  # warm-up: cuBLAS handles and kernels loaded
    torch.cuda.current_stream(dev).synchronize()
    sync_calls.clear()
    t = StepTimer(dev)
    results = []
    for _ in range(3):
        t.start_step()
        t.lap("data_wait")  # nothing queued: ~0
        b = _matmuls(a, 20)
        t.lap("forward_backward")
        with t.phase("optimizer"):
            c = _matmuls(b, 10)
        results.append(t.end_step())
        assert not sync_calls, "the event timer called torch.cuda.synchronize"
    del c
    for r in results[1:]:
        parts = r["data_wait"] + r["forward_backward"] + r["optimizer"]
        # Laps and the phase tile the step's stream timeline: what is left is the few microseconds
        # between the phase's end and end_step's mark.
        assert abs(r["step"] - parts) <= 0.05 * r["step"], r
        # The launches return long before the kernels finish; events charge each phase its kernels:
        # 20 matmuls against 10 of the same shape.
        assert 1.6 <= r["forward_backward"] / r["optimizer"] <= 2.4, r
        assert r["data_wait"] <= 0.05 * r["step"], r
        # Real device time, not launch time: 10 fp32 4096^3 matmuls are >= 1.3 TFLOP, i.e. >= 1 ms
        # even at the H100/H200 fp32 (TF32) tensor-core datasheet peak.
        assert r["optimizer"] >= 1e-3, r


def test_exposed_comm_is_the_stream_stall():
    """A collective's NCCL wait() makes the current stream wait for the communication stream; here a
    side stream plays the collective and wait_event plays wait(). Exposed time must be the stall:
    ~0 when compute queued before the wait outlasts the 'collective', ~its length when not."""
    dev = torch.device("cuda", torch.cuda.current_device())
    comm = Comm(Topology(1, 1), 0)
    comm.stream_timing = True  # what an NCCL process group sets (no group in this test)
    side = torch.cuda.Stream(dev)
    a = torch.randn(N, N, device=dev)
    _matmuls(a, 3)
    torch.cuda.synchronize(dev)

    def stall(compute: int, collective: int) -> float:
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):  # the "collective", launched first
            _matmuls(a, collective)
            done = torch.cuda.Event()
            done.record(side)
        _matmuls(a, compute)  # overlapping compute on the main stream
        with comm.timed(("exposed", "grad")):
            main.wait_event(done)
        stats = comm.close_step()
        return stats.exposed_by_phase["grad"], stats.exposed_s

    # One matmul of this shape takes ~0.1-3 ms depending on the GPU; the contrasts are 20x.
    hidden, total = stall(compute=40, collective=2)
    assert hidden == total
    exposed, _ = stall(compute=0, collective=40)
    hidden_again, _ = stall(compute=40, collective=2)
    assert exposed > 10 * max(hidden, hidden_again, 1e-5), (exposed, hidden, hidden_again)
