"""CUDA kernels (csrc/fused_cuda.cu) against the same eager references; run only where CUDA exists."""
import pytest
import torch
import torch.nn.functional as F

from models.llama import fused
from models.llama.backends import rms_norm_reference
from models.llama.config import LlamaConfig
from models.llama.model import IGNORE_INDEX, apply_rope, lm_loss, rope_tables

pytestmark = pytest.mark.gpu
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def cuda_ext(native_ext):
    from csrc.loader import CUDA_EXTENSION, load_cuda_extension

    lib = load_cuda_extension()
    assert lib is not None, f"CUDA kernels unavailable: {CUDA_EXTENSION.error}"
    return lib


def _check(fn, ref, inputs, dtype):
    a = [t.detach().clone().requires_grad_() for t in inputs]
    b = [t.detach().clone().requires_grad_() for t in inputs]
    y, yr = fn(*a), ref(*b)
    torch.testing.assert_close(y.float(), yr.float(), **TOL[dtype])
    g = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, a, g), torch.autograd.grad(yr, b, g)):
        scale = max(want.abs().max().item(), 1.0)
        torch.testing.assert_close(got.float() / scale, want.float() / scale, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ops_match_reference(cuda_ext, dtype):
    dev = "cuda"
    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev).to(dtype)  # noqa: E731
    _check(lambda x, w: fused.rms_norm(x, w, 1e-5), lambda x, w: rms_norm_reference(x, w, 1e-5),
           [mk(256, 1024), mk(1024).abs() + 0.5], dtype)
    cos, sin = (t.to(dev) for t in rope_tables(LlamaConfig(dim=1024, n_heads=8), 128))
    _check(lambda x: fused.apply_rope(x, cos, sin), lambda x: apply_rope(x, cos, sin), [mk(2, 128, 8, 128)], dtype)
    _check(fused.swiglu, lambda a, b: F.silu(a) * b, [mk(256, 2816), mk(256, 2816)], dtype)
    h, w = mk(300, 256), mk(32000, 256) * 0.05
    t = torch.randint(0, 32000, (300,), device=dev)
    t[:7] = IGNORE_INDEX
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, loss_ref = fused.linear_cross_entropy(hf, wf, t, chunk=64), lm_loss(F.linear(hr, wr)[None], t[None])
    torch.testing.assert_close(loss, loss_ref, atol=1e-4, rtol=1e-4)
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(hf.grad.float(), hr.grad.float(), **TOL[dtype])


def test_cuda_gradcheck(cuda_ext):
    d = dict(device="cuda", dtype=torch.float64)
    x, w = torch.randn(4, 16, **d, requires_grad=True), (torch.rand(16, **d) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: fused.rms_norm(x, w, 1e-5), (x, w))
    a, b = torch.randn(3, 33, **d, requires_grad=True), torch.randn(3, 33, **d, requires_grad=True)
    assert torch.autograd.gradcheck(fused.swiglu, (a, b))
    q, cos, sin = torch.randn(1, 3, 2, 8, **d, requires_grad=True), torch.randn(3, 4, **d), torch.randn(3, 4, **d)
    assert torch.autograd.gradcheck(lambda q: fused.apply_rope(q, cos, sin), (q,))
    h, w2 = torch.randn(6, 5, **d, requires_grad=True), torch.randn(11, 5, **d, requires_grad=True)
    t = torch.tensor([1, 2, IGNORE_INDEX, 4, 10, 0], device="cuda")
    assert torch.autograd.gradcheck(lambda h, w2: fused.linear_cross_entropy(h, w2, t, chunk=4), (h, w2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_accumulate_grad_cuda_equals_torch_bit_for_bit(cuda_ext, dtype):
    """The vectorised gradient accumulation (amsp/grad_accumulate.py) against torch's copy_/add_ on the
    same device: one fp32 addition per element either way, so equal to the bit; sizes around the
    4-element vector width, and slices whose pointers break the vector alignment (the scalar path)."""
    torch.manual_seed(0)
    for n in (0, 1, 3, 4, 7, 1029, (1 << 20) + 3):
        for acc_off, grad_off in ((0, 0), (1, 0), (0, 1), (2, 3)):
            base = torch.randn(n + acc_off, device="cuda")
            grads = torch.randn(n + grad_off, device="cuda").to(dtype)
            g = grads[grad_off:]
            for overwrite in (True, False):
                got, want = base.clone()[acc_off:], base.clone()[acc_off:]
                torch.ops.amsp_fused.accumulate_grad(got, g, overwrite)
                want.copy_(g) if overwrite else want.add_(g)
                assert torch.equal(got, want), (n, acc_off, grad_off, overwrite)
    acc = torch.zeros(6, device="cuda")
    torch.ops.amsp_fused.accumulate_grad(acc, torch.ones(2, 3, device="cuda", dtype=dtype), False)  # any shape
    assert torch.equal(acc, torch.ones(6, device="cuda"))


def test_rms_norm_weight_gradient_across_row_chunks(cuda_ext):
    """The weight gradient is summed over row chunks of 32 (csrc/fused_cuda.cu): rows that are not a
    multiple of the chunk, a dim that is not a multiple of the block, against RMSNorm in fp64 throughout
    (rms_norm_reference normalises in fp32, as Meta's does: 1e-6 off in fp64 on the first GPU run)."""
    torch.manual_seed(0)
    x = torch.randn(1000, 300, device="cuda", dtype=torch.float64, requires_grad=True)
    w = (torch.rand(300, device="cuda", dtype=torch.float64) + 0.5).requires_grad_()
    dy = torch.randn(1000, 300, device="cuda", dtype=torch.float64)
    got = torch.autograd.grad(fused.rms_norm(x, w, 1e-5), (x, w), dy)
    fp64 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    want = torch.autograd.grad(fp64, (x, w), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values, contiguous, 2 bytes past a 16-byte boundary: the kernels' scalar path."""
    buf = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vector_and_scalar_paths_give_the_same_values(cuda_ext, dtype):
    """RMSNorm, rope and SwiGLU take 16-byte accesses where pointers and sizes allow, the scalar kernels
    elsewhere (csrc/fused_cuda.cu): forward and backward on aligned inputs against the same inputs moved
    off alignment, at a LLaMA-2 block's row width and head size, plus a SwiGLU size with a scalar tail."""
    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda").to(dtype)  # noqa: E731
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)

    def both(fn, inputs):
        out = []
        for prep in (lambda t: t, _misaligned):
            args = [prep(t.detach().clone()).requires_grad_() for t in inputs]
            y = fn(*args)
            g = torch.ones_like(y) * 0.5 + torch.arange(y.numel(), device="cuda").view(y.shape).remainder(7)
            out.append((y, *torch.autograd.grad(y, args, g.to(y.dtype))))
        for a, b in zip(*out):
            torch.testing.assert_close(a.float(), b.float(), **close)

    both(lambda x, w: fused.rms_norm(x, w, 1e-5), [mk(64, 4096), mk(4096).abs() + 0.5])
    cos, sin = (t.to("cuda") for t in rope_tables(LlamaConfig(dim=4096, n_heads=32), 64))
    both(lambda x: fused.apply_rope(x, cos, sin), [mk(2, 64, 32, 128)])
    both(fused.swiglu, [mk(64, 11008), mk(64, 11008)])
    both(fused.swiglu, [mk(3, 37), mk(3, 37)])  # 111 elements: vectors and a scalar tail
