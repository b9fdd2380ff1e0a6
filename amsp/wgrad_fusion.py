"""Weight gradients accumulated by their own GEMM into the unit's gradient buffer (amsp.fuse_wgrad).

Without it a linear layer's weight gradient leaves autograd as a tensor of its own in the compute
dtype (the GEMM writes it), and the engine's hook reads it back to add it into the unit's fp32 G shard
or copy it into the reduce-scatter buffer (amsp/grad_accumulate.py): on an H200 at the GPU-path
issue's shape that pass was 21 ms of a 360 ms step (BENCHMARKS.md, profile.txt). With it, every
linear layer the engine holds runs through LinearIntoGradBuffer, whose backward has the GEMM do the
accumulation (C = gy^T x + beta C with C the fp32 buffer slice; the GEMM is compute-bound, so reading
and writing C in its epilogue costs little), as Megatron-LM's gradient_accumulation_fusion does.
Autograd still receives a weight gradient, an uninitialised tensor (an allocation, no memory traffic),
so the engine's per-parameter hooks fire in the usual order and count the unit's gradients; the hook
finds the slot already taken and only drops it (FlatUnit.take_grad).

The GEMM: with weights in the buffer's dtype (fp32 runs, bf16 gradient communication) addmm_ into the
slice; bf16 weights into an fp32 buffer through amsp_fused::wgrad_accumulate, on CUDA one cuBLAS GEMM with
bf16 operands and an fp32 output read and written in place (csrc/wgrad_gemm_cuda.cu; torch's addmm with
out_dtype cannot add into an fp32 buffer), on CPU the product widened to fp32, then added (the same
values without the saving, so CPU tests cover the plumbing). Each micro-batch's product is kept in fp32,
where the unfused path rounds it to bf16 before adding it.
Not for tensor-parallel (DTensor) weights, nor inside compiled blocks: dynamo cannot trace the
engine's call in the backward (configs/validate.py and amsp/build.py refuse or skip those). Where the
mixed-dtype GEMM cannot be built (a CUDA toolkit without cuBLAS's headers), the engine says so and keeps
the hooks' accumulation (fusing).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

COMPILE_OFF_WITH_FUSION = "off with amsp.fuse_wgrad (its backward calls the engine, which dynamo cannot trace)"
# sink(gy, x): the weight gradient gy^T @ x of one linear layer, gy (tokens, out), x (tokens, in)
Sink = Callable[[torch.Tensor, torch.Tensor], None]


def mixed_gemm_unavailable(device: torch.device) -> str | None:
    """None when amsp_fused::wgrad_accumulate serves `device` (CUDA: the cuBLAS library built and loaded;
    CPU: the native CPU extension), else why not."""
    from csrc.loader import WGRAD_EXTENSION, ops_unavailable

    return ops_unavailable(device, WGRAD_EXTENSION)


def fusing(requested: bool, compute_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the engine routes its linear layers here: requested, and (for operands narrower than the
    fp32 buffers) the mixed-dtype GEMM available, else a warning and the hooks' accumulation."""
    if not requested or compute_dtype == torch.float32:
        return requested
    why = mixed_gemm_unavailable(device)
    if why is not None:
        log.warning("amsp.fuse_wgrad: the mixed-dtype weight-gradient GEMM is unavailable on %s (%s); weight "
                    "gradients are accumulated by the parameter hooks instead", device, why)
    return why is None


def wgrad_into(dest: torch.Tensor, gy: torch.Tensor, x: torch.Tensor, overwrite: bool) -> None:
    """dest (out x in) = gy^T @ x, plus dest's old values unless `overwrite` (then they are never read:
    an uninitialised buffer may hold NaNs)."""
    if gy.dtype == dest.dtype:
        dest.addmm_(gy.t(), x, beta=0.0 if overwrite else 1.0)
    else:  # the engine routes layers here only where the op serves (fusing)
        torch.ops.amsp_fused.wgrad_accumulate(x, gy, dest, overwrite)


class LinearIntoGradBuffer(torch.autograd.Function):
    """F.linear(x, weight) (no bias) whose weight gradient goes to `sink` instead of autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, sink: Sink) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # what F.linear's own backward keeps
        ctx.sink = sink
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight = ctx.saved_tensors
        gx = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            ctx.sink(gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1]))
            # The engine's post-accumulate hook still fires on this parameter (and drops this tensor).
            gw = torch.empty_like(weight)
        return gx, gw, None


def fusable(module: nn.Module, attr: str) -> bool:
    """Whether this parameter slot is a bias-free nn.Linear's weight (what LinearIntoGradBuffer computes)."""
    return isinstance(module, nn.Linear) and attr == "weight" and module.bias is None


def install(linear: nn.Linear, sink: Sink) -> None:
    """Route the layer's forward through LinearIntoGradBuffer. The weight is looked up at each call: the
    engine installs its parameters after building the model and may reinstall them."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return LinearIntoGradBuffer.apply(x, linear.weight, sink)

    linear.forward = forward
