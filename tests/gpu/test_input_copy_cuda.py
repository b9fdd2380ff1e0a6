"""On a GPU, a micro-batch from the loader arrives page-locked and its copy to the device does not make the
host wait (data/loader.py pin_device, amsp/engine.py to_device). The CPU twins: tests/data/test_loader_pinning.py
and tests/amsp/test_input_copy.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from amsp.engine import to_device
from data.loader import MicroBatchLoader, validation_batches

pytestmark = pytest.mark.gpu
SEQ = 64


def _source(n=64):
    return [np.arange(i, i + SEQ + 1, dtype=np.int64) for i in range(n)]


def test_loader_batches_arrive_pinned_and_copy_without_a_sync():
    dev = torch.device("cuda", torch.cuda.current_device())
    ld = MicroBatchLoader(_source(), 16, 4, prefetch=2, pin_device=dev)
    try:
        batches = [next(ld) for _ in range(4)]
    finally:
        ld.close()
    for x, y in batches:
        assert x.is_pinned() and y.is_pinned() and x.is_contiguous() and y.is_contiguous()
    vx, vy = next(iter(validation_batches(_source(16), 4, pin_device=dev)))
    assert vx.is_pinned() and vy.is_pinned()
    pageable = torch.from_numpy(batches[0][0].numpy().copy())
    assert not pageable.is_pinned()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host wait on the GPU raises
    try:
        on_device = [(to_device(x, dev), to_device(y, dev)) for x, y in batches]
        # The control: the blocking copy the engine used to make is refused here.
        with pytest.raises(RuntimeError, match="synchroniz"):
            pageable.to(dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (x, y), (xd, yd) in zip(batches, on_device):
        assert xd.device == dev and torch.equal(xd.cpu(), x) and torch.equal(yd.cpu(), y)
