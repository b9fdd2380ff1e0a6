"""From the config to this rank's share of the model: the mesh, the TP transform, the pipeline stage.

train.py calls mesh_from_config() once; with tp = pp = 1 it returns None and nothing here runs (the
pure AMSP path). Otherwise model_parts() builds the model on the meta device, makes it tensor-parallel
(amsp/parallel/tensor_parallel.py) and keeps the layers of this rank's pipeline stage(s)
(amsp/parallel/pipeline.py); the AMSP engine then shards those TP-local parameters over the rank's DP group.
"""
from __future__ import annotations

import logging

import torch
from omegaconf import OmegaConf

from models.llama.config import LlamaConfig
from models.llama.model import Llama

from ..engine import ModelParts
from ..errors import InputError
from .mesh import ParallelMesh

log = logging.getLogger(__name__)


def mesh_from_config(cfg, denv) -> ParallelMesh | None:
    """The run's mesh, or None when the run is data-parallel only (parallel.tp = parallel.pp = 1)."""
    tp, pp = int(OmegaConf.select(cfg, "parallel.tp", default=1)), int(OmegaConf.select(cfg, "parallel.pp", default=1))
    if tp == 1 and pp == 1:
        return None
    if pp > 1 and denv.launcher == "pretend":
        # torch.distributed.pipelining sends each stage's tensor metadata to the next as pickled objects,
        # which the fake backend never delivers (the stage then read garbage: an allocation of terabytes)
        raise InputError(f"parallel.pp={pp} cannot run in a pretend world (AMSP_PRETEND_WORLD): the pipeline's "
                         f"stages exchange tensor metadata, which the fake backend does not carry; use parallel.pp=1 "
                         f"there (tensor parallelism and the AMSP plans run)")
    rpn = OmegaConf.select(cfg, "amsp.ranks_per_node") or denv.local_world_size
    mesh = ParallelMesh(denv.world_size, int(rpn), tp=tp, pp=pp)
    if denv.rank == 0:
        log.info("model parallelism: %s; each rank reads data shard dp=%d of %d", mesh.describe(),
                 mesh.coords(0).dp, mesh.dp)
    return mesh


def model_parts(model_cfg: LlamaConfig, parallel_cfg, mesh: ParallelMesh, rank: int,
                device: torch.device, device_mesh=None, seq_len: int | None = None) -> ModelParts:
    """This rank's parts of a fresh meta-device model: TP applied, the pipeline stage's layers selected.
    `device_mesh`: the torch DeviceMesh of `mesh` (made once per run: creating one is collective)."""
    with torch.device("meta"):
        model = Llama(model_cfg)
    _recompute_per_stage(model, parallel_cfg, mesh)
    loss_context = ModelParts.loss_context  # the no-op default
    if mesh.tp > 1:
        from .tensor_parallel import parallelize_llama

        dm = device_mesh if device_mesh is not None else mesh.device_mesh(device.type)
        parallelize_llama(model, dm["tp"], sequence_parallel=bool(parallel_cfg.sequence_parallel),
                          loss_parallel=bool(parallel_cfg.loss_parallel), seq_len=seq_len)
        if parallel_cfg.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            loss_context = loss_parallel
    if mesh.pp == 1:
        return ModelParts(model, loss_context=loss_context)
    from .pipeline import stage_parts

    return stage_parts(model, parallel_cfg, mesh, rank, loss_context=loss_context)


def pipeline_runner(engine, mesh: ParallelMesh | None, rank: int, parallel_cfg, num_micro: int, seq_len: int,
                    micro_batch_size: int):
    """The pipeline schedule over this rank's stage(s), or None without pipeline parallelism."""
    if mesh is None or mesh.pp == 1:
        return None
    from .pipeline import PipelineRunner

    return PipelineRunner(engine, mesh, rank, parallel_cfg, num_micro, seq_len, micro_batch_size)


def _recompute_per_stage(model, parallel_cfg, mesh: ParallelMesh) -> None:
    """parallel.recompute_stages: full recomputation on the blocks of the stages that need it (the joint
    planner turns it on only where a stage's activations would not fit), none elsewhere."""
    flags = getattr(parallel_cfg, "recompute_stages", None)
    if flags is None:
        return
    from .pipeline import split_layers

    stages = mesh.pp * int(getattr(parallel_cfg, "virtual_stages", 1))
    if len(flags) != stages:
        raise ValueError(f"parallel.recompute_stages has {len(flags)} entries for {stages} pipeline stages")
    layers = split_layers(model.cfg.n_layers, stages, getattr(parallel_cfg, "layer_split", None))
    for on, stage in zip(flags, layers):
        for i in stage:
            model.layers[i].checkpointing = "full" if on else "none"
