"""A gradient leaving autograd into its fp32 accumulator (a unit's G shard, amsp/flat_unit.py).

With g = 1 every parameter's gradient (compute dtype) is added into the fp32 G shard in its own
hook, every micro-batch: 1.88B elements four times a step at the GPU-path issue's shape. torch's
add_ of a bf16 tensor into an fp32 one runs its unvectorised mixed-dtype kernel (69 ms of a 446 ms
compiled step on an H100, profiled), so on CUDA it goes through csrc/fused_cuda.cu's accumulate_grad:
one vectorised pass. And the step's first micro-batch writes (acc = grad) instead of adding into a
zeroed buffer, which saves the zeroing pass and a read. On CPU (and without the CUDA kernels) it is
torch's copy_/add_, whose results the kernel matches exactly (one fp32 addition per element).
"""
from __future__ import annotations

import torch

_NATIVE: list[bool] = []  # resolved on the first CUDA unit


def native_available(device: torch.device) -> bool:
    """Whether csrc's CUDA accumulate_grad serves tensors on `device` (CUDA with the kernels built)."""
    if torch.device(device).type != "cuda":
        return False
    if not _NATIVE:
        from csrc.loader import load_cuda_extension

        _NATIVE.append(load_cuda_extension() is not None)
    return _NATIVE[0]


def describe(device: torch.device) -> str:
    """The choice in words, for the engine's startup log."""
    if native_available(device):
        return "csrc/fused_cuda.cu accumulate_grad (vectorised; the first micro-batch writes, no zeroing)"
    if torch.device(device).type == "cuda":
        return "torch copy_/add_ (the CUDA kernels are not built: see the csrc log line)"
    return "torch copy_/add_ (the first micro-batch writes, no zeroing)"


def accumulate(acc: torch.Tensor, grad: torch.Tensor, overwrite: bool, native: bool) -> None:
    """acc = grad (overwrite) or acc += grad; acc is a contiguous 1-D fp32 view, grad any shape of as many
    elements. `native`: native_available(acc.device), looked up once by the caller."""
    if native:
        torch.ops.amsp_fused.accumulate_grad(acc, grad, overwrite)
    elif overwrite:
        acc.copy_(grad.reshape(-1))
    else:
        acc.add_(grad.reshape(-1))
