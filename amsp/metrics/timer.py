"""Step-time breakdown: the loop wraps its parts in named phases; each step's times are kept.

Two equivalent ways to mark phases: `with timer.phase(name):` around a part, or `timer.lap(name)`
right after a part, which charges the time since the step start or the previous lap/phase to it
(one inserted line per part, so a loop needs no re-indentation).

On CUDA the work is asynchronous, so a phase boundary synchronises the device (sync=True) to
charge kernels to the phase that launched them. That costs a little overlap between phases,
which is why it can be switched off (then the phase times only measure launch time).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

PHASES = ("data_wait", "forward_backward", "optimizer")


class StepTimer:
    def __init__(self, sync: Callable[[], None] | None = None, phases: tuple[str, ...] = PHASES):
        self._sync = sync
        self.phases = phases
        self._t0: float | None = None
        self._last = 0.0
        self._acc: dict[str, float] = {}

    def start_step(self) -> None:
        if self._sync:
            self._sync()
        self._t0 = time.perf_counter()
        self._last = self._t0
        self._acc = dict.fromkeys(self.phases, 0.0)

    def lap(self, name: str) -> None:
        """Charge the time since the previous mark (step start, lap or phase end) to `name`."""
        self._check(name)
        if self._sync:
            self._sync()
        now = time.perf_counter()
        self._acc[name] += now - self._last
        self._last = now

    def _check(self, name: str) -> None:
        if self._t0 is None:
            raise RuntimeError("StepTimer used outside a step: call start_step() first")
        if name not in self._acc:
            raise KeyError(f"unknown step phase {name!r}; known: {', '.join(self.phases)}")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one part of the step; a phase may be entered several times (per micro-batch)."""
        self._check(name)
        if self._sync:
            self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                self._sync()
            self._last = time.perf_counter()
            self._acc[name] += self._last - t0

    def end_step(self) -> dict[str, float]:
        """Seconds per phase for the step just finished, plus `step` (the whole step's wall time)."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.end_step() without start_step()")
        if self._sync:
            self._sync()
        out = dict(self._acc)
        out["step"] = time.perf_counter() - self._t0
        self._t0 = None
        return out
