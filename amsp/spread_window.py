"""The parameter spread after a step: a bounded window of units in forward order.

Every unit's spread is booked on the step that queued it; at most `window` units have one in flight
(each holds a received S/p buffer, plus the master's cast in bf16), launched in forward order, each
completion launching the next, so the next unit's spread overlaps this unit's forward. A unit's deferred
optimizer update (amsp/overlapped_update.py) is taken just before its spread launches: the spread sends
the new master. Spreads already launched with their update (local copies on the update stream) are not
queued: they hold no buffer, so they take no place in the window.
"""
from __future__ import annotations

from .flat_unit import FlatUnit
from .overlapped_update import OverlappedUpdates


class SpreadWindow:
    def __init__(self, forward_order: list[FlatUnit], window: int, updates: OverlappedUpdates):
        self.order, self.window, self.updates = forward_order, window, updates
        self._queued: list[FlatUnit] = []  # forward order, spread not launched yet
        self._in_flight: list[FlatUnit] = []  # forward order, at most `window`

    def start(self) -> None:
        """Queue every unit's spread, book all of them on this step, launch the first window of them."""
        for u in self.order:
            u.book_spread()
        self._queued = [u for u in self.order if not u.spread_pending]
        self._fill()

    def _fill(self) -> None:
        while self._queued and len(self._in_flight) < self.window:
            u = self._queued.pop(0)
            self.updates.take(u)  # a deferred update first: the spread sends the new master
            u.launch_spread()  # booked on its step by start()
            self._in_flight.append(u)

    def ensure_fresh(self, u: FlatUnit, steps: int) -> None:
        """Complete spreads oldest first up to unit u, then check that u holds the weights of `steps`
        optimizer steps (the guard against running on stale weights)."""
        while u in self._in_flight or u in self._queued:
            oldest = self._in_flight.pop(0)
            oldest.finish_spread()
            self._fill()
        if self.updates.take(u):  # its spread was launched with its update, on the update stream
            u.finish_spread()
        if u.version != steps:
            raise RuntimeError(f"AMSP guard: unit {u.name} holds weights of optimizer step {u.version} but "
                               f"{steps} steps were applied; refusing to run on stale weights")
