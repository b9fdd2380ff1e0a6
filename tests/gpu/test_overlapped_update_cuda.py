"""The optimizer update on a side CUDA stream (amsp.overlap_update, amsp/overlapped_update.py): the same
numbers as the update in step(), bit for bit, on the GPU. The CPU twin (no streams, same ordering):
tests/amsp/test_overlapped_update.py. Attention runs SDPA's math kernel here, and the fused kernels are
off: the memory-efficient attention backward accumulates with atomics, which would make two engines
differ whatever the optimizer does; everything else on this path is deterministic."""
from __future__ import annotations

import pytest
import torch

from amsp.engine import AMSPEngine, EngineOptions
from amsp.plan import Degrees, Plan
from amsp.sharded_optim import AdamWSettings
from amsp.topology import Topology
from models.llama import get_preset

pytestmark = pytest.mark.gpu
SETTINGS = AdamWSettings(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
MICRO, STEPS = 2, 5


def _engine(overlap_update: bool) -> AMSPEngine:
    cfg = get_preset("debug").with_overrides(attention="sdpa", fused="off")
    deg = Degrees(1, 1, 1)
    opts = EngineOptions(precision="bf16", overlap_update=overlap_update, optim=SETTINGS)
    return AMSPEngine(cfg, Plan(deg, deg, name="test"), Topology(1, 1), 0, seed=3, device="cuda", options=opts)


def _batch(step: int, micro: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + micro)
    t = torch.randint(0, vocab, (2, 65), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def test_update_on_a_side_stream_equals_the_update_in_step():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    now, later = _engine(False), _engine(True)
    assert "side CUDA stream" in later._updates.describe()
    vocab = now.cfg.vocab_size
    with sdpa_kernel(SDPBackend.MATH):
        for step in range(STEPS):
            losses = [[e.forward_backward(*_batch(step, m, vocab), m, MICRO) for m in range(MICRO)]
                      for e in (now, later)]
            for a, b in zip(*losses):
                assert torch.equal(a, b), (step, losses)
            norms = [e.step(1e-3).grad_norm for e in (now, later)]
            assert norms[0] == norms[1], (step, norms)
            # queued on the side stream, taken by the next forward
            assert later._updates.stream is not None and later._updates.pending == len(later.units)
    for fa, fb in zip(now.named_fragments(), later.named_fragments()):
        for k in fa.STATE_KEYS:
            assert torch.equal(getattr(fa, k), getattr(fb, k)), (fa.name, k)
    for ua, ub in zip(now.units, later.units):
        assert torch.equal(ua.p_shard, ub.p_shard), ua.name
