"""Batches for a CUDA run are pinned by the loader (data/loader.py), so the engine's copy to the GPU can
be non-blocking. torch.Tensor.is_pinned needs CUDA: here the decision and the plumbing are checked with
the pinning step recorded; tests/gpu/test_input_copy_cuda.py checks real pinned batches on a GPU."""
import threading

import numpy as np
import pytest
import torch

from data import loader as loader_mod
from data.loader import MicroBatchLoader, collate, pin_device_for, validation_batches

SEQ = 8


def _source(n=32):
    return [np.arange(i, i + SEQ + 1, dtype=np.int64) for i in range(n)]


@pytest.fixture
def recorded(monkeypatch):
    """Replaces the pinning copy (which needs CUDA) by a plain contiguous copy, and torch.cuda.set_device by
    a recorder; returns what each saw, with the calling thread's name."""
    seen = {"pinned": [], "set_device": []}

    def fake_pinned(t):
        seen["pinned"].append((threading.current_thread().name, tuple(t.shape), t.is_contiguous()))
        out = t.contiguous().clone()
        out.came_through_pinning = True  # what a test can check on the batch it is handed
        return out

    monkeypatch.setattr(loader_mod, "_pinned", fake_pinned)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen["set_device"].append(
        (threading.current_thread().name, torch.device(d))))
    return seen


def test_pins_for_cuda_only():
    assert pin_device_for(None) is None
    assert pin_device_for("cpu") is None and pin_device_for(torch.device("cpu")) is None
    assert pin_device_for("meta") is None
    assert pin_device_for("cuda") == torch.device("cuda")
    assert pin_device_for(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_collate_pins_contiguous_copies_with_the_same_values(recorded):
    rows = _source(4)
    x, y = collate(rows)
    xp, yp = collate(rows, pin=True)
    assert torch.equal(x, xp) and torch.equal(y, yp)
    assert xp.is_contiguous() and yp.is_contiguous()
    # The strided views are what reach the pinning copy, which makes them contiguous.
    assert [s for _, s, _ in recorded["pinned"]] == [(4, SEQ), (4, SEQ)]


def test_cuda_loader_pins_in_its_prefetch_thread_on_the_run_device(recorded):
    plain = MicroBatchLoader(_source(), 8, 4, prefetch=2)
    ld = MicroBatchLoader(_source(), 8, 4, prefetch=2, pin_device=torch.device("cuda", 1))
    try:
        for _ in range(3):
            (x, y), (xr, yr) = next(ld), next(plain)
            assert torch.equal(x, xr) and torch.equal(y, yr)
    finally:
        ld.close()
        plain.close()
    threads = {name for name, _, _ in recorded["pinned"]}
    assert threads == {"data-prefetch-rank0"}, threads  # off the training loop
    assert len(recorded["pinned"]) >= 6  # inputs and targets of every batch handed out
    # The thread's current device is the run's before its first pinned allocation.
    assert recorded["set_device"][0] == ("data-prefetch-rank0", torch.device("cuda", 1))


def test_cuda_loader_restarted_by_a_resume_still_pins(recorded):
    ld = MicroBatchLoader(_source(), 8, 4, prefetch=1, pin_device="cuda:0")
    try:
        next(ld)
        ld.load_state_dict({"consumed_samples": 8})
        # The batch itself, not a count: the restarted thread may pin ahead before any count is read
        # (a count taken after load_state_dict raced it and failed once in CI).
        x, y = next(ld)
        assert getattr(x, "came_through_pinning", False) and getattr(y, "came_through_pinning", False)
        assert len(recorded["set_device"]) == 2  # once per prefetch thread
    finally:
        ld.close()


@pytest.mark.parametrize("device", [None, "cpu"])
def test_cpu_loader_does_not_pin(recorded, device):
    ld = MicroBatchLoader(_source(), 8, 4, prefetch=2, pin_device=device)
    try:
        next(ld)
        next(ld)
    finally:
        ld.close()
    assert recorded == {"pinned": [], "set_device": []}


def test_validation_batches_pin_for_cuda(recorded):
    plain = list(validation_batches(_source(16), 4))
    pinned = list(validation_batches(_source(16), 4, pin_device="cuda"))
    assert len(plain) == len(pinned) == 4
    for (x, y), (xp, yp) in zip(plain, pinned):
        assert torch.equal(x, xp) and torch.equal(y, yp)
    assert len(recorded["pinned"]) == 8
    list(validation_batches(_source(16), 4, pin_device="cpu"))
    assert len(recorded["pinned"]) == 8
