"""Optimizer pieces shared by every data-parallel plan: decay groups and the LR schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn


def decays(name: str, param: nn.Parameter) -> bool:
    """Weight decay applies to matrices (linear weights, embeddings) only, never to norm gains."""
    return param.dim() >= 2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_floor(lr: float, min_lr: float | None, min_lr_ratio: float | None) -> float:
    """The cosine's final learning rate: an absolute optim.min_lr wins, else lr x optim.min_lr_ratio."""
    if min_lr is not None:
        return float(min_lr)
    if min_lr_ratio is None:
        raise ValueError("set optim.min_lr or optim.min_lr_ratio (the floor of the cosine schedule)")
    return float(lr) * float(min_lr_ratio)


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup from 0 to `lr`, then cosine decay to `min_lr` at `decay_steps`, flat after."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return self.min_lr
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = (step - self.warmup_steps) / span
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def shape_warnings(self, max_steps: int) -> list[str]:
        """A warmup longer than the run or than the decay span is legal (a short test of a recipe) but rarely
        meant: a 7B recipe's 2000 warmup steps in a 100-step run reach 5% of the peak and never decay."""
        if self.warmup_steps > max_steps:
            last = self(max_steps - 1)
            return [f"optim.warmup_steps={self.warmup_steps} > trainer.max_steps={max_steps}: the learning rate "
                    f"reaches {last:.3g} ({last / self.lr:.0%} of optim.lr={self.lr:.3g}) and never decays"]
        if self.warmup_steps >= self.decay_steps:
            return [f"optim.warmup_steps={self.warmup_steps} >= the decay span ({self.decay_steps} steps: "
                    f"optim.decay_steps, else trainer.max_steps): no cosine decay, the learning rate drops to "
                    f"{self.min_lr:.3g} after the warmup"]
        return []
