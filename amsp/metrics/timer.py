"""Step-time breakdown: the loop wraps its parts in named phases; each step's times are kept.

Two equivalent ways to mark phases: `with timer.phase(name):` around a part, or `timer.lap(name)`
right after a part, which charges the time since the step start or the previous lap/phase to it
(one inserted line per part, so a loop needs no re-indentation).

Every mark is a point on a clock; a phase is the span between two marks, resolved at end_step():
  * CPU: host perf_counter.
  * CUDA: an event recorded on the device's current stream. Work is asynchronous, so a host
    clock would only measure launch time, and synchronising at every mark (what this timer once
    did) serialises the compute/communication overlap it is meant to measure. An event's
    timestamp is when the stream reaches it: the end of the work launched before the mark, or the
    mark itself when the stream is idle. Consecutive marks therefore partition the step's stream
    timeline, and the phases (laps) add up to the step. end_step() waits for the step's last event
    only: one event.synchronize() per step, which the loop's loss/log path needs anyway.
    Marks are meant to be on one stream (the default one); the step's last event completing then
    implies every earlier one did.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

PHASES = ("data_wait", "forward_backward", "optimizer")


class _HostClock:
    def __init__(self, sync: Callable[[], None] | None = None):
        # `sync` (e.g. torch.cuda.synchronize) makes every mark a device barrier: the old behaviour,
        # kept for callers that ask for it explicitly.
        self._sync = sync

    def mark(self) -> float:
        if self._sync:
            self._sync()
        return time.perf_counter()

    def wait(self, mark: float) -> None:
        pass

    @staticmethod
    def seconds(a: float, b: float) -> float:
        return b - a


class _CudaEventClock:
    def __init__(self, device: torch.device):
        self._device = device

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self._device))
        return ev

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()

    @staticmethod
    def seconds(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        return a.elapsed_time(b) / 1e3  # milliseconds


class StepTimer:
    def __init__(self, device: torch.device | str | None = None, phases: tuple[str, ...] = PHASES, *,
                 sync: Callable[[], None] | None = None):
        """device: CUDA -> event timing; CPU or None -> perf_counter (with `sync` called at every
        mark when given: an explicitly synchronising host timer)."""
        device = torch.device(device) if device is not None else None
        if device is not None and device.type == "cuda":
            if sync is not None:
                raise ValueError("StepTimer: sync= is for the host clock; a CUDA device is timed with events")
            self._clock: Any = _CudaEventClock(device)
        else:
            self._clock = _HostClock(sync)
        self.phases = phases
        self._start: Any = None
        self._last: Any = None
        self._spans: list[tuple[str, Any, Any]] = []  # (phase, start mark, end mark), resolved at end_step

    def start_step(self) -> None:
        self._start = self._last = self._clock.mark()
        self._spans = []

    def lap(self, name: str) -> None:
        """Charge the time since the previous mark (step start, lap or phase end) to `name`."""
        self._check(name)
        now = self._clock.mark()
        self._spans.append((name, self._last, now))
        self._last = now

    def _check(self, name: str) -> None:
        if self._start is None:
            raise RuntimeError("StepTimer used outside a step: call start_step() first")
        if name not in self.phases:
            raise KeyError(f"unknown step phase {name!r}; known: {', '.join(self.phases)}")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one part of the step; a phase may be entered several times (per micro-batch)."""
        self._check(name)
        begin = self._clock.mark()
        try:
            yield
        finally:
            self._last = self._clock.mark()
            self._spans.append((name, begin, self._last))

    def end_step(self) -> dict[str, float]:
        """Seconds per phase for the step just finished, plus `step` (the whole step's time)."""
        if self._start is None:
            raise RuntimeError("StepTimer.end_step() without start_step()")
        end = self._clock.mark()
        self._clock.wait(end)
        out = dict.fromkeys(self.phases, 0.0)
        for name, a, b in self._spans:
            out[name] += self._clock.seconds(a, b)
        out["step"] = self._clock.seconds(self._start, end)
        self._start = self._last = None
        self._spans = []
        return out
