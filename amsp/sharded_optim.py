"""AdamW on the OS shards only, with clipping by the global gradient norm.

The update is torch.optim.AdamW's (decoupled decay, bias-corrected moments, eps added to the
bias-corrected sqrt of v), applied to each rank's fp32 OS shard; weight decay covers matrices
only (amsp/optim.decays), expressed as [start, end) segments of the shard.

One step is two multi-tensor kernel launches and one host sync:
  * the global norm: per-unit squared norms of the OS gradients on the device (torch._foreach_norm,
    fp32), each OS shard counted once despite its N/os replicas (weight 1/replicas), summed on the
    device, all-reduced once over the world, read back once (`.item()`: the step's only sync; it
    decides whether the step is skipped);
  * the update: torch._fused_adamw_ (the kernel behind torch.optim.AdamW(fused=True)) over views of
    every unit's OS shard, one launch for the weight-decay segments and one for the rest. Clipping
    rides in the kernel's grad_scale (it divides each gradient by it): (norm + 1e-6) / clip, at
    least 1, computed on the device from the all-reduced norm. Scaling lr instead would not be
    clipping: Adam's update is invariant to a constant gradient scale except through eps, and the
    moments would keep the unclipped gradients.
The update can also run unit by unit after the norm (`prepare` then `update(prepared, [i])`): the
engine's overlapped update (EngineOptions.overlap_update) defers each unit's to just before that unit
is next needed, on a side CUDA stream. Element by element it is the same arithmetic either way.
Where the device has no fused kernel, the same lists go through torch._foreach_* ops (one pass per
op, unit by unit so the one temporary, the denominator, stays one unit's chunk); the choice is
logged once. Either way the OS gradients are left divided by the clip scale (the fused kernel writes
them back unscaled); they are dropped right after the step.
Kernel csrc (amsp.optimizer_kernel=csrc) is csrc's amsp_fused::adamw_update, one call per run of a unit
(a run is one decay class): the same arithmetic in one pass that reads the gradient without writing it
back and, for units whose OS shard is their P shard (os = p) with separate bf16 weights, writes those
weights too (FlatUnit.launch_spread then skips its cast): 30 bytes a parameter against 38.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .collectives import Comm
from .errors import InputError
from .flat_unit import FlatUnit

log = logging.getLogger(__name__)

KERNELS = ("auto", "fused", "foreach", "csrc")


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


@dataclass(frozen=True)
class PreparedStep:
    """A step whose norm, clip scale and step count are settled; its updates may still be pending."""
    result: StepResult
    scale: torch.Tensor | None  # the clip divisor on the device (None: clipping off)


def fused_adamw_available(device: torch.device) -> bool:
    """torch.optim.AdamW's own test for fused=True on this device type."""
    if not hasattr(torch, "_fused_adamw_"):
        return False
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return torch.device(device).type in _get_fused_kernels_supported_devices()


def native_adamw_unavailable(device: torch.device) -> str | None:
    """None when amsp_fused::adamw_update serves `device` (csrc's CUDA kernels, or the CPU extension),
    else why not."""
    from csrc.loader import CUDA_EXTENSION, ops_unavailable

    return ops_unavailable(device, CUDA_EXTENSION)


def resolve_kernel(kernel: str, device: torch.device) -> tuple[str, str]:
    """(the AdamW kernel `kernel` runs on `device`, why): auto is torch's fused kernel where the device has
    one, else the foreach ops. A named kernel the device cannot run is an error, never a fallback."""
    if kernel not in KERNELS:
        raise ValueError(f"AdamW kernel {kernel!r} is not one of {'|'.join(KERNELS)}")
    if kernel == "auto":
        return ("fused", "available") if fused_adamw_available(device) else \
            ("foreach", f"no fused AdamW kernel for device type {torch.device(device).type}")
    # A kernel this machine cannot run is the config's mismatch with it (exit 2), not a bug.
    if kernel == "fused" and not fused_adamw_available(device):
        raise InputError(f"amsp.optimizer_kernel=fused: no fused AdamW kernel for device type "
                         f"{torch.device(device).type} (amsp.optimizer_kernel=auto picks what it has)")
    if kernel == "csrc" and (missing := native_adamw_unavailable(device)) is not None:
        raise InputError(f"amsp.optimizer_kernel=csrc: amsp_fused::adamw_update is unavailable on {device}: "
                         f"{missing} (amsp.optimizer_kernel=auto picks what it has)")
    return kernel, "requested"


def _segments(chunk: int, decay: list[tuple[int, int]]) -> list[tuple[int, bool]]:
    """[0, chunk) cut into consecutive (length, decays) runs: the decay segments and the gaps."""
    runs, pos = [], 0
    for lo, hi in sorted(decay):
        if lo > pos:
            runs.append((lo - pos, False))
        runs.append((hi - lo, True))
        pos = hi
    if pos < chunk:
        runs.append((chunk - pos, False))
    return runs


NORM_CHUNK = 1 << 15  # elements per partial norm on CPU (_global_sq_norm)


class ShardedAdamW:
    def __init__(self, units: list[FlatUnit], settings: AdamWSettings, comm: Comm, kernel: str = "auto",
                 norm_ranks: tuple[int, ...] | None = None):
        self.units, self.s, self.comm = units, settings, comm
        # The ranks whose gradients make up the model's: the data-parallel group, or the whole world
        # when tensor/pipeline parallelism splits the parameters further (amsp.parallel.mesh).
        self.norm_ranks = norm_ranks or getattr(comm.topo, "members", None) or tuple(range(comm.topo.world))
        self.steps = 0  # applied updates (skipped steps do not count, as in torch)
        device = units[0].device
        kernel, why = resolve_kernel(kernel, device)
        self.kernel = kernel
        if comm.rank == 0:
            log.info("sharded AdamW on %s: %s (%s)", device, {
                "fused": "torch._fused_adamw_, one launch per decay class",
                "foreach": "torch._foreach_* ops, unit by unit",
                "csrc": "amsp_fused::adamw_update, one pass per run of a unit, the gradient not written back, "
                        "the compute weights of units with os = p written in the same pass"}[kernel], why)
        # Per unit: run lengths for torch.split and which runs decay; state views built once (master,
        # exp_avg and exp_avg_sq are never rebound; the gradient is new each step).
        self._runs = [_segments(u.layout.chunk, u.decay_segments) for u in units]
        self._state = [tuple(self._split(t, runs) for t in (u.master, u.exp_avg, u.exp_avg_sq))
                       for u, runs in zip(units, self._runs)]
        # kernel csrc: where the OS shard is the P shard (os = p) and the weights are a separate bf16 copy,
        # the update also writes them (the spread's cast is then skipped: FlatUnit.launch_spread)
        self._weights_out = [self._split(u.p_shard, runs) if kernel == "csrc" and not u.master_is_weights
                             and u.deg.os == u.deg.p else None for u, runs in zip(units, self._runs)]
        self._no_out = torch.empty(0, dtype=torch.float32, device=device)
        # The gradient norm reads, per unit, the runs of its OS gradient that count (all of it unless some
        # parameters are TP-replicated copies counted on another rank): lengths fixed, so weights too.
        self._norm_runs = [_segments(u.layout.chunk, u.norm_excluded) for u in units]
        if torch.device(device).type == "cpu":
            # A CPU norm accumulates in fp32 along the whole tensor: over a 1M-element embedding shard that is
            # ~1e-5 off, relative, and plans whose shard boundaries differ disagreed by that much. Runs of at
            # most NORM_CHUNK elements keep each sum short (views; their squares are added up in the step).
            self._norm_runs = [[(min(NORM_CHUNK, n - i), excluded) for n, excluded in runs
                                for i in range(0, n, NORM_CHUNK)] for runs in self._norm_runs]
        self._inv_replicas = torch.tensor([1.0 / u.replicas for u, runs in zip(units, self._norm_runs)
                                           for _, excluded in runs if not excluded],
                                          dtype=torch.float32, device=device)
        self._step_t = torch.zeros((), dtype=torch.float32, device=device)  # the kernel reads the step here

    @staticmethod
    def _split(t: torch.Tensor, runs: list[tuple[int, bool]]) -> list[torch.Tensor]:
        return list(torch.split(t, [n for n, _ in runs]))

    def _global_sq_norm(self) -> torch.Tensor:
        """Sum over the world of squared OS-gradient norms (each shard once), on the device, shape (1,)."""
        counted = [g for u, runs in zip(self.units, self._norm_runs)
                   for g, (_, excluded) in zip(self._split(u.os_grad, runs), runs) if not excluded]
        if counted:
            total = (torch.stack(torch._foreach_norm(counted)).square() * self._inv_replicas).sum().reshape(1)
        else:  # every element this rank holds is counted on another rank
            total = torch.zeros(1, dtype=torch.float32, device=self._step_t.device)
        if len(self.norm_ranks) > 1:
            self.comm.all_reduce(total, self.norm_ranks, "grad_norm").wait()
        return total

    def _lists(self, decay: bool, which: list[int]) -> tuple[list, list, list, list]:
        """(params, grads, exp_avgs, exp_avg_sqs): views of the runs of this decay class of units `which`."""
        lists: tuple[list, list, list, list] = ([], [], [], [])
        for i in which:
            u, runs, (m, a, s) = self.units[i], self._runs[i], self._state[i]
            g = self._split(u.os_grad, runs)
            for j, (_, d) in enumerate(runs):
                if d == decay:
                    for out, t in zip(lists, (m, g, a, s)):
                        out.append(t[j])
        return lists

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        """The norm, then every unit's update (two kernel launches in all with the fused kernel)."""
        prepared = self.prepare(lr)
        if not prepared.result.skipped:
            self.update(prepared)
        return prepared.result

    @torch.no_grad()
    def prepare(self, lr: float) -> PreparedStep:
        """The global norm and the clip scale, the step's one host sync, and the step count; no
        parameter or moment changes here. A skipped step (norm not finite) counts nothing."""
        total = self._global_sq_norm()
        scale = None
        if self.s.grad_clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule (multiply by min(1, clip / (norm + 1e-6))) as a divisor.
            scale = (total.sqrt().add_(1e-6).div_(self.s.grad_clip)).clamp_(min=1.0).reshape(())
        sq = total.item()  # the step's one host sync
        if not math.isfinite(sq):
            return PreparedStep(StepResult(float("nan"), True, lr), None)
        self.steps += 1
        self._step_t.fill_(self.steps)
        return PreparedStep(StepResult(math.sqrt(max(sq, 0.0)), False, lr), scale)

    @torch.no_grad()
    def update(self, prepared: PreparedStep, which: list[int] | None = None) -> None:
        """AdamW on the OS shards of units `which` (indices into units; None: all) for a prepared step.
        Each unit's update reads only its own OS gradient and state, so the units may go one at a time
        in any order, as long as each goes once and before the next prepare()."""
        if prepared.result.skipped:
            raise RuntimeError("AdamW: a skipped step has no update to apply")
        which = list(range(len(self.units))) if which is None else which
        lr = prepared.result.lr
        if self.kernel == "fused":
            self._fused(*self._lists(True, which), lr, self.s.weight_decay, prepared.scale)
            self._fused(*self._lists(False, which), lr, 0.0, prepared.scale)
        elif self.kernel == "csrc":
            self._native(which, lr, prepared.scale)
        else:
            self._foreach(which, lr, prepared.scale)

    def _fused(self, params, grads, avgs, sqs, lr: float, wd: float, scale: torch.Tensor | None) -> None:
        if not params:
            return
        b1, b2 = self.s.betas
        torch._fused_adamw_(params, grads, avgs, sqs, [], [self._step_t] * len(params), lr=lr, beta1=b1, beta2=b2,
                            weight_decay=wd, eps=self.s.eps, amsgrad=False, maximize=False, grad_scale=scale,
                            found_inf=None)

    def _native(self, which: list[int], lr: float, scale: torch.Tensor | None) -> None:
        """csrc's one-pass AdamW, run by run (a run is one decay class: its weight decay is a scalar)."""
        b1, b2 = self.s.betas
        step_size, bc2_sqrt = lr / (1 - b1 ** self.steps), math.sqrt(1 - b2 ** self.steps)
        for i in which:
            u, runs, (params, avgs, sqs), outs = self.units[i], self._runs[i], self._state[i], self._weights_out[i]
            for j, (g, (_, decays)) in enumerate(zip(self._split(u.os_grad, runs), runs)):
                torch.ops.amsp_fused.adamw_update(params[j], g, avgs[j], sqs[j], self._no_out if outs is None
                                                  else outs[j], scale, lr, self.s.weight_decay if decays else 0.0,
                                                  b1, b2, self.s.eps, step_size, bc2_sqrt)
            if outs is not None:
                u.weights_written = True

    def _foreach(self, which: list[int], lr: float, scale: torch.Tensor | None) -> None:
        """torch.optim.AdamW's foreach algorithm, one unit at a time (its temporary: one denominator)."""
        b1, b2 = self.s.betas
        bc1 = 1 - b1 ** self.steps
        bc2_sqrt = math.sqrt(1 - b2 ** self.steps)
        for i in which:
            u, runs, (params, avgs, sqs) = self.units[i], self._runs[i], self._state[i]
            grads = self._split(u.os_grad, runs)
            if scale is not None:
                torch._foreach_div_(grads, scale)
            decaying = [p for p, (_, d) in zip(params, runs) if d]
            if self.s.weight_decay and decaying:
                torch._foreach_mul_(decaying, 1 - lr * self.s.weight_decay)
            torch._foreach_lerp_(avgs, grads, 1 - b1)
            torch._foreach_mul_(sqs, b2)
            torch._foreach_addcmul_(sqs, grads, grads, value=1 - b2)
            denom = torch._foreach_sqrt(sqs)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, self.s.eps)
            torch._foreach_addcdiv_(params, avgs, denom, value=-lr / bc1)
