"""Tensor + sequence parallelism for the LLaMA model, applied from outside through
torch.distributed.tensor.parallel (Megatron's layout, torchtitan's pattern):

  tok_embeddings   vocabulary-parallel (rows of the table split; lookups masked, partial sums
                   reduce-scattered over the sequence when sequence-parallel). Our own style
                   (VocabParallelEmbedding) rather than RowwiseParallel: DTensor's embedding backward
                   has no row-sharded rule and builds the full vocab x dim gradient on every TP rank
  attention_norm,  sequence-parallel: each TP rank normalises its slice of the positions, the weight
  ffn_norm,        is replicated (its gradient is summed over the TP group)
  head.norm
  wq, wk, wv,      column-parallel: each TP rank holds n_heads/tp query heads and n_kv_heads/tp
  w1, w3           key/value heads, ffn_hidden/tp of the MLP (the sequence is all-gathered first)
  wo, w2           row-parallel: partial outputs reduce-scattered back to the sequence slices
  head.output      column-parallel over the vocabulary; with loss_parallel the logits stay sharded and
                   the cross-entropy runs on the shards under loss_parallel() (never all-gathered)

The model file stays free of parallelism: its attention reads the head count from the projections'
widths. Parameters become DTensors on the TP mesh; the AMSP engine then shards their local pieces over
the data-parallel group (amsp/parallel/tp_slices.py maps them back to the full tensors).
"""
from __future__ import annotations

import logging
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ParallelStyle

from ..errors import InputError

log = logging.getLogger(__name__)


def check_divisible(cfg, tp: int, seq_len: int | None = None, sequence_parallel: bool = True) -> None:
    """One line naming every model dimension that does not split over `tp` ranks."""
    dims = {"n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "ffn_hidden_dim": cfg.ffn_hidden_dim,
            "vocab_size": cfg.vocab_size}
    bad = [f"model.{k}={v}" for k, v in dims.items() if v % tp]
    if sequence_parallel and seq_len is not None and seq_len % tp:
        bad.append(f"data.seq_len={seq_len} (sequence parallelism; or parallel.sequence_parallel=false)")
    if bad:
        raise InputError(f"parallel.tp={tp} does not divide {', '.join(bad)}")


def parallelize_llama(model: nn.Module, tp_mesh, *, sequence_parallel: bool = True, loss_parallel: bool = True,
                      seq_len: int | None = None) -> None:
    """Make `model` (models.llama.model.Llama, on the meta device or materialised) tensor-parallel over
    the 1-D `tp_mesh`, in place. With loss_parallel the caller runs forward and backward inside
    torch.distributed.tensor.parallel.loss_parallel()."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    cfg = model.cfg
    tp = tp_mesh.size()
    check_divisible(cfg, tp, seq_len, sequence_parallel)
    _use_unfused_where_sharded(model, sequence_parallel)
    if sequence_parallel:
        _use_own_norms(model)
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    top = {"tok_embeddings": VocabParallelEmbedding(output_layout=stream)}
    if sequence_parallel:
        top["head.norm"] = SequenceParallel()
    if model.head.output is not None:
        top["head.output"] = ColwiseParallel(input_layouts=stream,
                                             output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                             use_local_output=not loss_parallel)
    elif sequence_parallel:  # tied: the head projects with the embedding's vocabulary-sharded table
        top["head"] = PrepareModuleInput(input_layouts=(stream, None), desired_input_layouts=(Replicate(), None))
    else:  # tied, replicated stream: the normalised states enter the projection as a replicated DTensor
        top["head.norm"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                               use_local_output=False)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        plan = {
            "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
        _local_attention_kernel(block.attention, model.attention_backend, cfg.n_heads // tp, cfg.n_kv_heads // tp)
    if model.head.output is None and not loss_parallel:
        raise InputError("tied embeddings with parallel.tp > 1 need parallel.loss_parallel=true (the tied head's "
                         "logits are vocabulary-sharded)")


class VocabParallelEmbedding(ParallelStyle):
    """An nn.Embedding whose table's rows are split over the TP ranks (a Shard(0) DTensor parameter, as
    RowwiseParallel makes it), computed on the local rows as Megatron's VocabParallelEmbedding does:
    each rank looks up the tokens it owns (the others masked to zero), the partial sums are
    reduce-scattered over the sequence (output_layout Shard(1)) or all-reduced (Replicate), and the
    backward all-gathers the output gradient and accumulates it into the local rows only.

    Why not RowwiseParallel: torch's embedding-backward sharding rules (2.13) have no row-sharded case,
    so the weight gradient comes back as a full vocab x dim tensor on every TP rank (Partial, then
    Replicate) and is cut to the rank's rows afterwards: tp times the gradient's memory and work. On a
    ~100M-parameter model at tp 2 x pp 2 that transient was the first pipeline stage's peak (BENCHMARKS.md,
    joint memory model)."""

    def __init__(self, output_layout):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise TypeError(f"VocabParallelEmbedding takes a plain nn.Embedding, got {module!r}")
        weight = distribute_tensor(module.weight.detach(), device_mesh, [Shard(0)])
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        module.forward = types.MethodType(_vocab_parallel_forward(device_mesh, self.output_layout), module)
        return module


def _vocab_parallel_forward(mesh, output_layout):
    """The forward VocabParallelEmbedding installs: local rows, masked lookup, partial sums redistributed."""
    from torch.distributed.tensor import DTensor, Partial

    def forward(module: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        local = module.weight.to_local()  # differentiable: the gradient comes back as the local rows
        rows = local.shape[0]  # check_divisible: the vocabulary splits evenly
        ids = tokens - mesh.get_local_rank() * rows
        outside = (ids < 0) | (ids >= rows)
        out = F.embedding(ids.masked_fill(outside, 0), local).masked_fill(outside.unsqueeze(-1), 0.0)
        summed = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return summed.redistribute(mesh, [output_layout]).to_local()

    return forward


def _local_attention_kernel(attn: nn.Module, backend: str, n_heads: int, n_kv_heads: int) -> None:
    """Give a block's attention the kernel for the heads this TP rank holds. The column-parallel wq/wk/wv
    hand the kernel n_heads/tp query and n_kv_heads/tp key/value heads as plain local tensors; a kernel
    built for a head count (Transformer Engine's DotProductAttention, sized when the model was built with
    the global counts) is rebuilt for the local ones through the same backend choice (models/llama/
    backends.make_attention). Stateless kernels (sdpa, flash_attn) come back as they were."""
    from models.llama import backends

    attn.n_heads, attn.n_kv_heads = n_heads, n_kv_heads
    device = next(attn.parameters()).device  # meta when built for the engine: the kernel is made there too
    with torch.device(device):
        attn.kernel = backends.make_attention(backend, n_heads, n_kv_heads, attn.head_dim)


def _use_own_norms(model: nn.Module) -> None:
    """Sequence parallelism runs the norms on DTensors (their input Shard(1), their weight Replicate);
    only this project's RMSNorm computes on DTensors (its reference path is plain torch ops, and
    _use_unfused_where_sharded has switched its csrc kernel off). Any other norm module, Transformer
    Engine's RMSNorm (model.norm=te) whose kernels take plain tensors, is replaced by the project's
    unfused RMSNorm: the same function (fp32 normalisation, a gain named `weight`, so names, init and
    checkpoints are unchanged), on the same device and dtype, its values copied when materialised."""
    from models.llama.model import RMSNorm

    swapped = 0
    for parent in [*(b for b in model.layers), model.head]:
        for name in ("attention_norm", "ffn_norm", "norm"):
            old = getattr(parent, name, None)
            if old is None or isinstance(old, RMSNorm):
                continue
            weight = old.weight
            with torch.device(weight.device):
                new = RMSNorm(weight.shape[0], model.cfg.norm_eps, fused=False).to(weight.dtype)
            if weight.device.type != "meta":
                with torch.no_grad():
                    new.weight.copy_(weight)
            new.weight.requires_grad_(weight.requires_grad)
            setattr(parent, name, new)
            swapped += 1
    if swapped:
        log.info("sequence parallelism: %d %s norm(s) replaced by the project's RMSNorm (the sequence-parallel "
                 "norms compute on DTensors, which only its reference ops take)", swapped, model.norm_backend)


def _use_unfused_where_sharded(model: nn.Module, sequence_parallel: bool) -> None:
    """The csrc fused kernels take plain tensors: under TP the norms (sequence-parallel) and the fused
    linear + cross-entropy see DTensors, so those run the reference ops; logged once."""
    changed = []
    if model.head.fused_loss:
        model.head.fused_loss = False
        changed.append("linear_cross_entropy")
    if sequence_parallel:
        for mod in model.modules():
            if getattr(mod, "fused", False) is True and hasattr(mod, "eps"):
                mod.fused = False
                changed.append("rms_norm") if "rms_norm" not in changed else None
    if changed:
        log.info("tensor parallelism: fused %s off (their inputs are DTensors); reference ops used", ", ".join(changed))
