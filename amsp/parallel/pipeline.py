"""Pipeline parallelism through torch.distributed.pipelining, with AMSP sharding each stage's DP group.

The model stays whole on the meta device; a rank's pipeline stage (or stages, for interleaved
schedules) is a StageModule holding references to the model's own embedding, blocks and head, so
parameter names, the init and the checkpoints are the unsplit model's. The AMSP engine builds units
for those modules only (ModelParts) and counts each backward through a virtual stage as one
micro-batch of that stage (engine.begin_microbatches / end_microbatches): the last micro-batch's
hierarchical gradient sync then overlaps the rest of the pipeline drain.

Stage order (interleaved): stage s lives on pipeline rank s % pp as its chunk s // pp, so the
embedding is chunk 0 of pipeline rank 0 and the head the last chunk of the last pipeline rank.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn as nn

from models.llama.model import lm_loss

from ..engine import to_device
from ..errors import InputError
from ..planner.workload import pipeline_split
from ..routing_check import data_plane
from .micro_batches import SCHEDULES, micro_batch_problem, virtual_stages_problem

log = logging.getLogger(__name__)

# Schedules whose backward runs as an input-gradient pass and a later weight pass (the weight passes fill
# the bubbles): the engine counts a chunk's micro-batch at its weight pass.
DEFERRED_WEIGHT_SCHEDULES = ("zero_bubble",)


def split_layers(n_layers: int, stages: int, layer_split: list[int] | None = None) -> list[list[int]]:
    """Layer indices of each stage, in order. `layer_split` (layers per stage) wins; otherwise stages get
    equal shares of n_layers + EMBED_WEIGHT + HEAD_WEIGHT layer-equivalents (the first holds the
    embedding, the last the head), rounded so every stage keeps at least one block. The arithmetic is the
    planner's (amsp.planner.workload.pipeline_split, torch-free for its CLI), so both see one split."""
    try:
        split = pipeline_split(n_layers, stages, layer_split)
    except ValueError as e:
        raise InputError(str(e)) from None
    out, start = [], 0
    for n in split:
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_stages(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stage indices a pipeline rank holds, in chunk order (interleaved: loop over the ranks)."""
    return [c * pp + pp_rank for c in range(virtual_stages)]


def stage_parts(model, parallel_cfg, mesh, rank: int, loss_context=nullcontext):
    """ModelParts of this rank's stage(s): its blocks, the embedding on stage 0, the head on the last."""
    from ..engine import ModelParts

    v = int(parallel_cfg.virtual_stages)
    stages = mesh.pp * v
    layers = split_layers(model.cfg.n_layers, stages, parallel_cfg.layer_split)
    pp_rank = mesh.coords(rank).pp
    mine = rank_stages(pp_rank, mesh.pp, v)
    chunk_of = {i: c for c, s in enumerate(mine) for i in layers[s]}
    return ModelParts(model, embed=0 in mine, layers=sorted(chunk_of), head=stages - 1 in mine,
                      chunk_of_layer=chunk_of, embed_chunk=0, head_chunk=v - 1, loss_context=loss_context)


def check_micro_batches(schedule: str, num_micro: int, pp: int) -> None:
    """What the schedules need of a step's micro-batch count (train.py asks before building anything)."""
    problem = micro_batch_problem(schedule, num_micro, pp)
    if problem:
        raise InputError(problem)


class StageModule(nn.Module):
    """One pipeline stage of a Llama: references to its embedding (first stage), blocks and head (last
    stage). Takes tokens or hidden states, returns hidden states or logits."""

    def __init__(self, model, layers: list[int], first: bool, last: bool, seq_len: int):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.head = model.head if last else None
        self.seq_len = seq_len  # the full sequence: with sequence parallelism the hidden states hold a slice
        # The rotary tables and the tied weight are the model's; kept without registering the model.
        object.__setattr__(self, "_model", model)
        self.logit_spec = None  # (mesh, placements) of vocabulary-sharded logits, for the loss to re-wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._model
        cos, sin = m.rope_cos[:self.seq_len], m.rope_sin[:self.seq_len]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers:
            h = block(h, cos, sin)
        if self.head is None:
            return h
        tied = m.tok_embeddings.weight if m.cfg.tie_embeddings else None
        logits = self.head(h, tied)
        # The schedule handles plain tensors at stage boundaries (static metadata, no DTensor grads to
        # describe): vocabulary-sharded logits leave as their local shard; the loss re-wraps them.
        if hasattr(logits, "to_local"):
            self.logit_spec = (logits.device_mesh, logits.placements)
            logits = logits.to_local()
        return logits


class PipelineRunner:
    """One training step (all of a rank's micro-batches) through the pipeline schedule and the AMSP
    engine; also forward-only evaluation. Every rank of the pipeline calls each method."""

    def __init__(self, engine, mesh, rank: int, parallel_cfg, num_micro: int, seq_len: int, micro_batch_size: int):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                  ScheduleInterleavedZeroBubble)

        from ..groups import ensure_rank_groups, process_group

        name = str(parallel_cfg.schedule)
        if name not in SCHEDULES:
            raise InputError(f"parallel.schedule={name!r} is not one of {'|'.join(SCHEDULES)}")
        if mesh.pp < 2:
            raise ValueError("a pipeline runner needs parallel.pp >= 2; with one stage the engine runs the "
                             "micro-batches itself")
        v = int(parallel_cfg.virtual_stages)
        if (problem := virtual_stages_problem(name, v)) is not None:
            raise InputError(problem)
        check_micro_batches(name, num_micro, mesh.pp)
        self.deferred = name in DEFERRED_WEIGHT_SCHEDULES
        if self.deferred and engine.fused_linears:
            raise InputError(f"parallel.schedule={name} with amsp.fuse_wgrad: the fused weight-gradient GEMM runs in "
                             f"each linear's backward, which the input-gradient and the weight pass both run")
        self.engine, self.mesh, self.num_micro = engine, mesh, num_micro
        ensure_rank_groups(mesh.pp_groups())  # collective: every rank creates every pipeline group
        group = process_group(mesh.pp_ranks(rank))
        stages = mesh.pp * v
        layers = split_layers(engine.cfg.n_layers, stages, parallel_cfg.layer_split)
        mine = rank_stages(mesh.coords(rank).pp, mesh.pp, v)
        self.first = 0 in mine
        self.last = stages - 1 in mine
        self.modules = [StageModule(engine.model, layers[s], s == 0, s == stages - 1, seq_len) for s in mine]
        shapes = _boundary_shapes(engine, mesh, parallel_cfg, seq_len, micro_batch_size)
        stage_cls = _stage_class(PipelineStage)
        self.stages = [stage_cls(mod, s, stages, engine.device, group=group, input_args=shapes(s == 0, False),
                                 output_args=shapes(False, s == stages - 1))
                       for mod, s in zip(self.modules, mine)]
        if self.deferred:
            for chunk, st in enumerate(self.stages):
                st.amsp_before_weights = partial(engine.gather_for_weight_pass, chunk)
                st.amsp_weights_ready = partial(engine.weight_grads_ready, chunk)
        scale = 1.0 / (num_micro * mesh.dp)  # each micro-batch mean, so the sum is the global batch mean
        last_module = self.modules[-1]

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            if last_module.logit_spec is not None:
                from torch.distributed.tensor import DTensor

                logits = DTensor.from_local(logits, *last_module.logit_spec, run_check=False)
            return lm_loss(logits, targets) * scale

        self.scale = scale
        kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
        multi = {"interleaved": ScheduleInterleaved1F1B, "zero_bubble": ScheduleInterleavedZeroBubble}
        if name in multi:  # schedules over a list of stages per rank
            self.schedule = multi[name](self.stages, num_micro, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = kinds[name](self.stages[0], num_micro, loss_fn=loss_fn, scale_grads=False)
        if rank == 0:
            log.info("pipeline: schedule %s, %d stages (%d per rank), layers per stage %s, %d micro-batches per step",
                     name, stages, v, [len(x) for x in layers], num_micro)

    def _run(self, fn, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> tuple[float, int]:
        losses = self._losses(fn, xs, ys)
        return (sum(losses), len(losses)) if self.last else (0.0, 0)

    def _losses(self, fn, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[float]:
        """Each micro-batch's mean loss (unscaled) on the last stage's ranks, [] elsewhere."""
        device = self.engine.device
        # to_device: a non-blocking copy; torch.cat on the CPU makes a pageable tensor, so each micro-batch
        # (pinned by the loader) is copied and concatenated on the device
        x = torch.cat([to_device(t, device) for t in xs]) if self.first else None
        y = torch.cat([to_device(t, device) for t in ys]) if self.last else None
        losses: list = []
        with data_plane(), self.engine.parts.loss_context():  # p2p sends are data-plane traffic
            if self.first:
                fn(x, target=y, losses=losses, return_outputs=False)
            else:
                fn(target=y, losses=losses, return_outputs=False)
        return [float(_plain(loss.detach())) / self.scale for loss in losses]

    def train_step(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> tuple[float, int]:
        """All micro-batches of one step: returns (sum of micro-batch mean losses, micro-batches) on the
        last stage's ranks, (0.0, 0) elsewhere. The optimizer step is the caller's engine.step()."""
        self.engine.begin_microbatches(self.num_micro, deferred_weights=self.deferred)
        try:
            out = self._run(self.schedule.step, xs, ys)
        except BaseException:
            self.engine.abort_microbatches()  # the schedule's error is the one to see
            raise
        self.engine.end_microbatches()
        return out

    @torch.no_grad()
    def evaluate(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> tuple[float, int]:
        """Forward only over up to num_micro micro-batches (the schedule's count): a short group is padded
        with copies of its last micro-batch whose losses are left out. (sum of losses, count) on the last
        stage's ranks, (0.0, 0) elsewhere."""
        n = len(xs)
        if not 0 < n <= self.num_micro:
            raise ValueError(f"evaluate takes 1..{self.num_micro} micro-batches, got {n}")
        pad = self.num_micro - n
        xs, ys = list(xs) + [xs[-1]] * pad, list(ys) + [ys[-1]] * pad
        losses = self._losses(self.schedule.eval, xs, ys)
        self.engine.comm.close_step()  # validation traffic is not part of a training step
        if not self.last:
            return 0.0, 0
        return sum(losses[:n]), n

    def evaluate_batches(self, batches) -> tuple[float, int]:
        """All of this rank's validation micro-batches, num_micro at a time."""
        total, count, group = 0.0, 0, []
        for batch in list(batches) + [None]:
            if batch is not None:
                group.append(batch)
            if group and (batch is None or len(group) == self.num_micro):
                t, c = self.evaluate([x for x, _ in group], [y for _, y in group])
                total, count, group = total + t, count + c, []
        return total, count


def _stage_class(base: type) -> type:
    """PipelineStage that tells the AMSP engine when a deferred weight pass has assigned its gradients.
    torch's stage_backward_weight computes every weight gradient of the stage with one autograd.grad and
    sets .grad itself, so no post-accumulate hook fires; the first stage's weight pass is a full backward
    (its input needs no gradient) whose hooks do fire. (A subclass made here, not at import: the pipelining
    module loads only when a pipeline is built.)"""

    class AMSPPipelineStage(base):
        amsp_before_weights = amsp_weights_ready = None

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
            assigned = self.amsp_weights_ready is not None and self.has_backward and self.stage_index != 0
            if assigned:
                self.amsp_before_weights()
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if assigned:
                self.amsp_weights_ready()

    return AMSPPipelineStage


def _boundary_shapes(engine, mesh, parallel_cfg, seq_len: int, micro_batch_size: int):
    """Example tensors of one micro-batch at stage boundaries, so the schedule runs with static metadata
    (no metadata exchange, no extra forward/backward to infer shapes: the engine would count that
    backward as a micro-batch). shapes(first_input, last_output) -> the tensor."""
    cfg, device = engine.cfg, engine.device
    sp = mesh.tp > 1 and bool(getattr(parallel_cfg, "sequence_parallel", True))
    # requires_grad: the receiving stage computes the gradient of its input and sends it back
    hidden = torch.empty(micro_batch_size, seq_len // mesh.tp if sp else seq_len, cfg.dim,
                         dtype=engine.compute_dtype, device=device, requires_grad=True)
    vocab = cfg.vocab_size // mesh.tp if mesh.tp > 1 and getattr(parallel_cfg, "loss_parallel", True) else cfg.vocab_size
    tokens = torch.empty(micro_batch_size, seq_len, dtype=torch.long, device=device)
    logits = torch.empty(micro_batch_size, seq_len, vocab, dtype=engine.compute_dtype, device=device)

    def shapes(first_input: bool, last_output: bool) -> torch.Tensor:
        return tokens if first_input else logits if last_output else hidden

    return shapes


def _plain(loss: torch.Tensor) -> torch.Tensor:
    to_local = getattr(loss, "to_local", None)
    return to_local() if to_local is not None else loss
