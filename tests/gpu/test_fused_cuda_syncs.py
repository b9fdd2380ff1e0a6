"""The fused CUDA ops (csrc/fused_cuda.cu, models/llama/fused.py) on a GPU: the fused linear +
cross-entropy runs forward and backward without a host sync, checks its targets on the device, and
inside compiled code the block ops trace their references while the loss keeps its kernel. The CPU
twins are tests/csrc/test_fused_device_choice.py; numerics against the references: tests/csrc/test_fused_cuda.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from models.llama import fused
from models.llama.config import LlamaConfig
from models.llama.model import IGNORE_INDEX, lm_loss, rope_tables
from tests.csrc.test_fused_device_choice import _traced_targets  # the graph targets dynamo traced
from tests.training.runs import ROOT

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_ext():
    from csrc.loader import CUDA_EXTENSION, load_cuda_extension, unavailable_reason

    assert fused.load_ops() is not None, f"native CPU extension unavailable: {unavailable_reason()}"
    lib = load_cuda_extension()
    assert lib is not None, f"CUDA kernels unavailable: {CUDA_EXTENSION.error}"
    return lib


class _SyncsRefused:
    """torch.cuda.set_sync_debug_mode('error') for the block: any op that makes the host wait for the
    GPU (.item(), a blocking device-to-host copy, ...) raises instead."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_forward_and_backward_do_not_sync(cuda_ext, dtype):
    torch.manual_seed(0)
    dev = "cuda"
    h0, w0 = torch.randn(300, 256, device=dev).to(dtype), (torch.randn(4000, 256, device=dev) * 0.05).to(dtype)
    t = torch.randint(0, 4000, (300,), device=dev)
    t[:9] = IGNORE_INDEX
    scale = 1.0 / 8  # a micro-batch's loss scale (1 / (micro-batches x ranks)): a non-unit upstream gradient

    def run():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fused.linear_cross_entropy(h, w, t, chunk=64)
        (loss * scale).backward()
        return loss.detach(), h.grad, w.grad

    run()  # warm-up: extension load, cuBLAS handles
    with _SyncsRefused():
        loss, gh, gw = run()
        # ... and with a unit upstream gradient (loss.backward()), which used to be tested on the host
        h1, w1 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        fused.linear_cross_entropy(h1, w1, t, chunk=64).backward()
    hr, wr = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss_ref = lm_loss(F.linear(hr, wr)[None], t[None])
    (loss_ref * scale).backward()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(loss, loss_ref, **(dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32
                                                  else dict(atol=5e-3, rtol=5e-3)))
    torch.testing.assert_close(gh.float() / scale, hr.grad.float() / scale, **tol)
    torch.testing.assert_close(h1.grad.float(), gh.float() / scale, **tol)
    top = wr.grad.float().abs().max()
    torch.testing.assert_close(gw.float() / top, wr.grad.float() / top, **tol)


def test_sync_refusal_is_armed(cuda_ext):
    # The control for the test above: a value read on the host is refused in that block.
    with _SyncsRefused(), pytest.raises(RuntimeError, match="synchroniz"):
        torch.ones(2, device="cuda").sum().item()


def test_fused_loss_with_every_target_ignored_is_nan_on_cuda(cuda_ext):
    h = torch.randn(4, 8, device="cuda", requires_grad=True)
    w = torch.randn(10, 8, device="cuda", requires_grad=True)
    loss = fused.linear_cross_entropy(h, w, torch.full((4,), IGNORE_INDEX, device="cuda"))
    assert loss.isnan().item()  # 0 / 0, as F.cross_entropy returns
    loss.backward()
    assert torch.count_nonzero(h.grad).item() == 0  # every row ignored: no gradient reaches h


def test_out_of_range_target_is_a_device_side_assert():
    # In a process of its own: a device-side assert leaves the CUDA context unusable.
    code = ("import torch\n"
            "from models.llama import fused\n"
            "from csrc.loader import load_cuda_extension\n"
            "assert fused.load_ops() is not None and load_cuda_extension() is not None\n"
            "h, w = torch.randn(4, 8, device='cuda'), torch.randn(10, 8, device='cuda')\n"
            "loss = fused.linear_cross_entropy(h, w, torch.tensor([0, 1, 10, 2], device='cuda'))\n"
            "torch.cuda.synchronize()\n"
            "print('NO ERROR', loss.item())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and "NO ERROR" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "device-side assert" in proc.stderr or "out of range" in proc.stderr, proc.stderr[-2000:]


def test_compiled_code_on_cuda_traces_the_block_references_and_keeps_the_loss_kernel(cuda_ext):
    torch._dynamo.reset()
    dev = "cuda"
    x, wn = torch.randn(4, 32, device=dev), torch.rand(32, device=dev) + 0.5
    cos, sin = (t.to(dev) for t in rope_tables(LlamaConfig(dim=32, n_heads=2), 3))
    q = torch.randn(1, 3, 2, 16, device=dev)
    w = torch.randn(50, 32, device=dev)
    t = torch.randint(0, 50, (4,), device=dev)

    def region(x, wn, q, w, t):
        return (fused.rms_norm(x, wn, 1e-5), fused.swiglu(x, x), fused.apply_rope(q, cos, sin),
                fused.linear_cross_entropy(x, w, t))

    compiled = _traced_targets(region, x, wn, q, w, t)
    assert not [op for op in compiled if op.startswith("amsp_fused.") and "cross_entropy" not in op], compiled
    assert "amsp_fused.linear_cross_entropy_fwd" in compiled, compiled

    # Eagerly, the same calls reach the kernels.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        region(x, wn, q, w, t)
    for op in ("rms_norm_fwd", "swiglu_fwd", "rope_fwd", "linear_cross_entropy_fwd"):
        assert f"amsp_fused.{op}" in ops.names, ops.names
