"""Counted asynchronous collectives: the only path by which the engine talks to other ranks.

Every call records (phase, kind, bytes, group size, intra/inter node) into the current step's
statistics, with the byte convention of amsp/schedule.py (all_gather: its output, reduce_scatter:
its input, all_reduce: its tensor), so the accounting can be compared with the analytic schedule
exactly. The stall a wait() inserts is the exposed communication; the metrics logger reads it
from `CommStats`. How it is timed depends on what wait() does:
  * gloo (CPU): wait() blocks the host until the collective is done: host wall time around it.
  * NCCL (CUDA): wait() only makes the current stream wait for the collective's stream and returns
    at once, so host time reads ~0. Instead an event is recorded on the current stream before and
    one after the wait: the first completes when the compute launched before the wait is done,
    the second when the stream may go on, so the gap between them is exactly the time the stream
    stalled for communication. The pairs are kept pending and resolved when the statistics are
    read (after the step ended and its last event was waited for), so timing adds no sync.
The layout's permutation copies are timed the same way (host time on CPU, events on CUDA).

torch 2.13 names the tensor collectives all_gather_single / reduce_scatter_single and deprecates
all_gather_into_tensor / reduce_scatter_tensor; both are real collectives with async handles on
gloo (CPU) and NCCL, so no substitute is needed. Older torch falls back to the old names, logged.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .groups import process_group
from .routing_check import data_plane
from .topology import Topology

log = logging.getLogger(__name__)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_LOGGED = []
_LOGGED_TIMING = []


def log_timing_once(stream_timing: bool) -> None:
    if _LOGGED_TIMING:
        return
    _LOGGED_TIMING.append(True)
    log.info("exposed communication timed %s", "with CUDA events around each wait() (stream stall)"
             if stream_timing else "as host wall time blocked in wait()")


def log_algorithm_once(backend: str) -> None:
    if _LOGGED:
        return
    _LOGGED.append(True)
    log.info("collectives: torch.distributed.%s / %s / all_reduce, async handles, backend %s",
             _all_gather.__name__, _reduce_scatter.__name__, backend)


@dataclass
class CommStats:
    """One optimizer step's communication, as one rank saw it."""

    bytes: Counter = field(default_factory=Counter)  # (kind, group_size, 'intra'|'inter') -> bytes
    phase_bytes: Counter = field(default_factory=Counter)  # phase -> bytes
    calls: Counter = field(default_factory=Counter)  # (phase, kind) -> number of calls
    # Seconds by (what, phase): ("exposed", phase) stalled waiting for collectives, ("permute", "")
    # in the nesting layout's permutation copies. Read them through the properties below.
    _seconds: Counter = field(default_factory=Counter, repr=False)
    # CUDA: (key, event before, event after) not yet converted to seconds (see the module docstring).
    _pending: list = field(default_factory=list, repr=False)

    def add_seconds(self, key: tuple[str, str], seconds: float) -> None:
        self._seconds[key] += seconds

    def add_events(self, key: tuple[str, str], before: "torch.cuda.Event", after: "torch.cuda.Event") -> None:
        self._pending.append((key, before, after))

    def _resolved(self) -> Counter:
        for key, before, after in self._pending:
            after.synchronize()  # a no-op once the step's work is done, which is when stats are read
            self._seconds[key] += before.elapsed_time(after) / 1e3  # milliseconds
        self._pending.clear()
        return self._seconds

    @property
    def exposed_by_phase(self) -> Counter:
        return Counter({phase: s for (what, phase), s in self._resolved().items() if what == "exposed"})

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed_by_phase.values())

    @property
    def permute_s(self) -> float:
        return self._resolved()["permute", ""]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def inter_node_bytes(self) -> int:
        return sum(v for (_, _, where), v in self.bytes.items() if where == "inter")

    def as_metrics(self) -> dict[str, float]:
        """The keys amsp.metrics.MetricsLogger.record_step(comm=...) takes."""
        return {"bytes_intra_node": float(self.total_bytes - self.inter_node_bytes),
                "bytes_inter_node": float(self.inter_node_bytes), "exposed_s": self.exposed_s}


class Handle:
    """An in-flight collective; wait() books the stall it causes on the phase (see the module docstring).

    It holds the collective's tensors until wait(), as NCCL's work object does: a send buffer the
    caller drops (a unit's flat gradient after its reduce-scatter is launched) stays allocated while
    the collective may still read it, whatever the backend keeps. Without this, the fake backend of a
    pretend world (whose work holds nothing) freed it at once, and measured peaks on one GPU missed
    the bucket a real NCCL run holds in flight."""

    def __init__(self, comm: "Comm", work, phase: str, tensors: tuple[torch.Tensor, ...] = ()):
        self._comm, self._work, self.phase = comm, work, phase
        self._tensors = tensors

    def wait(self) -> None:
        if self._work is None:
            return
        with self._comm.timed(("exposed", self.phase)):
            self._work.wait()
        self._work, self._tensors = None, ()

    @property
    def done(self) -> bool:
        return self._work is None


class Comm:
    def __init__(self, topo: Topology, rank: int):
        self.topo, self.rank = topo, rank
        self.current = CommStats()
        # NCCL's wait() is a stream wait (on a "cpu:gloo,cuda:nccl" group too: the data plane is CUDA).
        self.stream_timing = dist.is_initialized() and "nccl" in str(dist.get_backend())
        if dist.is_initialized():
            log_algorithm_once(dist.get_backend())
            log_timing_once(self.stream_timing)

    def _record(self, phase: str, kind: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        where = "inter" if self.topo.crosses_nodes(ranks) else "intra"
        s = self.current
        s.bytes[(kind, len(ranks), where)] += nbytes
        s.phase_bytes[phase] += nbytes
        s.calls[(phase, kind)] += 1

    def _check(self, ranks: tuple[int, ...]) -> None:
        if len(ranks) < 2:
            raise ValueError("a collective over one rank is not communication; the caller must skip it")
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in group {ranks}")

    def book(self, phase: str, kind: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        """Count a collective on the current step ahead of its launch (then launched with booked=True):
        the spread of one step may be launched during the next step's forward."""
        self._record(phase, kind, nbytes, ranks)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...], phase: str,
                   booked: bool = False) -> Handle:
        self._check(ranks)
        if out.numel() != inp.numel() * len(ranks):
            raise ValueError(f"all_gather: output {out.numel()} != {len(ranks)} x input {inp.numel()}")
        if not booked:
            self._record(phase, "all_gather", out.numel() * out.element_size(), ranks)
        with data_plane():  # the routing checker's mark (amsp/routing_check.py)
            work = _all_gather(out, inp, group=process_group(ranks), async_op=True)
        return Handle(self, work, phase, (out, inp))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...], phase: str) -> Handle:
        self._check(ranks)
        if inp.numel() != out.numel() * len(ranks):
            raise ValueError(f"reduce_scatter: input {inp.numel()} != {len(ranks)} x output {out.numel()}")
        self._record(phase, "reduce_scatter", inp.numel() * inp.element_size(), ranks)
        with data_plane():
            work = _reduce_scatter(out, inp, group=process_group(ranks), async_op=True)
        return Handle(self, work, phase, (out, inp))

    def all_reduce(self, t: torch.Tensor, ranks: tuple[int, ...], phase: str) -> Handle:
        self._check(ranks)
        self._record(phase, "all_reduce", t.numel() * t.element_size(), ranks)
        whole_world = len(ranks) == (dist.get_world_size() if dist.is_initialized() else self.topo.world)
        group = None if whole_world else process_group(ranks)
        with data_plane():
            work = dist.all_reduce(t, group=group, async_op=True)
        return Handle(self, work, phase, (t,))

    @contextmanager
    def timed(self, key: tuple[str, str]):
        """Book the time the enclosed work takes (host time, or stream time between two events)."""
        stats = self.current
        if self.stream_timing:
            before = torch.cuda.Event(enable_timing=True)
            before.record()
            yield
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            stats.add_events(key, before, after)
        else:
            t0 = time.perf_counter()
            yield
            stats.add_seconds(key, time.perf_counter() - t0)

    def permute_timer(self):
        return self.timed(("permute", ""))

    def close_step(self) -> CommStats:
        done, self.current = self.current, CommStats()
        return done
