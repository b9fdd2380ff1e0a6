"""From the composed Hydra config (the same one train.py gets) to the planner's inputs."""
from __future__ import annotations

import logging
import os
from omegaconf import DictConfig, OmegaConf

from amsp.batch_geometry import batch_geometry
from amsp.schedule import Precision
from configs.schema import PlannerConfig, to_llama_config

from .cluster import ClusterSpec, cluster_from_config
from .compute_profile import ComputeProfile
from .cost_model import Options
from .device_preset import recognise
from .workload import Kernels, Workload

log = logging.getLogger(__name__)


def planner_config(cfg: DictConfig) -> DictConfig:
    """amsp.planner from the config; the schema's defaults where the config tree has no such node."""
    node = OmegaConf.select(cfg, "amsp.planner")
    return node if node is not None else OmegaConf.structured(PlannerConfig)


def with_model_parallel(cfg: DictConfig, what_if: bool = True) -> DictConfig:
    """The config with the AMSP planner's tp / pp taken from parallel.tp / parallel.pp, as a training run
    plans (its DP group under those degrees): train.py's startup and the CLI price the same thing.
    amsp.planner.tp / pp stay for the CLI's what-ifs (what_if) when parallel.* is left at 1; a training
    run (what_if=False) plans under parallel.* only. The two may not contradict."""
    p = planner_config(cfg)
    tp, pp = (int(OmegaConf.select(cfg, f"parallel.{k}", default=1)) for k in ("tp", "pp"))
    if (p.tp, p.pp) not in ((1, 1), (tp, pp)) and (not what_if or (tp, pp) != (1, 1)):
        raise ValueError(f"amsp.planner.tp/pp={p.tp}/{p.pp} contradict parallel.tp/pp={tp}/{pp}; a training run "
                         f"plans under parallel.tp / parallel.pp (amsp.planner.tp/pp are for planner what-ifs)")
    if (tp, pp) == (1, 1):
        return cfg
    return OmegaConf.merge(cfg, {"amsp": {"planner": {"tp": tp, "pp": pp}}})


# How to reach the data-parallel planner, which honours a state budget, from each caller of the joint one:
# both refuse a named parallel.tp / pp beside their search, so "name parallel.tp / pp" alone would be refused.
_DATA_PARALLEL_PLANNER = {"train": "set parallel.auto=false and name parallel.tp / parallel.pp",
                          "cli": "drop --joint to plan with parallel.tp / parallel.pp"}


def refuse_state_budget_for_joint(p: DictConfig, context: str = "train") -> None:
    """The joint planner fits each stage against device memory only; a model-state cap it would not
    honour is refused rather than ignored. context: "train" (train.py's parallel.auto=true) or "cli"
    (python -m amsp.planner --joint), whose way to the data-parallel planner the advice names."""
    if p.state_budget_gib is not None:
        where = {"train": "parallel.auto=true", "cli": "--joint"}[context]
        raise ValueError(f"amsp.planner.state_budget_gib={p.state_budget_gib} applies to the data-parallel "
                         f"planner only; the joint planner ({where}) fits stages against device memory: unset "
                         f"it, or {_DATA_PARALLEL_PLANNER[context]}")


def options_from_config(cfg: DictConfig, compute: ComputeProfile | None = None) -> Options:
    """The cost model's options; `compute`: a measured (or loaded) profile in place of FLOPs at mfu."""
    p = planner_config(cfg)
    spread = OmegaConf.select(cfg, "amsp.overlap_spread")  # the engine's switches
    window = OmegaConf.select(cfg, "amsp.spread_window", default=Options.spread_window)
    return Options(mfu=p.mfu, memory_margin=p.memory_margin, reserved_bytes=int(p.reserved_gib * 2**30),
                   overlap_spread=bool(spread), spread_window=int(window), overlap_slowdown=p.overlap_slowdown,
                   overlap_update=bool(OmegaConf.select(cfg, "amsp.overlap_update", default=False)),
                   optimizer_kernel=str(OmegaConf.select(cfg, "amsp.optimizer_kernel", default="auto")),
                   compute=compute,
                   state_budget_bytes=None if p.state_budget_gib is None else p.state_budget_gib * 2**30)


def micro_batches(cfg: DictConfig, dp_world: int) -> int:
    # The same (possibly rounded) batch train.py takes; train.py logs the rounding, not the planner.
    return batch_geometry(cfg, dp_world, announce=False).accumulation


def precision_name(cfg: DictConfig, cluster: ClusterSpec) -> str:
    """As amsp/build.py resolves it: amsp.precision, else trainer.dtype, else the cluster's dtype
    (bf16 on the GPU presets, fp32 on cpu: what the engine picks on those devices)."""
    a, t = OmegaConf.select(cfg, "amsp.precision") or "auto", cfg.trainer.dtype
    if a != "auto" and t != "auto" and a != t:
        raise ValueError(f"amsp.precision={a} contradicts trainer.dtype={t}; set one of them")
    return a if a != "auto" else t if t != "auto" else cluster.dtype


def run_precision(cfg: DictConfig, cluster: ClusterSpec) -> Precision:
    """What a run moves, for both planners (the data-parallel one here, the joint one in the CLI and at
    startup): as the engine, parameters in the compute dtype, gradients in amsp.grad_comm (auto = fp32,
    see amsp.engine.resolve_grad_comm)."""
    compute = Precision.named(precision_name(cfg, cluster))
    grad = OmegaConf.select(cfg, "amsp.grad_comm") or "auto"
    return Precision(param_bytes=compute.param_bytes,
                     grad_bytes=4 if grad == "auto" else Precision.named(grad).grad_bytes)


def workload_from_config(cfg: DictConfig, cluster: ClusterSpec, kernels: Kernels | None = None) -> Workload:
    """`kernels`: what the run's device executes (train.py's startup knows,
    amsp.planner.startup.kernels_for_run); None assumes every op model.fused enables runs fused."""
    p = planner_config(cfg)
    model = to_llama_config(cfg.model)
    dp_world = cluster.world // (p.tp * p.pp)
    if dp_world < 1 or cluster.world % (p.tp * p.pp):
        # named by the keys that set them: with_model_parallel copies parallel.tp / pp into amsp.planner's
        parallel = tuple(int(OmegaConf.select(cfg, f"parallel.{k}", default=1)) for k in ("tp", "pp"))
        keys = "parallel" if parallel == (p.tp, p.pp) else "amsp.planner"
        raise ValueError(f"{keys}.tp x {keys}.pp = {p.tp} x {p.pp} = {p.tp * p.pp} must divide the world size "
                         f"{cluster.world} ({cluster.nodes} node(s) x {cluster.ranks_per_node} ranks)")
    return Workload(model=model, seq_len=cfg.data.seq_len, micro_batch_size=cfg.trainer.micro_batch_size,
                    micro_batches=micro_batches(cfg, dp_world),
                    precision=run_precision(cfg, cluster),
                    recompute=model.activation_checkpointing, tp=p.tp, pp=p.pp, kernels=kernels,
                    sequence_parallel=bool(OmegaConf.select(cfg, "parallel.sequence_parallel", default=True)),
                    loss_parallel=bool(OmegaConf.select(cfg, "parallel.loss_parallel", default=True)),
                    **pipeline_schedule(cfg, p.pp))


def pipeline_schedule(cfg: DictConfig, pp: int) -> dict:
    """The schedule a pipelined run names (parallel.schedule / virtual_stages), for the planner's bubble
    and in-flight activations; without a pipeline the defaults."""
    if pp < 2:
        return {}
    split = OmegaConf.select(cfg, "parallel.layer_split", default=None)
    # the split the pipeline runs (an explicit one may be uneven): the planner prices its largest rank
    out = {"schedule": str(OmegaConf.select(cfg, "parallel.schedule", default="1f1b")),
           "virtual_stages": int(OmegaConf.select(cfg, "parallel.virtual_stages", default=1))}
    return out if split is None else {**out, "layer_split": tuple(int(n) for n in split)}


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_measured_fields(c: DictConfig, local_ranks: int, dtype_name: str, device=None) -> DictConfig:
    """Fill what the cpu preset leaves to measurement: device memory and peak FLOP/s. On CPU the
    memory is the host RAM shared by the local ranks and the peak this machine's matmul rate in the
    compute dtype (cached by the metrics package); on a CUDA device, its memory and datasheet peak.
    Values given in the config win; each filled value is logged once."""
    import torch

    c = OmegaConf.create(OmegaConf.to_container(c, resolve=True))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cuda = device is not None and torch.device(device).type == "cuda"
    if c.device_memory_gib is None:
        if cuda:
            c.device_memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
            where = f"the memory of {torch.cuda.get_device_name(device)}"
        else:
            c.device_memory_gib = host_memory_bytes() / local_ranks / 2**30
            where = f"host RAM / {local_ranks} local ranks"
        log.info("cluster %s: device memory = %s = %.1f GiB", c.name, where, c.device_memory_gib)
    if c.peak_tflops is None:
        from amsp.metrics.peak import cpu_measured_peak, cuda_table_peak

        if cuda:
            name = torch.cuda.get_device_name(device)
            flops = cuda_table_peak(name, dtype)
            if flops is None:
                raise ValueError(f"cluster {c.name}: no datasheet peak for {name} in {dtype_name}; give "
                                 f"cluster.peak_tflops=... or pick a GPU preset (cluster=a100x8|a800x8|h100x8)")
            c.peak_tflops, source = flops / 1e12, f"datasheet peak of {name}"
        else:
            peak = cpu_measured_peak(dtype)
            c.peak_tflops, source = peak.flops / 1e12, peak.source
        log.info("cluster %s: peak %.4g TFLOP/s per rank (%s)", c.name, c.peak_tflops, source)
    return c


def cluster_spec(cfg: DictConfig, nodes: int | None = None, ranks_per_node: int | None = None,
                 local_ranks: int | None = None, device=None) -> ClusterSpec:
    """The ClusterSpec for this config; nodes / ranks_per_node from the launcher when given. On a
    CUDA device with the default cpu preset, the device's own preset (device_preset.py). A run's device
    is the spec's device, whatever the preset says (a GPU preset named for a CPU run runs inline)."""
    say_launch_shape(cfg.cluster, nodes, ranks_per_node)
    spec = _cluster_spec(cfg, nodes, ranks_per_node, local_ranks, device)
    return spec if device is None else on_device(spec, device)


_shapes_said: set = set()


def say_launch_shape(c: DictConfig, nodes: int | None, ranks_per_node: int | None) -> None:
    """cluster.nodes / ranks_per_node give the planner CLI its machines; a run takes the launch's shape instead.
    Said once where they differ, so a value the config names is not replaced silently (startup prices the
    cluster more than once)."""
    given = (c.nodes, c.ranks_per_node)
    used = (nodes or c.nodes, ranks_per_node or c.ranks_per_node)
    if given != used and (given, used) not in _shapes_said:
        _shapes_said.add((given, used))
        log.info("cluster %s: the launch's %d node(s) x %d ranks replace cluster.nodes=%d, cluster.ranks_per_node=%d",
                 c.name, *used, *given)


def on_device(spec: ClusterSpec, device) -> ClusterSpec:
    """The spec with the run's device kind (cpu | cuda): what the run executes overrides the preset's."""
    from dataclasses import replace

    import torch

    return replace(spec, device=torch.device(device).type)


def _cluster_spec(cfg: DictConfig, nodes: int | None, ranks_per_node: int | None, local_ranks: int | None,
                  device) -> ClusterSpec:
    from dataclasses import replace

    c = cfg.cluster
    if device is not None and str(device).startswith("cuda"):
        import torch

        c = recognise(c, torch.cuda.get_device_name(device),
                      torch.cuda.get_device_properties(device).total_memory / 2**30)
    if c.device_memory_gib is None or c.peak_tflops is None:
        import torch

        a, t = OmegaConf.select(cfg, "amsp.precision") or "auto", cfg.trainer.dtype
        cuda = device is not None and torch.device(device).type == "cuda"
        dtype = a if a != "auto" else t if t != "auto" else "bf16" if cuda else c.dtype
        local = machine_ranks(local_ranks or ranks_per_node or c.ranks_per_node)  # they share the host's RAM
        c = resolve_measured_fields(c, local, dtype, device)
        c.dtype = "bf16" if cuda else c.dtype  # what the engine's auto precision picks on this device
        if not cuda:  # this machine's CPU, measured: its ranks share its cores
            spec = replace(cluster_from_config(c, nodes=nodes, ranks_per_node=ranks_per_node),
                           shared_cores=cpu_shared_cores(local))
            if spec.shared_cores is not None:
                log.info("cpu: %d ranks share this machine's cores: a rank computing alone runs in %.2fx the time "
                         "it takes while all compute (the joint planner prices pipeline bubbles with it)",
                         *spec.shared_cores)
            return spec
    return cluster_from_config(c, nodes=nodes, ranks_per_node=ranks_per_node)


MACHINE_RANKS_ENV = "AMSP_MACHINE_RANKS"


def machine_ranks(local_world_size: int) -> int:
    """Ranks running on this machine: the launcher's local world, unless AMSP_MACHINE_RANKS says more (the
    emulated cluster, scripts/bench/netns_cluster.py, runs several 'nodes' on one machine)."""
    return int(os.environ.get(MACHINE_RANKS_ENV) or local_world_size)


def cpu_shared_cores(local_ranks: int, threads: int | None = None) -> tuple[int, float] | None:
    """(local ranks, a lone rank's time / its time with all busy) when `local_ranks` ranks of `threads`
    threads each (this process's torch threads by default: torchrun gives every rank the same) oversubscribe
    this machine's cores; None when each rank has cores of its own."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = threads or torch.get_num_threads()
    if local_ranks * threads <= cores:
        return None
    busy_share = cores / local_ranks  # cores per rank while every rank computes
    alone = min(1.0, busy_share / min(threads, cores))
    return None if alone >= 1.0 else (local_ranks, alone)
