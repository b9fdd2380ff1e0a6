"""AdamW on the OS shards only, with clipping by the global gradient norm.

The update is torch.optim.AdamW's (decoupled decay, bias-corrected moments, eps added to the
bias-corrected sqrt of v), applied to each rank's fp32 OS shard; weight decay covers matrices
only (amsp/optim.decays), expressed as [start, end) segments of the shard. The global norm sums
squared shard norms with each OS shard counted once despite its N/os replicas, in one all_reduce
of one fp32 over the world.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .collectives import Comm
from .flat_unit import FlatUnit


@dataclass(frozen=True)
class AdamWSettings:
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # <= 0 disables clipping (the norm is still computed and returned)


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # global L2 norm of the gradient before clipping
    skipped: bool  # True when the norm was not finite: no parameter or moment was changed
    lr: float


class ShardedAdamW:
    def __init__(self, units: list[FlatUnit], settings: AdamWSettings, comm: Comm):
        self.units, self.s, self.comm = units, settings, comm
        self.steps = 0  # applied updates (skipped steps do not count, as in torch)

    def global_grad_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float64)
        for u in self.units:
            sq = u.os_grad.double().pow(2).sum().cpu()
            local += sq / u.replicas
        total = local.float().reshape(1).to(self.units[0].device)
        if self.comm.topo.world > 1:
            self.comm.all_reduce(total, tuple(range(self.comm.topo.world)), "grad_norm").wait()
        return math.sqrt(max(float(total.item()), 0.0)) if math.isfinite(total.item()) else float("nan")

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        norm = self.global_grad_norm()
        if not math.isfinite(norm):
            return StepResult(norm, True, lr)
        clip = 1.0
        if self.s.grad_clip > 0:
            clip = min(1.0, self.s.grad_clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
        self.steps += 1
        b1, b2 = self.s.betas
        bc1 = 1 - b1 ** self.steps
        bc2_sqrt = math.sqrt(1 - b2 ** self.steps)
        for u in self.units:
            g = u.os_grad
            if clip != 1.0:
                g = g * clip
            if self.s.weight_decay:
                for lo, hi in u.decay_segments:
                    u.master[lo:hi].mul_(1 - lr * self.s.weight_decay)
            u.exp_avg.lerp_(g, 1 - b1)
            u.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (u.exp_avg_sq.sqrt() / bc2_sqrt).add_(self.s.eps)
            u.master.addcdiv_(u.exp_avg, denom, value=-lr / bc1)
        return StepResult(norm, False, lr)
