"""Weight gradients accumulated by their own GEMM on CUDA (amsp.fuse_wgrad, amsp/wgrad_fusion.py): bf16
operands into an fp32 buffer through csrc/wgrad_gemm_cuda.cu's cuBLAS GEMM (beta 0 and 1), and an engine
trained with it against the unfused one. The CPU twin: tests/amsp/test_wgrad_fusion.py."""
from __future__ import annotations

import pytest
import torch

from amsp.engine import AMSPEngine, EngineOptions
from amsp.plan import Degrees, Plan
from amsp.sharded_optim import AdamWSettings
from amsp.topology import Topology
from amsp.wgrad_fusion import mixed_gemm_unavailable, wgrad_into
from models.llama import get_preset

pytestmark = pytest.mark.gpu


def test_bf16_operands_accumulate_into_fp32_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = mixed_gemm_unavailable(torch.device("cuda"))
    assert why is None, f"the cuBLAS weight-gradient GEMM did not build or load: {why}"
    g = torch.Generator(device="cuda").manual_seed(0)
    gy = torch.randn(4096, 1024, device="cuda", generator=g).bfloat16()
    x = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    want = gy.double().t() @ x.double()
    dest = torch.full((1024, 512), float("nan"), device="cuda")  # written over: never read
    wgrad_into(dest, gy, x, overwrite=True)
    assert torch.allclose(dest.double(), want, rtol=1e-3, atol=1e-2), (dest.double() - want).abs().max()
    wgrad_into(dest, gy, x, overwrite=False)
    assert torch.allclose(dest.double(), 2 * want, rtol=1e-3, atol=2e-2), (dest.double() - 2 * want).abs().max()
    bf16_dest = torch.zeros(1024, 512, device="cuda", dtype=torch.bfloat16)  # bf16 gradient communication
    wgrad_into(bf16_dest, gy, x, overwrite=True)
    assert torch.allclose(bf16_dest.double(), want, rtol=2e-2, atol=5e-1)
    # Operands that are views (autograd hands the backward transposed or sliced gradients)
    wide = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    wgrad_into(dest, wide[:, ::2], x, overwrite=True)
    assert torch.allclose(dest.double(), wide[:, ::2].double().t() @ x.double(), rtol=1e-3, atol=1e-2)


def _engine(fuse: bool, deg: Degrees) -> AMSPEngine:
    cfg = get_preset("debug").with_overrides(attention="sdpa")
    opts = EngineOptions(precision="bf16", fuse_wgrad=fuse, optim=AdamWSettings())
    return AMSPEngine(cfg, Plan(deg, deg, name="test"), Topology(1, 1), 0, seed=3, device="cuda", options=opts)


def test_an_engine_trains_as_the_unfused_one_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain, fused = _engine(False, Degrees(1, 1, 1)), _engine(True, Degrees(1, 1, 1))
    assert fused.fused_linears > 0
    vocab = plain.cfg.vocab_size
    for step in range(3):
        for m in range(2):
            gen = torch.Generator().manual_seed(step * 10 + m)
            t = torch.randint(0, vocab, (2, 129), generator=gen)
            losses = [e.forward_backward(t[:, :-1], t[:, 1:], m, 2).item() for e in (plain, fused)]
            assert losses[1] == pytest.approx(losses[0], rel=2e-2), (step, m, losses)
        grads = [torch.cat([u.g_shard for u in e.units]) for e in (plain, fused)]
        assert torch.isfinite(grads[1]).all()
        assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() <= 2e-2, step
        for e in (plain, fused):
            e.step(1e-3)
