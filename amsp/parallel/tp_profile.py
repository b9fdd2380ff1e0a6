"""Measured compute of the tensor-parallel units for the joint planner: one block, the head and the
embedding made tensor-parallel over real TP groups of the run's ranks and timed forward + backward.

Why measure instead of pricing FLOPs / tp plus the activations' bytes: a TP block issues 4 collectives
forward and 4 backward (all-gather / reduce-scatter of the activations with sequence parallelism), each
through DTensor's dispatch, and runs matmuls tp times narrower. On a GPU the per-call launch and
dispatch cost is tens of microseconds; on CPU with gloo it is milliseconds, and narrow matmuls lose
efficiency on both. A model that prices only the bytes under-predicts TP there (31-49% measured on
this project's CPU benchmark, BENCHMARKS.md). Timing the real TP units on the real groups, with every
TP group of the machine running at once as in training, includes all of it.

Collective over the world: every rank calls measure_tp_units with the same tp. TP groups are tp
consecutive ranks (amsp/parallel/mesh.py's order). Values do not matter for timing; parameters are
filled with small random numbers on the run's device.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

log = logging.getLogger(__name__)
# Part of the cache key of measured TP units (amsp/parallel/joint_startup.py): bumped whenever the TP
# layout's implementation changes what they measure (2: VocabParallelEmbedding's local-rows backward).
TP_PROFILE_VERSION = 2


@dataclass(frozen=True)
class TPUnitTimes:
    """Forward + backward seconds of one micro-batch through each TP-local unit: the slowest rank's, or
    one rank's own (measure_tp_units' slowest=False)."""
    tp: int
    block_s: float
    head_s: float  # final norm + vocabulary-parallel projection + loss
    embedding_s: float

    def describe(self) -> str:
        return (f"tp {self.tp}: block fwd+bwd {self.block_s * 1e3:.2f} ms, head {self.head_s * 1e3:.2f} ms, "
                f"embedding {self.embedding_s * 1e3:.2f} ms")


def measure_tp_units(model_cfg, seq_len: int, micro_batch: int, dtype_name: str, device, tp: int, world: int,
                     sequence_parallel: bool = True, loss_parallel: bool = True, repeats: int = 3,
                     slowest: bool = True) -> TPUnitTimes:
    """TPUnitTimes of the run's shape at this tp (collective; world % tp == 0). slowest=False: this rank's
    own times instead of the world's slowest (on a mixed cluster each node type keeps its own)."""
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

    from amsp import control
    from amsp.planner.compute_profile import median_time
    from amsp.routing_check import data_plane
    from models.llama.model import Llama, lm_loss

    from .mesh import init_mesh
    from .tensor_parallel import parallelize_llama

    if tp < 2 or world % tp:
        raise ValueError(f"measure_tp_units: tp={tp} must be > 1 and divide the world size {world}")
    device = torch.device(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cfg = replace(model_cfg, n_layers=1, activation_checkpointing="none")
    mesh = init_mesh(device.type, (world // tp, tp), ("rest", "tp"))  # the run's collective timeout
    with torch.device("meta"):
        model = Llama(cfg)
    parallelize_llama(model, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                      seq_len=seq_len)
    model.to_empty(device=device)
    model.to(dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.randn(local.shape, generator=g) * 0.02)
        model.init_rope()
    block, head, emb = model.layers[0], model.head, model.tok_embeddings
    tied = emb.weight if cfg.tie_embeddings else None
    cos, sin = model.rope_cos[:seq_len].float(), model.rope_sin[:seq_len].float()
    local_seq = seq_len // tp if sequence_parallel else seq_len  # the residual stream each TP rank holds
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g).to(device)
    x = (torch.randn(micro_batch, local_seq, cfg.dim, generator=g) * 0.5).to(device, dtype).requires_grad_()
    grad = torch.ones_like(x)
    ctx = loss_parallel_ctx if loss_parallel else nullcontext

    def block_step():
        block(x, cos, sin).backward(grad)

    def head_step():
        # As Llama.forward calls it under TP (the fused loss is off there): the head takes (states,
        # tied table), the input plan of a tied head (tensor_parallel.py) names exactly those two, and
        # the loss runs on its logits.
        with ctx():
            lm_loss(head(x, tied), tokens).backward()

    def emb_step():
        out = emb(tokens)
        out = out.to_local() if hasattr(out, "to_local") else out
        out.backward(torch.ones_like(out))

    def on_data_plane(fn):  # DTensor's collectives are the run's data-plane traffic
        def run():
            with data_plane():
                fn()
        return run

    control.barrier()  # every TP group starts together, as in training
    times = [median_time(on_data_plane(fn), device, repeats, agree=True) for fn in (block_step, head_step, emb_step)]
    if slowest:
        times = control.all_reduce_max_floats(times)
    del model, block, head, emb, x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return TPUnitTimes(tp, *times)

