"""The one-pass AdamW kernel on CUDA (amsp_fused::adamw_update, csrc/fused_cuda.cu; amsp.optimizer_kernel=csrc)
against torch's fused AdamW on the GPU: the 16-byte vector path and the scalar one (an odd, misaligned run),
the bf16 weights written in the same pass, the gradient left as it was, the clip scale read on the device.
The CPU twin: tests/amsp/test_sharded_optim.py."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,offset", [(1 << 20, 0), (100_003, 1)])
def test_adamw_update_matches_torch_fused_adamw_on_the_gpu(n, offset):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from amsp.sharded_optim import native_adamw_unavailable

    why = native_adamw_unavailable(torch.device("cuda"))
    assert why is None, f"csrc's CUDA kernels did not build or load: {why}"
    g = torch.Generator(device="cuda").manual_seed(n)
    master, grad, avg = (torch.randn(n + offset, device="cuda", generator=g)[offset:] for _ in range(3))
    sq = torch.rand(n, device="cuda", generator=g) * 1e-2
    scale, step, lr, b1, b2, eps = torch.tensor(1.7, device="cuda"), 7, 3e-4, 0.9, 0.95, 1e-8
    ref = [t.clone() for t in (master, grad, avg, sq)]
    torch._fused_adamw_([ref[0]], [ref[1]], [ref[2]], [ref[3]], [], [torch.tensor(float(step), device="cuda")],
                        lr=lr, beta1=b1, beta2=b2, weight_decay=0.1, eps=eps, amsgrad=False, maximize=False,
                        grad_scale=scale, found_inf=None)
    grad_before = grad.clone()
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    torch.ops.amsp_fused.adamw_update(master, grad, avg, sq, out, scale, lr, 0.1, b1, b2, eps,
                                      lr / (1 - b1 ** step), math.sqrt(1 - b2 ** step))
    torch.testing.assert_close(master, ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(avg, ref[2], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(sq, ref[3], rtol=1e-5, atol=1e-9)
    assert torch.equal(out, master.bfloat16()) and torch.equal(grad, grad_before)
    none = torch.empty(0, device="cuda")  # no weights to write; no clip scale
    torch.ops.amsp_fused.adamw_update(master, grad, avg, sq, none, None, lr, 0.0, b1, b2, eps, lr, 1.0)
    assert torch.isfinite(master).all()
