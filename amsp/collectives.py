"""Counted asynchronous collectives: the only path by which the engine talks to other ranks.

Every call records (phase, kind, bytes, group size, intra/inter node) into the current step's
statistics, with the byte convention of amsp/schedule.py (all_gather: its output, reduce_scatter:
its input, all_reduce: its tensor), so the accounting can be compared with the analytic schedule
exactly. Time spent blocked in wait() is the exposed communication; the metrics logger reads it
from `CommStats`.

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
from .topology import Topology

log = logging.getLogger(__name__)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_LOGGED = []


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
    exposed_s: float = 0.0  # wall time blocked waiting for collectives
    exposed_by_phase: Counter = field(default_factory=Counter)
    permute_s: float = 0.0  # time in the nesting layout's permutation copies

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
    """An in-flight collective; wait() blocks and books the blocked time on the phase."""

    def __init__(self, comm: "Comm", work, phase: str):
        self._comm, self._work, self.phase = comm, work, phase

    def wait(self) -> None:
        if self._work is None:
            return
        t0 = time.perf_counter()
        self._work.wait()
        dt = time.perf_counter() - t0
        self._work = None
        self._comm.current.exposed_s += dt
        self._comm.current.exposed_by_phase[self.phase] += dt

    @property
    def done(self) -> bool:
        return self._work is None


class Comm:
    def __init__(self, topo: Topology, rank: int):
        self.topo, self.rank = topo, rank
        self.current = CommStats()
        if dist.is_initialized():
            log_algorithm_once(dist.get_backend())

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

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...], phase: str) -> Handle:
        self._check(ranks)
        if out.numel() != inp.numel() * len(ranks):
            raise ValueError(f"all_gather: output {out.numel()} != {len(ranks)} x input {inp.numel()}")
        self._record(phase, "all_gather", out.numel() * out.element_size(), ranks)
        return Handle(self, _all_gather(out, inp, group=process_group(ranks), async_op=True), phase)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, ranks: tuple[int, ...], phase: str) -> Handle:
        self._check(ranks)
        if inp.numel() != out.numel() * len(ranks):
            raise ValueError(f"reduce_scatter: input {inp.numel()} != {len(ranks)} x output {out.numel()}")
        self._record(phase, "reduce_scatter", inp.numel() * inp.element_size(), ranks)
        return Handle(self, _reduce_scatter(out, inp, group=process_group(ranks), async_op=True), phase)

    def all_reduce(self, t: torch.Tensor, ranks: tuple[int, ...], phase: str) -> Handle:
        self._check(ranks)
        self._record(phase, "all_reduce", t.numel() * t.element_size(), ranks)
        group = None if len(ranks) == self.topo.world else process_group(ranks)
        return Handle(self, dist.all_reduce(t, group=group, async_op=True), phase)

    @contextmanager
    def permute_timer(self):
        t0 = time.perf_counter()
        yield
        self.current.permute_s += time.perf_counter() - t0

    def close_step(self) -> CommStats:
        done, self.current = self.current, CommStats()
        return done
