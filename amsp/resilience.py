"""Keeping a long run alive and honest: preemption signals, non-finite steps, dead or hung ranks.

- Preemption: SIGUSR1 (Slurm's --signal before the time limit), SIGUSR2 (submitit) and SIGTERM
  (preemption, scancel)
  only set a flag; the loop checks it once per step with one tiny all_reduce on the control plane
  (amsp.control: a CPU group, never NCCL), so every rank stops after the same step, saves a
  checkpoint, and exits.
- Non-finite loss or gradient: the engine skips the update; SkipGuard counts consecutive skips
  and ends the run after K of them, after a checkpoint of the last good state.
- Dead or hung ranks: collectives carry a timeout; every rank publishes the step it is on to the
  rendezvous store, so when a collective fails the survivors can name the rank that fell behind.
- Fault injection (`debug.*` in the config) makes these paths testable end to end.
"""
from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from . import control
from .errors import FaultError

log = logging.getLogger(__name__)


class PreemptionHandler:
    # USR1: Slurm's --signal before the time limit; USR2: submitit's timeout signal; TERM: preemption.
    SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int = 0
        self._previous = {}
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed_signal(self) -> int:
        """The signal any rank received (0 if none). Collective: all ranks call it every step."""
        return control.all_reduce_max_int(self.received)


class TooManySkippedSteps(FaultError):
    """The run stopped after K consecutive non-finite steps (a checkpoint of the last good state
    was written first)."""


class SkipGuard:
    """Counts skipped (non-finite) updates; raises after `limit` consecutive ones."""

    def __init__(self, limit: int, total: int = 0) -> None:
        if limit < 1:
            raise ValueError(f"trainer.max_consecutive_skips must be >= 1, got {limit}")
        self.limit, self.total, self.consecutive = limit, total, 0

    def record(self, skipped: bool, step: int, grad_norm: float) -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        log.warning("step %d: non-finite loss or gradient (grad norm %s); update skipped (%d in a row, %d in all)",
                    step, grad_norm, self.consecutive, self.total)

    @property
    def exhausted(self) -> bool:
        return self.consecutive >= self.limit


class Heartbeat:
    """Each rank writes the step it started to the rendezvous store; survivors read who lags."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.store = dist.distributed_c10d._get_default_store() if dist.is_initialized() and world > 1 else None

    def beat(self, step: int) -> None:
        if self.store is not None:
            self.store.set(f"amsp/heartbeat/{self.rank}", str(step))

    def laggards(self, step: int) -> str:
        """Best-effort description of ranks that did not reach `step` (the store may be gone too)."""
        if self.store is None:
            return "unknown"
        try:
            self.store.set_timeout(timedelta(seconds=5))
            behind = []
            for r in range(self.world):
                key = f"amsp/heartbeat/{r}"
                seen = int(self.store.get(key)) if self.store.check([key]) else -1
                if seen < step:
                    behind.append(f"rank {r} (last started step {seen + 1 if seen >= 0 else 'none'})")
            return ", ".join(behind) or "none behind: a rank died inside this step"
        except Exception as e:  # the store lives on a rank/agent that may have died as well
            return f"unknown (rendezvous store unreachable: {type(e).__name__})"


def die_now(message: str, code: int = 1) -> None:
    """Exit immediately without waiting on peers (destroying a process group can block on a dead rank)."""
    log.error(message)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(code)


class NaNInjector:
    """Fault injection for tests: make the loss non-finite on chosen steps via a hook on the head."""

    def __init__(self, model: torch.nn.Module, steps: list[int]) -> None:
        self.steps, self.current = set(steps), -1
        self.handle = model.head.register_forward_hook(self._hook) if self.steps else None
        if self.steps:
            log.warning("fault injection: non-finite loss at steps %s", sorted(self.steps))

    def _hook(self, module, args, output):
        return output * float("nan") if self.current in self.steps else output
