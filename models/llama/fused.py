"""Fused CPU ops for the model (csrc/fused_cpu.cpp), selected by `model.fused=auto|on|off`.

Thin wrapper: the kernels are torch custom ops (`torch.ops.amsp_fused.*`) defined in C++; their
autograd formulas and fake (shape) implementations are registered here, next to the references
they replace (models/llama/backends.py rms_norm_reference, model.py apply_rope and lm_loss,
F.silu(a) * b). Every op takes its weight as a call argument and caches nothing, so a weight
replaced by a view of a flat sharded buffer keeps working.
"""
from __future__ import annotations

import logging
import threading

import torch

from .fused_ops import ALL_OPS, AUTO_OPS, CHUNK_LOGITS, CUDA_COMPILED_REFERENCE_OPS

log = logging.getLogger(__name__)

_registered = False
_lock = threading.Lock()
_logged: set[str] = set()


def _log_once(msg: str, *args) -> None:
    # Logging inside a torch.compile'd region is a graph break (an error under fullgraph): compiled
    # callers announce their per-device choice eagerly instead (announce_device).
    if torch.compiler.is_compiling():
        return
    text = msg % args if args else msg
    if text not in _logged:
        _logged.add(text)
        log.info(text)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _register() -> None:
    """Autograd and fake implementations for the C++ ops (once per process)."""
    lib = "amsp_fused"

    @torch.library.register_fake(f"{lib}::rms_norm_fwd")
    def _(x, weight, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape[0], dtype=_opmath(x.dtype))

    @torch.library.register_fake(f"{lib}::rms_norm_bwd")
    def _(dy, x, weight, rstd):
        return x.new_empty(x.shape), weight.new_empty(weight.shape)

    def rms_setup(ctx, inputs, output):
        x, weight, _eps = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, weight, output[1])

    def rms_backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.amsp_fused.rms_norm_bwd(dy, x, weight, rstd)
        return dx, dw, None

    torch.library.register_autograd(f"{lib}::rms_norm_fwd", rms_backward, setup_context=rms_setup)

    for name in ("rope_fwd", "rope_bwd"):
        torch.library.register_fake(f"{lib}::{name}")(lambda x, cos, sin: x.new_empty(x.shape))

    def rope_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])

    def rope_backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return torch.ops.amsp_fused.rope_bwd(dy, cos, sin), None, None

    torch.library.register_autograd(f"{lib}::rope_fwd", rope_backward, setup_context=rope_setup)

    @torch.library.register_fake(f"{lib}::swiglu_fwd")
    def _(a, b):
        return a.new_empty(a.shape)

    @torch.library.register_fake(f"{lib}::swiglu_bwd")
    def _(dy, a, b):
        return a.new_empty(a.shape), b.new_empty(b.shape)

    def swiglu_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def swiglu_backward(ctx, dy):
        a, b = ctx.saved_tensors
        return torch.ops.amsp_fused.swiglu_bwd(dy, a, b)

    torch.library.register_autograd(f"{lib}::swiglu_fwd", swiglu_backward, setup_context=swiglu_setup)

    @torch.library.register_fake(f"{lib}::linear_cross_entropy_fwd")
    def _(h, weight, targets, ignore_index, chunk, compute_grad):
        loss = h.new_empty((), dtype=_opmath(h.dtype))
        if compute_grad:
            return loss, h.new_empty(h.shape), weight.new_empty(weight.shape)
        return loss, h.new_empty(0), h.new_empty(0)

    def ce_setup(ctx, inputs, output):
        # The forward already produced d(loss)/d(h) and d(loss)/d(W) for a unit upstream gradient.
        _loss, grad_h, grad_w = output
        ctx.mark_non_differentiable(grad_h, grad_w)
        ctx.save_for_backward(grad_h, grad_w)
        # The two gradient outputs never receive a gradient: without this, autograd materialised a zero
        # gradient for each at the backward, a vocab x dim fp32 tensor for grad_w (94 MiB at dim 768,
        # V 32000; the peak of a pp 1 run's backward).
        ctx.set_materialize_grads(False)

    def ce_backward(ctx, dloss, _dgh, _dgw):
        # No copies: a scaled copy of grad_w (vocab x dim) next to the saved one would double the
        # head's gradient memory, which is what this op exists to save. The upstream gradient is applied
        # in place, always: first asking whether it is 1 (and skipping the multiply) read a device value
        # on the host, a sync per micro-batch on CUDA; multiplying by 1 changes no value.
        if dloss is None:  # no gradient reached the loss (grads are not materialised: ce_setup)
            return None, None, None, None, None, None
        grad_h, grad_w = ctx.saved_tensors
        if grad_h.numel() == 0:
            raise RuntimeError("amsp_fused::linear_cross_entropy_fwd was called with compute_grad=False "
                               "but a backward was requested")
        unit_so_far = getattr(ctx, "unit_so_far", None)
        # Only a second backward through a retained graph (gradcheck, retain_graph=True) reads this on
        # the host: the saved gradients still hold the unit-upstream values only if every earlier scale
        # was 1.
        if unit_so_far is not None and not bool(unit_so_far):
            raise RuntimeError("fused linear_cross_entropy: a second backward through the same graph after one "
                               "with a non-unit upstream gradient is not supported; use model.fused=off for that")
        ctx.unit_so_far = dloss == 1  # a device tensor: nothing waits for it here
        # Through .data: scaling by 1 must not bump the saved tensors' version counter, or a retained
        # graph's second backward (checked above instead) would refuse them as modified in place.
        grad_h.data.mul_(dloss)
        grad_w.data.mul_(dloss)
        return grad_h, grad_w, None, None, None, None

    torch.library.register_autograd(f"{lib}::linear_cross_entropy_fwd", ce_backward, setup_context=ce_setup)

    # FLOP accounting (MFU, FlopCounterMode): the op's matmuls run inside C++ and are not seen one
    # by one. The forward also does the two backward products when it computes the gradients.
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.amsp_fused.linear_cross_entropy_fwd)
    def _(h_shape, w_shape, targets_shape, ignore_index, chunk, compute_grad, *args, out_shape=None, **kwargs):
        (n, d), (v, _) = h_shape, w_shape
        return 2 * n * d * v * (3 if compute_grad else 1)


def load_ops() -> str | None:
    """Build/load the extension and register the ops' autograd; None (after one warning) if unavailable."""
    global _registered
    from csrc.loader import load_extension

    lib = load_extension()
    if lib is None:
        return None
    with _lock:
        if not _registered:
            _register()
            _registered = True
    if torch.cuda.is_available():
        from csrc.loader import load_cuda_extension

        load_cuda_extension()  # adds CUDA kernels to the same ops where nvcc and CUDA torch exist
    return lib


def resolve_fused(requested: str) -> frozenset[str]:
    """The set of fused ops a model uses for `model.fused=requested`; logged once per choice."""
    if requested == "off":
        _log_once("fused ops: none (model.fused=off)")
        return frozenset()
    if requested not in ("auto", "on"):
        raise ValueError(f"model.fused={requested!r} is not one of auto|on|off")
    from csrc.loader import unavailable_reason

    if load_ops() is None:
        if requested == "on":
            raise RuntimeError(f"model.fused=on needs the native CPU extension, which is unavailable: "
                               f"{unavailable_reason()}; use model.fused=off")
        _log_once("fused ops: none (model.fused=auto: native extension unavailable: %s)", unavailable_reason())
        return frozenset()
    if requested == "on":
        _log_once("fused ops: %s (model.fused=on)", ", ".join(ALL_OPS))
        return frozenset(ALL_OPS)
    chosen = frozenset(AUTO_OPS)
    skipped = [op for op in ALL_OPS if op not in chosen]
    _log_once("fused ops: %s (model.fused=auto, per BENCHMARKS.md); eager: %s",
              ", ".join(op for op in ALL_OPS if op in chosen) or "none", ", ".join(skipped) or "none")
    return chosen


def ops_running(requested: str, device: torch.device | str) -> frozenset[str]:
    """The fused ops a model built with `model.fused=requested` runs natively on `device` in eager code
    (elsewhere the eager references run): the planner prices what autograd keeps for the kernels that run
    (the fused linear + cross-entropy keeps d/dW where the eager head keeps logits; the fused RMSNorm and
    SwiGLU keep fewer tensors than their references). Inside compiled blocks on CUDA the ops in
    CUDA_COMPILED_REFERENCE_OPS trace their references instead (kernel_runs), which the planner prices as
    the kernels (Kernels.compiled: a compiled block keeps what the kernels keep)."""
    chosen = resolve_fused(requested)
    return frozenset(op for op in chosen if kernel_runs(op, torch.device(device).type, compiling=False))


def kernel_runs(op: str, device_type: str, compiling: bool) -> bool:
    """Whether a fused op the model chose calls its native kernel for tensors on `device_type` ("meta"
    counts as CPU), `compiling` inside a region torch.compile traces; otherwise its eager reference runs.
    CPU: always (once the extension is loaded). CUDA: where csrc/fused_cuda.cu was built, except the ops
    of CUDA_COMPILED_REFERENCE_OPS inside compiled code (models/llama/fused_ops.py says why)."""
    if device_type in ("cpu", "meta"):
        return True
    if device_type == "cuda":
        if compiling and op in CUDA_COMPILED_REFERENCE_OPS:
            return False
        from csrc.loader import CUDA_EXTENSION

        return CUDA_EXTENSION.lib is not None
    return False


def announce_device(device: torch.device | str) -> None:
    """Log now, outside any compiled region, whether fused ops on `device` get native kernels (the
    per-call check below cannot log from inside a compiled block)."""
    kind = torch.device(device).type
    if kind == "cuda":
        from csrc.loader import CUDA_EXTENSION

        if CUDA_EXTENSION.lib is None:
            _log_once("fused ops on cuda: no kernel in this build; the eager references run instead")
        else:
            _log_once("fused ops on cuda: native kernels (csrc/fused_cuda.cu) in eager code; inside compiled "
                      "blocks %s trace their eager references for inductor to fuse (models/llama/fused_ops.py)",
                      ", ".join(CUDA_COMPILED_REFERENCE_OPS))
    elif kind != "cpu":
        _log_once("fused ops on %s: no kernel for this device; the eager references run instead", kind)


def _native_ok(op: str, *tensors: torch.Tensor) -> bool:
    # Per call, from the tensors' device (kernel_runs). Under torch.compile this runs while dynamo traces,
    # so the branch taken decides what the compiled graph contains.
    devices = {t.device.type for t in tensors}
    compiling = torch.compiler.is_compiling()
    if devices <= {"cpu", "meta"}:
        return kernel_runs(op, "cpu", compiling)
    if devices <= {"cuda", "meta"}:
        if kernel_runs(op, "cuda", compiling):
            return True
        if compiling and op in CUDA_COMPILED_REFERENCE_OPS:
            return False  # by design, not a missing kernel (announce_device logged it before compiling)
    _log_once("fused %s: no kernel for device %s in this build; using the eager reference", op,
              tensors[0].device.type)
    return False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused equivalent of backends.rms_norm_reference (same dtype rules: x and weight share a dtype)."""
    if x.dtype != weight.dtype or not _native_ok("rms_norm", x, weight):
        from .backends import rms_norm_reference

        if x.dtype != weight.dtype:
            _log_once("fused rms_norm: x is %s but weight is %s; using the eager reference for such calls",
                      x.dtype, weight.dtype)
        return rms_norm_reference(x, weight, eps)
    y, _ = torch.ops.amsp_fused.rms_norm_fwd(x.reshape(-1, x.shape[-1]), weight, eps)
    return y.view(x.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Fused equivalent of model.apply_rope: x (B, S, H, D), cos/sin (S, D/2), interleaved pairs."""
    if not _native_ok("rope", x):
        from .model import apply_rope as reference

        return reference(x, cos, sin)
    return torch.ops.amsp_fused.rope_fwd(x, cos, sin)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Fused silu(a) * b."""
    if not _native_ok("swiglu", a, b):
        return torch.nn.functional.silu(a) * b
    return torch.ops.amsp_fused.swiglu_fwd(a, b)


def default_chunk(vocab: int, device_type: str = "cpu") -> int:
    """Rows of logits per chunk: fused_ops.CHUNK_LOGITS says why these sizes."""
    return max(1, CHUNK_LOGITS.get(device_type, CHUNK_LOGITS["cpu"]) // max(vocab, 1))


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, chunk: int | None = None) -> torch.Tensor:
    """mean cross-entropy of (h @ weight.T) against targets (ignore_index skipped), float32 result.

    h (..., D), weight (V, D), targets (...). Same value as model.lm_loss(F.linear(h, weight), targets)
    without ever holding the (tokens x V) logits.
    """
    if h.dtype != weight.dtype or not _native_ok("linear_cross_entropy", h, weight):
        from .model import lm_loss

        if h.dtype != weight.dtype:
            _log_once("fused linear_cross_entropy: h is %s but weight is %s; using the eager reference",
                      h.dtype, weight.dtype)
        return lm_loss(torch.nn.functional.linear(h, weight).unflatten(0, (1, -1)) if h.dim() == 2
                       else torch.nn.functional.linear(h, weight), targets)
    h2 = h.reshape(-1, h.shape[-1])
    compute_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    chunk = chunk or default_chunk(weight.shape[0], h.device.type)
    loss, _, _ = torch.ops.amsp_fused.linear_cross_entropy_fwd(h2, weight, targets.reshape(-1), ignore_index,
                                                               chunk, compute_grad)
    return loss
