"""Weight gradients accumulated by their own GEMM (amsp.fuse_wgrad, amsp/wgrad_fusion.py) on CPU: the GEMM's
arithmetic, one engine against the unfused one, and the configuration rules. The 4-rank plans (g > 1
buffers, recomputation, bf16) are cases of tests/amsp/test_amsp_engine.py; the CUDA GEMM (bf16 inputs
into fp32) is tests/gpu/test_wgrad_fusion_cuda.py."""
from __future__ import annotations

import pytest
import torch

import amsp_cases as C
from amsp.engine import AMSPEngine, EngineOptions
from amsp.plan import Degrees, Plan
from amsp.topology import Topology
from amsp.wgrad_fusion import mixed_gemm_unavailable, wgrad_into


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(96, 24, generator=g).to(dtype), torch.randn(96, 40, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_writes_over_then_adds_in_fp32(dtype):
    """fp32: addmm_ into the buffer; bf16 operands: the native op amsp_fused::wgrad_accumulate (its CPU
    version here, the same contract as the cuBLAS one)."""
    assert mixed_gemm_unavailable(torch.device("cpu")) is None  # the CPU extension builds wherever the suite runs
    gy, x = _operands(dtype)
    want = gy.double().t() @ x.double()  # bf16 inputs multiplied exactly, summed in high precision
    dest = torch.full((24, 40), float("nan"))  # written over: the old values are never read
    wgrad_into(dest, gy, x, overwrite=True)
    assert torch.allclose(dest.double(), want, rtol=1e-5, atol=1e-5)
    wgrad_into(dest, gy, x, overwrite=False)
    assert torch.allclose(dest.double(), 2 * want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="do not give acc"):
        torch.ops.amsp_fused.wgrad_accumulate(x, gy, torch.zeros(40, 24), True)


def _engine(precision: str, fuse: bool) -> AMSPEngine:
    deg = Degrees(1, 1, 1)
    opts = EngineOptions(precision=precision, fuse_wgrad=fuse, optim=C.SETTINGS)
    return AMSPEngine(C.model_cfg(), Plan(deg, deg, name="test"), Topology(1, 1), 0, seed=C.SEED, options=opts)


def test_one_engine_trains_as_the_unfused_one():
    """fp32: the same gradients (the GEMM's accumulation against the hook's add) through 4 steps of 2
    micro-batches, every block linear fused, no parameter keeping a gradient. bf16: the fused path keeps
    each micro-batch's weight gradient in fp32 where the hook path rounds it to bf16 first, so they agree
    to bf16's precision, not bit for bit."""
    for precision, tol in (("fp32", 1e-6), ("bf16", 2e-2)):
        plain, fused = _engine(precision, False), _engine(precision, True)
        assert fused.fused_linears == 2 * 7 + 1  # two blocks' seven projections and the head's
        for step in range(4):
            for m in range(C.MICRO):
                losses = [e.forward_backward(*C.micro_batch(step, m, 0), m, C.MICRO).item() for e in (plain, fused)]
                assert losses[1] == pytest.approx(losses[0], rel=tol), (precision, step, m)
            grads = [torch.cat([u.g_shard for u in e.units]) for e in (plain, fused)]
            assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() <= tol, (precision, step)
            for e in (plain, fused):
                e.step(C.SCHEDULE(step))
            assert all(u.param(s).grad is None for u in fused.units for s in u.slots)


def test_the_configuration_rules():
    from configs.validate import _cross_field_problems, _parallel_problems
    from amsp.planner.__main__ import compose_config

    cfg = compose_config(["amsp.fuse_wgrad=true", "model.compile=on"])
    assert any("amsp.fuse_wgrad=true is not allowed with model.compile=on" in p for p in _cross_field_problems(cfg))
    cfg = compose_config(["amsp.fuse_wgrad=true", "parallel.tp=2"])
    assert any("amsp.fuse_wgrad=true is not allowed with parallel.tp=2" in p for p in _parallel_problems(cfg))
    assert not _cross_field_problems(compose_config(["amsp.fuse_wgrad=true"]))
