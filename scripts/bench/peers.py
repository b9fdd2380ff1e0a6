"""The data-parallel systems of the shoot-out, behind one small interface.

Every runner trains the same pure LLaMA (models/llama, same seed) on the same micro-batches with
AdamW (betas 0.9/0.95, weight decay 0.1 on matrices, clipping at global norm 1.0), so only the
data-parallel layer differs:
  ddp          torch DistributedDataParallel; no_sync() for all but the last micro-batch; in the
               bf16 regime the bf16_compress_hook (gradients all-reduced in bf16).
  fsdp2        FSDP2 fully_shard over all ranks (embedding, each block, head, root), default
               reshard_after_forward, gradients reduce-scattered every micro-batch (FSDP2's default
               accumulation); bf16 regime: MixedPrecisionPolicy(reduce_dtype=bf16).
  fsdp2_hsdp   the same on a 2-D (nodes x ranks-per-node) mesh: shard inside a node, replicate
               across nodes (HSDP).
  amsp:<plan>  the AMSP engine with a preset or an explicit plan; fp32 compute, gradient traffic
               in the regime's dtype (amsp.grad_comm), as the peers do.
A runner's train_step(batches) does one optimizer step over its micro-batches and returns the mean
loss over the global batch.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from models.llama import LlamaConfig, build_model, lm_loss  # noqa: F401  (lm_loss used by callers)

BETAS, EPS, WD, CLIP = (0.9, 0.95), 1e-8, 0.1, 1.0
STATE_BYTES_PER_PARAM_FP32 = 16  # fp32 weights 4 + fp32 gradients 4 + Adam m 4 + v 4


def _decay_groups(model: torch.nn.Module) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def _global_mean_loss(local_sum: torch.Tensor, count: int) -> float:
    t = local_sum.detach().clone().reshape(1)
    dist.all_reduce(t)
    return t.item() / (count * dist.get_world_size())


def _bf16_compress_hook_any_backend(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's own bf16_compress_hook (cast to bf16, all-reduce, copy back). DDP refuses to register
    it by name unless CUDA + NCCL >= 2.10 are present; gloo reduces bf16 on CPU, so we call the
    same function through this differently named wrapper."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


# DDP checks the hook's annotations as objects; this module's annotations are strings (PEP 563).
_bf16_compress_hook_any_backend.__annotations__ = {"bucket": dist.GradBucket,
                                                   "return": torch.futures.Future[torch.Tensor]}


class DDPRunner:
    def __init__(self, cfg: LlamaConfig, seed: int, precision: str, lr: float):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = build_model(cfg, seed=seed)
        self.ddp = DDP(self.model, bucket_cap_mb=25, gradient_as_bucket_view=True)
        if precision == "bf16":
            self.ddp.register_comm_hook(None, _bf16_compress_hook_any_backend)
        self.opt = torch.optim.AdamW(_decay_groups(self.model), lr=lr, betas=BETAS, eps=EPS)
        self.numel = sum(p.numel() for p in self.model.parameters())

    def train_step(self, batches) -> float:
        m = len(batches)
        total = torch.zeros(())
        for i, (x, y) in enumerate(batches):
            ctx = self.ddp.no_sync() if i < m - 1 else contextlib.nullcontext()
            with ctx:
                loss = self.ddp(x, y)
                (loss / m).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return _global_mean_loss(total, m)

    def model_state_bytes(self) -> int:
        return STATE_BYTES_PER_PARAM_FP32 * self.numel

    def close(self) -> None:
        del self.ddp, self.opt, self.model


class FSDP2Runner:
    def __init__(self, cfg: LlamaConfig, seed: int, precision: str, lr: float, hsdp_nodes: int | None = None,
                 ranks_per_node: int | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        world = dist.get_world_size()
        if hsdp_nodes:
            mesh = init_device_mesh("cpu", (hsdp_nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
            self.shard_degree = ranks_per_node
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
            self.shard_degree = world
        mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
        self.model = build_model(cfg, seed=seed)
        self.numel = sum(p.numel() for p in self.model.parameters())
        kw = {"mesh": mesh, "mp_policy": mp}
        fully_shard(self.model.tok_embeddings, **kw)
        for block in self.model.layers:
            fully_shard(block, **kw)
        fully_shard(self.model.head, **kw)
        fully_shard(self.model, **kw)
        self.opt = torch.optim.AdamW(_decay_groups(self.model), lr=lr, betas=BETAS, eps=EPS)

    def train_step(self, batches) -> float:
        m = len(batches)
        total = torch.zeros(())
        for x, y in batches:
            loss = self.model(x, y)
            (loss / m).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return _global_mean_loss(total, m)

    def model_state_bytes(self) -> int:
        return STATE_BYTES_PER_PARAM_FP32 * -(-self.numel // self.shard_degree)

    def close(self) -> None:
        del self.opt, self.model


class AMSPRunner:
    def __init__(self, cfg: LlamaConfig, seed: int, precision: str, lr: float, plan, ranks_per_node: int):
        from amsp.engine import AMSPEngine, EngineOptions
        from amsp.sharded_optim import AdamWSettings
        from amsp.topology import Topology

        topo = Topology(dist.get_world_size(), ranks_per_node)
        # Compute stays fp32 on every side; the regime's dtype is the gradient traffic's.
        opts = EngineOptions(precision="fp32", grad_comm=precision, optim=AdamWSettings(betas=BETAS, eps=EPS, weight_decay=WD,
                                                                      grad_clip=CLIP))
        self.engine = AMSPEngine(cfg, plan, topo, dist.get_rank(), seed=seed, options=opts)
        self.lr = lr
        self.plan = plan

    def train_step(self, batches) -> float:
        m = len(batches)
        total = torch.zeros(())
        for i, (x, y) in enumerate(batches):
            total += self.engine.forward_backward(x, y, i, m).float()
        self.engine.step(self.lr)
        return _global_mean_loss(total, m)

    def model_state_bytes(self) -> int:
        return int(self.engine.resident_bytes()["total"])

    def close(self) -> None:
        del self.engine


def make_runner(name: str, cfg: LlamaConfig, seed: int, precision: str, lr: float, nodes: int,
                ranks_per_node: int, amsp_plan=None):
    if name == "ddp":
        return DDPRunner(cfg, seed, precision, lr)
    if name == "fsdp2":
        return FSDP2Runner(cfg, seed, precision, lr)
    if name == "fsdp2_hsdp":
        return FSDP2Runner(cfg, seed, precision, lr, hsdp_nodes=nodes, ranks_per_node=ranks_per_node)
    if name.startswith("amsp:"):
        if amsp_plan is None:
            raise ValueError(f"{name}: no plan given")
        return AMSPRunner(cfg, seed, precision, lr, amsp_plan, ranks_per_node)
    raise ValueError(f"unknown system {name!r}; expected ddp, fsdp2, fsdp2_hsdp or amsp:<plan>")


def peer_model_state_bytes(name: str, numel: int, world: int, ranks_per_node: int) -> int:
    """Model-state bytes per rank of a peer (fp32 weights, gradients, Adam m and v), for the
    memory-bound regime's fit check; the same count the runners report."""
    shard = {"ddp": 1, "fsdp2": world, "fsdp2_hsdp": ranks_per_node}[name]
    return STATE_BYTES_PER_PARAM_FP32 * -(-numel // shard)
