"""From the `amsp` config node and the launch environment to a running engine (used by train.py).

The plan is resolved and validated before any model state exists; an invalid plan is a PlanError
naming the broken rule. The config node is read by attribute (a Hydra DictConfig or the
configs.schema.AMSPConfig dataclass), so amsp/ does not import the config package.
"""
from __future__ import annotations

import logging

import torch

from models.llama.config import LlamaConfig

from .compile import apply_compile, resolve_compile
from .wgrad_fusion import COMPILE_OFF_WITH_FUSION
from .engine import AMSPEngine, EngineOptions
from .launch import DistEnv
from .plan import Plan, plan_from_settings
from .sharded_optim import AdamWSettings
from .topology import Topology, checked_ranks_per_node

log = logging.getLogger(__name__)


def topology_from(amsp_cfg, denv: DistEnv) -> Topology:
    rpn = checked_ranks_per_node(denv.world_size, amsp_cfg.ranks_per_node or denv.local_world_size)
    return Topology(denv.world_size, rpn)


def describe_node_override(amsp_cfg, denv: DistEnv) -> str | None:
    """The startup line for amsp.ranks_per_node other than the launch's ranks per machine (one machine posing
    as several nodes), or None. The launch line says the launcher's count and the engine's the emulated one:
    without this line the two disagree unexplained."""
    r = amsp_cfg.ranks_per_node
    if not r or r == denv.local_world_size:
        return None
    # A count that does not divide the world is refused here, before it is described: "(0 nodes)" came first
    checked_ranks_per_node(denv.world_size, r)
    return (f"nodes: amsp.ranks_per_node={r}: every {r} rank(s) are one node for the plan and the collectives "
            f"({denv.world_size // r} nodes), not the launch's {denv.local_world_size} per machine")


def plan_from_config(amsp_cfg, topo: Topology) -> Plan:
    c = amsp_cfg
    plan = plan_from_settings(c.plan, topo.world, topo.ranks_per_node, blocks=(c.p, c.g, c.os),
                              embed_head=(c.embed_head_p, c.embed_head_g, c.embed_head_os))
    return plan  # explicit degrees with a preset name are refused there (ambiguous)


def precision_from_config(amsp_cfg, trainer_dtype: str) -> str:
    """amsp.precision wins; when it is auto, trainer.dtype (auto|fp32|bf16) decides; they must agree."""
    a, t = amsp_cfg.precision, trainer_dtype
    if a != "auto" and t != "auto" and a != t:
        raise ValueError(f"amsp.precision={a} contradicts trainer.dtype={t}; set one of them")
    return a if a != "auto" else t


def engine_from_config(amsp_cfg, optim_cfg, trainer_dtype: str, model_cfg: LlamaConfig, denv: DistEnv,
                       device: torch.device, seed: int, plan: Plan | None = None, compile: str = "auto",
                       mesh=None, parts=None) -> AMSPEngine:
    """Build the engine; `plan` overrides the config's (the partitioner passes its choice here);
    `compile` is model.compile (auto|on|off), applied to the built model's blocks (amsp/compile.py).
    With model parallelism, `mesh` (amsp/parallel/mesh.py) and this rank's `parts` (its TP-local stage):
    the plan then shards over the rank's DP group."""
    resolve_compile(compile, device)  # an invalid value fails before anything is allocated
    topo = topology_from(amsp_cfg, denv) if mesh is None else mesh.dp_topology(denv.rank)
    plan = plan or plan_from_config(amsp_cfg, topo)
    o = optim_cfg
    options = EngineOptions(precision=precision_from_config(amsp_cfg, trainer_dtype), grad_comm=amsp_cfg.grad_comm,
                            overlap_spread=bool(amsp_cfg.overlap_spread), spread_window=int(amsp_cfg.spread_window),
                            overlap_update=bool(amsp_cfg.overlap_update), prefetch=bool(amsp_cfg.prefetch),
                            fuse_wgrad=bool(amsp_cfg.fuse_wgrad), optimizer_kernel=str(amsp_cfg.optimizer_kernel),
                            optim=AdamWSettings(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                                                grad_clip=o.grad_clip))
    engine = AMSPEngine(model_cfg, plan, topo, denv.rank, seed=seed, device=device, options=options,
                        mesh=mesh, parts=parts)
    if mesh is not None and (mesh.tp > 1 or mesh.pp > 1) and compile != "off":
        # torch.compile of blocks holding DTensor parameters, or driven by a pipeline schedule, is not
        # something this project has measured; refuse "on" rather than run it unproven.
        if compile == "on":
            raise ValueError("model.compile=on is not supported with parallel.tp > 1 or parallel.pp > 1; "
                             "set model.compile=auto or off")
        if denv.rank == 0:
            log.info("model.compile=auto: off under model parallelism (tp=%d, pp=%d)", mesh.tp, mesh.pp)
        return engine
    if options.fuse_wgrad and compile == "auto" and resolve_compile(compile, device):
        if denv.rank == 0:  # model.compile=on with it is refused by configs/validate.py
            log.info("model.compile=auto: %s", COMPILE_OFF_WITH_FUSION)
        return engine
    apply_compile(engine.model, compile, device)
    return engine
