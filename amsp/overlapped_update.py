"""The optimizer update overlapped with the next forward (EngineOptions.overlap_update).

After the step's norm (ShardedAdamW.prepare: the one host sync, the clip scale, the step count),
each unit's AdamW update waits until the unit is next needed instead of running all at once:
  * on CUDA every unit's update is queued at once on a side stream, in forward order, each followed
    by that unit's local spread (the bf16 copy of the master, when the unit's OS shard is its whole P
    shard) and an event; the unit's forward pre-hook makes the compute stream wait for its event.
    The updates (memory-bound) run beside the forward's first units (compute-bound GEMMs) instead of
    between the steps; only the first unit's waits in full.
  * on other devices there are no streams: each unit's update runs when the engine takes it, just
    before its spread, which is the same arithmetic in a different order (nothing to gain on a CPU;
    this is what the CPU tests exercise).
A unit's OS gradient is dropped when its update is taken, not at the end of step(): the update reads
it. Taking happens on the compute stream after the wait, so the caching allocator never reuses memory
the side stream may still read (the clip scale is held until the last unit is taken for the same
reason).
"""
from __future__ import annotations

from typing import Callable

import torch

from .flat_unit import FlatUnit
from .sharded_optim import PreparedStep, ShardedAdamW


class OverlappedUpdates:
    def __init__(self, optim: ShardedAdamW, units: list[FlatUnit], device: torch.device):
        self.optim, self.device = optim, device
        self._index = {id(u): i for i, u in enumerate(units)}  # position in optim.units
        self.stream: torch.cuda.Stream | None = None  # made at the first deferred step on CUDA
        self._prepared: PreparedStep | None = None
        self._pending: dict[int, torch.cuda.Event | None] = {}  # unit id -> its event (None: not run yet)

    def describe(self) -> str:
        if self.device.type == "cuda":
            return "overlapped with the next forward (a side CUDA stream, unit by unit in forward order)"
        return (f"deferred unit by unit to the next forward (no streams on {self.device.type}: same arithmetic, "
                f"no overlap)")

    @property
    def pending(self) -> int:
        return len(self._pending)

    def defer(self, prepared: PreparedStep, forward_order: list[FlatUnit],
              local_spread: Callable[[FlatUnit], bool]) -> None:
        """Queue every unit's update of a prepared (not skipped) step. On CUDA they are launched now on the
        side stream; a unit for which local_spread(u) holds also launches its spread there."""
        if self._pending:
            raise RuntimeError(f"AMSP: {len(self._pending)} units still hold the previous step's update")
        self._prepared = prepared
        if self.device.type != "cuda":
            self._pending = {id(u): None for u in forward_order}
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        # Everything the updates read (OS gradients, the clip scale, the step count) was written on the
        # compute stream before this point.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for u in forward_order:
                self.optim.update(prepared, [self._index[id(u)]])
                if local_spread(u):
                    u.launch_spread()
                done = torch.cuda.Event()
                done.record(self.stream)
                self._pending[id(u)] = done

    def take(self, u: FlatUnit) -> bool:
        """Make unit u's update visible to the compute stream (run it now where there are no streams)
        and drop its OS gradient. False when nothing was pending for u."""
        if id(u) not in self._pending:
            return False
        done = self._pending.pop(id(u))
        if done is None:
            self.optim.update(self._prepared, [self._index[id(u)]])
        else:
            torch.cuda.current_stream(self.device).wait_event(done)
        u.zero_grad_state()
        if not self._pending:
            self._prepared = None
        return True
