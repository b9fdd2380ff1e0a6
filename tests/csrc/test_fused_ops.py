"""Fused CPU ops (csrc/fused_cpu.cpp) against their eager references."""
import pytest
import torch
import torch.nn.functional as F

from models.llama import fused
from models.llama.backends import rms_norm_reference
from models.llama.config import LlamaConfig
from models.llama.model import IGNORE_INDEX, apply_rope, lm_loss, rope_tables

# bf16 outputs may differ from eager by one rounding of the result (eager rounds intermediates).
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


def _leaf(t, dtype):
    return t.to(dtype).detach().requires_grad_()


# ---------------------------------------------------------------- gradcheck, float64, small shapes
def test_gradcheck_rms_norm(native_ext):
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.rand(16, dtype=torch.float64).add_(0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: fused.rms_norm(x, w, 1e-5), (x, w))


def test_gradcheck_rope(native_ext):
    x = torch.randn(2, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: fused.apply_rope(x, cos, sin), (x,))


def test_gradcheck_swiglu(native_ext):
    a = torch.randn(3, 37, dtype=torch.float64, requires_grad=True)  # not a multiple of the vector width
    b = torch.randn(3, 37, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fused.swiglu, (a, b))


def test_gradcheck_linear_cross_entropy(native_ext):
    h = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 6, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 12, IGNORE_INDEX, 4, 0, 12, IGNORE_INDEX])
    # chunk 3 < 7 tokens: several chunks, one of them partial
    assert torch.autograd.gradcheck(lambda h, w: fused.linear_cross_entropy(h, w, t, chunk=3), (h, w))


def test_opcheck_schemas_fake_and_autograd(native_ext):
    # torch's own consistency checks: schema mutation, fake (meta) kernels, autograd registration.
    x, w = torch.randn(4, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    torch.library.opcheck(torch.ops.amsp_fused.rms_norm_fwd.default, (x, w, 1e-5))
    cos, sin = rope_tables(LlamaConfig(dim=32, n_heads=2), 3)
    torch.library.opcheck(torch.ops.amsp_fused.rope_fwd.default, (torch.randn(1, 3, 2, 16, requires_grad=True), cos, sin))
    torch.library.opcheck(torch.ops.amsp_fused.swiglu_fwd.default,
                          (torch.randn(2, 9, requires_grad=True), torch.randn(2, 9, requires_grad=True)))


# ---------------------------------------------------------------- fp32 and bf16, LLaMA-like shapes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(native_ext, dtype):
    torch.manual_seed(0)
    x0, w0 = torch.randn(2, 64, 1024) * 3, torch.rand(1024) + 0.5
    x, w, xr, wr = _leaf(x0, dtype), _leaf(w0, dtype), _leaf(x0, dtype), _leaf(w0, dtype)
    y, yr = fused.rms_norm(x, w, 1e-6), rms_norm_reference(xr, wr, 1e-6)
    assert y.dtype == yr.dtype == dtype
    torch.testing.assert_close(y, yr, **TOL[dtype])
    g = torch.randn_like(y)
    dx, dw = _grads(y, (x, w), g)
    dxr, dwr = _grads(yr, (xr, wr), g)
    torch.testing.assert_close(dx, dxr, **TOL[dtype])
    # dw sums 128 rows: relative to its scale
    scale = dwr.abs().max().item()
    torch.testing.assert_close(dw / scale, dwr / scale, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_reference(native_ext, dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=1024, n_heads=8, max_seq_len=256)  # head_dim 128 as in LLaMA-7B
    cos, sin = rope_tables(cfg, 256)
    x0 = torch.randn(2, 200, 8, 128)
    x, xr = _leaf(x0, dtype), _leaf(x0, dtype)
    y, yr = fused.apply_rope(x, cos[:200], sin[:200]), apply_rope(xr, cos[:200], sin[:200])
    torch.testing.assert_close(y, yr, **TOL[dtype])
    g = torch.randn_like(y)
    torch.testing.assert_close(_grads(y, (x,), g)[0], _grads(yr, (xr,), g)[0], **TOL[dtype])


def test_rope_accepts_non_contiguous_input(native_ext):
    cos, sin = rope_tables(LlamaConfig(dim=64, n_heads=2), 5)
    x = torch.randn(2, 2, 5, 32).transpose(1, 2)  # (B, S, H, D) view with permuted strides
    torch.testing.assert_close(fused.apply_rope(x, cos, sin), apply_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference(native_ext, dtype):
    torch.manual_seed(0)
    a0, b0 = torch.randn(2, 64, 2816) * 4, torch.randn(2, 64, 2816)
    a, b, ar, br = _leaf(a0, dtype), _leaf(b0, dtype), _leaf(a0, dtype), _leaf(b0, dtype)
    y, yr = fused.swiglu(a, b), F.silu(ar) * br
    torch.testing.assert_close(y, yr, **TOL[dtype])
    g = torch.randn_like(y)
    for got, want in zip(_grads(y, (a, b), g), _grads(yr, (ar, br), g)):
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_matches_reference(native_ext, dtype):
    torch.manual_seed(0)
    # bf16 is 32 tokens: the eager reference's bf16 grad_h GEMM (reduction over the vocabulary) is
    # very slow on CPU.
    tokens = 96 if dtype == torch.float32 else 16
    h0, w0 = torch.randn(2, tokens, 256), torch.randn(32000, 256) * 0.05
    t = torch.randint(0, 32000, (2, tokens))
    t[0, :10] = IGNORE_INDEX
    h, w, hr, wr = _leaf(h0, dtype), _leaf(w0, dtype), _leaf(h0, dtype), _leaf(w0, dtype)
    loss = fused.linear_cross_entropy(h, w, t, IGNORE_INDEX, chunk=13)
    loss_ref = lm_loss(F.linear(hr, wr), t)
    assert loss.dtype == loss_ref.dtype == torch.float32
    # bf16: the reference rounds its logits to bf16, the fused op keeps them in fp32
    torch.testing.assert_close(loss, loss_ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
                                                   else dict(atol=5e-3, rtol=5e-3)))
    (loss * 3).backward()
    (loss_ref * 3).backward()  # a non-unit upstream gradient scales the precomputed grads
    torch.testing.assert_close(h.grad, hr.grad, **TOL[dtype])
    scale = wr.grad.abs().max().item()
    torch.testing.assert_close(w.grad / scale, wr.grad / scale, **TOL[dtype])
    assert h.grad.dtype == w.grad.dtype == dtype


def test_linear_cross_entropy_edge_cases(native_ext):
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    all_ignored = torch.full((4,), IGNORE_INDEX)
    assert fused.linear_cross_entropy(h, w, all_ignored).isnan()  # as F.cross_entropy: 0 / 0
    assert lm_loss(F.linear(h, w)[None], all_ignored[None]).isnan()
    with pytest.raises(RuntimeError, match="out of range"):
        fused.linear_cross_entropy(h, w, torch.tensor([0, 1, 10, 2]))
    with torch.no_grad():  # no gradient work without autograd; the value is unchanged
        t = torch.tensor([0, 1, 9, 2])
        torch.testing.assert_close(fused.linear_cross_entropy(h, w, t), lm_loss(F.linear(h, w)[None], t[None]))


def test_linear_cross_entropy_backward_allocates_no_vocab_sized_tensor(native_ext):
    """The forward already holds both gradients; the backward hands them over. Autograd used to
    materialise a zero gradient for the op's grad_w output (a vocab x dim tensor) at the backward, the
    peak of a pp 1 training step's backward."""
    from torch.profiler import ProfilerActivity, profile

    v, d = 4096, 256
    w = torch.nn.Parameter(torch.randn(v, d) * 0.02)
    h = torch.randn(64, d, requires_grad=True)
    loss = fused.linear_cross_entropy(h, w, torch.randint(0, v, (64,)))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (loss / 4).backward()
    big = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage >= v * d * 4]
    assert not big, big
    assert w.grad.shape == (v, d) and h.grad.shape == h.shape


def test_ops_take_weights_at_call_time(native_ext):
    # A weight that is a view into a flat buffer (as the data-parallel engine lays them out) works,
    # and replacing the buffer's contents changes the result: nothing is cached.
    flat = torch.rand(48, requires_grad=False)
    w = flat[16:32]
    x = torch.randn(3, 16)
    y1 = fused.rms_norm(x, w, 1e-5)
    flat.mul_(2)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), 2 * y1)


def test_accumulate_grad_op_on_cpu(native_ext):
    """The gradient accumulation op's CPU kernel (the schema's reference; amsp/grad_accumulate.py itself
    uses torch's ops on CPU): acc = grad or acc += grad in place, any gradient shape of as many elements,
    one-line refusals for a wrong accumulator or size. The CUDA kernel: tests/csrc/test_fused_cuda.py."""
    acc = torch.arange(6, dtype=torch.float32)
    g = torch.full((2, 3), 0.5, dtype=torch.bfloat16)
    torch.ops.amsp_fused.accumulate_grad(acc, g, False)
    assert torch.equal(acc, torch.arange(6, dtype=torch.float32) + 0.5)
    torch.ops.amsp_fused.accumulate_grad(acc, g, True)
    assert torch.equal(acc, torch.full((6,), 0.5))
    torch.library.opcheck(torch.ops.amsp_fused.accumulate_grad.default, (torch.zeros(6), g, False),
                          test_utils=("test_schema",))
    with pytest.raises(RuntimeError, match="contiguous 1-D float32"):
        torch.ops.amsp_fused.accumulate_grad(torch.zeros(6, dtype=torch.bfloat16), g, False)
    with pytest.raises(RuntimeError, match="5 gradient elements for an accumulator of 6"):
        torch.ops.amsp_fused.accumulate_grad(torch.zeros(6), torch.ones(5), False)
