"""torch.compile for the transformer blocks, applied from outside the model (`model.compile`).

What is compiled is each block's `forward` (block.forward = torch.compile(block.forward)), not the
block module. The engine drives sharding through module hooks on the block (forward pre-hook:
wait for the P all-gather and prefetch; forward hook: free the gathered buffer and register the
output-gradient hook that re-gathers for backward) and post-accumulate-grad hooks on the
parameters. nn.Module.__call__ runs those hooks and then calls `self.forward`, so with only the
forward compiled the hooks stay eager around the compiled region. Compiling the module itself
(torch.compile(block) or block.compile(), as torchtitan does under FSDP2, whose hooks dynamo
skips by a special rule) would put the call, hooks included, under dynamo, which would try to
trace collectives, waits and storage resizes.

Why the engine's state survives compilation:
  * The parameters are graph inputs (dynamo lifts nn.Module parameters as inputs by default,
    torch._dynamo.config.inline_inbuilt_nn_modules), so the blocks share one compiled graph and
    nothing about a parameter but its metadata (shape, stride, dtype, device) is guarded.
  * With p > 1 the parameters view a buffer whose storage is resized to 0 after the forward and
    back before the backward. That happens outside the graph, between its calls; the graph only
    ever runs on gathered weights, and the compiled backward reads the tensors it saved, which are
    views of the same storage, refilled by the re-gather, just as eager autograd's are.
  * Gradients still reach the parameters through eager AccumulateGrad nodes, so the
    post-accumulate-grad hooks fire as before.
  * Activation checkpointing (models/llama: torch.utils.checkpoint inside the block's forward,
    non-reentrant, full or selective) is traced by dynamo into the graph; AOTAutograd's partitioner
    then recomputes inside the compiled backward. The output-gradient hook runs before that
    backward, so the weights are gathered for the recompute.
fullgraph=True makes a graph break inside a block an error rather than a silent slowdown, except
with flash_attn or Transformer Engine kernels, which may run as eager islands inside the block
(TE marks its modules no_torch_dynamo): there the block compiles around them, and that is logged.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("auto", "on", "off")
_EAGER_ISLAND_KERNELS = ("flash_attn", "te")  # third-party kernels dynamo may not trace


def resolve_compile(setting: str, device: torch.device) -> bool:
    """auto: on for CUDA, off for CPU (CPU runs are short tries and tests, and compiling a block
    takes about a minute on these 2-core machines). train.py settles auto on CUDA by measurement first
    (amsp/compile_choice.py: off unless a compiled block is measured faster), so auto reaching this on
    CUDA there means compiled blocks won."""
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"model.compile={setting!r} is not one of {'|'.join(COMPILE_CHOICES)}")
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "on"


def apply_compile(model: nn.Module, setting: str, device: torch.device) -> bool:
    """Compile the forward of every block in `model.layers` if `setting` resolves to on; log the
    choice. Returns whether the blocks were compiled."""
    on = resolve_compile(setting, device)
    if not on:
        log.info("model.compile=%s%s: transformer blocks run eagerly", setting,
                 f" (off on {torch.device(device).type})" if setting == "auto" else "")
        return False
    kernels = {getattr(model, "attention_backend", None), getattr(model, "norm_backend", None)}
    islands = sorted(k for k in kernels if k in _EAGER_ISLAND_KERNELS)
    if getattr(model, "fused_ops", None):
        from models.llama import fused

        fused.announce_device(device)
    for block in model.layers:
        block.forward = torch.compile(block.forward, fullgraph=not islands)
    log.info("model.compile=%s: each transformer block's forward compiled with torch.compile (inductor, %s); "
             "the data-parallel hooks stay eager around it", setting,
             f"fullgraph off: {'/'.join(islands)} kernels may run eagerly inside the block" if islands
             else "fullgraph")
    return True


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far: dynamo's tracing with inductor's forward
    compile, plus the backward graphs AOTAutograd compiles lazily at their first backward. Read from
    torch's own compile-time records (torch._dynamo.utils.compilation_time_metrics); 0.0 when nothing
    was compiled or this torch keeps no such record (then the startup line says nothing of it)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except ImportError:
        return 0.0
    return float(sum(sum(times) for name, times in metrics.items()
                     if name == "_compile.compile_inner" or name.endswith("bw_compiler")))
