"""From the composed Hydra config (the same one train.py gets) to the planner's inputs."""
from __future__ import annotations

import logging
import os
from dataclasses import replace

from omegaconf import DictConfig, OmegaConf

from amsp.schedule import Precision
from configs.schema import PlannerConfig, to_llama_config

from .cluster import ClusterSpec, cluster_from_config
from .cost_model import Options
from .workload import Workload

log = logging.getLogger(__name__)


def planner_config(cfg: DictConfig) -> DictConfig:
    """amsp.planner from the config; the schema's defaults where the config tree has no such node."""
    node = OmegaConf.select(cfg, "amsp.planner")
    return node if node is not None else OmegaConf.structured(PlannerConfig)


def options_from_config(cfg: DictConfig) -> Options:
    p = planner_config(cfg)
    return Options(mfu=p.mfu, memory_margin=p.memory_margin, reserved_bytes=int(p.reserved_gib * 2**30),
                   overlap_spread=p.overlap_spread, overlap_slowdown=p.overlap_slowdown)


def global_batch_samples(cfg: DictConfig) -> int:
    """Samples per optimizer step: trainer.global_batch_tokens / data.seq_len when set (as train.py)."""
    t = cfg.trainer
    if t.global_batch_tokens:
        if t.global_batch_tokens % cfg.data.seq_len:
            raise ValueError(f"trainer.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
                             f"data.seq_len={cfg.data.seq_len}")
        return t.global_batch_tokens // cfg.data.seq_len
    return t.global_batch_size


def micro_batches(cfg: DictConfig, dp_world: int) -> int:
    gbs, mbs = global_batch_samples(cfg), cfg.trainer.micro_batch_size
    if gbs % (mbs * dp_world):
        raise ValueError(f"global batch {gbs} samples is not divisible by micro_batch_size={mbs} x "
                         f"data-parallel ranks={dp_world}")
    return gbs // (mbs * dp_world)


def precision_name(cfg: DictConfig, cluster: ClusterSpec) -> str:
    return cfg.trainer.dtype if cfg.trainer.dtype != "auto" else cluster.dtype


def workload_from_config(cfg: DictConfig, cluster: ClusterSpec) -> Workload:
    p = planner_config(cfg)
    model = to_llama_config(cfg.model)
    dp_world = cluster.world // (p.tp * p.pp)
    if dp_world < 1 or cluster.world % (p.tp * p.pp):
        raise ValueError(f"amsp.planner.tp*pp={p.tp * p.pp} must divide the world size {cluster.world}")
    return Workload(model=model, seq_len=cfg.data.seq_len, micro_batch_size=cfg.trainer.micro_batch_size,
                    micro_batches=micro_batches(cfg, dp_world),
                    precision=Precision.named(precision_name(cfg, cluster)),
                    recompute=model.activation_checkpointing, tp=p.tp, pp=p.pp)


def with_world(cfg: DictConfig, w: Workload, world: int) -> Workload:
    """The same workload at another world size (the global batch stays; micro-batches follow)."""
    return replace(w, micro_batches=micro_batches(cfg, world // (w.tp * w.pp)))


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_measured_fields(c: DictConfig, local_ranks: int, dtype_name: str) -> DictConfig:
    """Fill what the cpu preset leaves to measurement: device memory (host RAM shared by the local
    ranks) and peak FLOP/s (this machine's matmul rate in the compute dtype, cached by the metrics
    package). Values given in the config win; each filled value is logged once."""
    c = OmegaConf.create(OmegaConf.to_container(c, resolve=True))
    if c.device_memory_gib is None:
        c.device_memory_gib = host_memory_bytes() / local_ranks / 2**30
        log.info("cluster %s: device memory = host RAM / %d local ranks = %.1f GiB", c.name, local_ranks,
                 c.device_memory_gib)
    if c.peak_tflops is None:
        import torch

        from amsp.metrics.peak import cpu_measured_peak

        peak = cpu_measured_peak({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name])
        c.peak_tflops = peak.flops / 1e12
        log.info("cluster %s: peak %.3f TFLOP/s per rank (%s)", c.name, c.peak_tflops, peak.source)
    return c


def cluster_spec(cfg: DictConfig, nodes: int | None = None, ranks_per_node: int | None = None,
                 local_ranks: int | None = None) -> ClusterSpec:
    """The ClusterSpec for this config; nodes / ranks_per_node from the launcher when given."""
    c = cfg.cluster
    if c.device_memory_gib is None or c.peak_tflops is None:
        dtype = cfg.trainer.dtype if cfg.trainer.dtype != "auto" else c.dtype
        c = resolve_measured_fields(c, local_ranks or ranks_per_node or c.ranks_per_node, dtype)
    return cluster_from_config(c, nodes=nodes, ranks_per_node=ranks_per_node)
