"""Throughput of a long preprocessing run, on stderr.

On a terminal one line is redrawn in place about twice a second; anywhere else (a batch job's log,
a pipe) a full line is written every `every` seconds, so a log file holds a readable history instead
of carriage-return noise. A final line is written at the end. Disabled, it prints nothing.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


class Progress:
    def __init__(self, enabled: bool = True, stream: TextIO | None = None, every: float = 30.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.enabled, self.stream, self.clock = enabled, stream or sys.stderr, clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.5 if self.tty else every
        self.documents = self.tokens = self.bytes = self.skipped = 0
        self.t0 = self._last = clock()

    def update(self, documents: int, tokens: int, nbytes: int, skipped: int = 0) -> None:
        """Add a chunk's counts (`skipped` is the running total of records dropped for empty text)."""
        self.documents += documents
        self.tokens += tokens
        self.bytes += nbytes
        self.skipped = skipped
        now = self.clock()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._write(self.line(now), final=False)

    def line(self, now: float | None = None) -> str:
        dt = max((self.clock() if now is None else now) - self.t0, 1e-9)
        skipped = f" | skipped {self.skipped:,} empty" if self.skipped else ""
        return (f"preprocess: {self.documents:,} docs ({_si(self.documents / dt)} docs/s) | "
                f"{_si(self.tokens)} tokens ({_si(self.tokens / dt)} tokens/s) | "
                f"{_si(self.bytes)}B text ({_si(self.bytes / dt)}B/s){skipped} | {dt:.1f} s")

    def close(self) -> None:
        """The final line (also after a failure, to show how far it got); nothing if nothing was read."""
        if self.enabled and (self.documents or self.skipped):
            self._write(self.line(), final=True)

    def _write(self, line: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
