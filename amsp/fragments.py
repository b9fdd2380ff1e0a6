"""Per-parameter views of a rank's optimizer shard: the interface for checkpoint writers.

A parameter's flattened data [0, numel) is split across OS shards; the piece this rank holds is a
Fragment: [start, end) in the parameter's flattened coordinates and views of the fp32 master and
Adam moments. Every piece is held by N/os replicas; the one with OS-replica index 0 (global rank
< os) is the primary, so a writer that saves primaries only saves every element exactly once.
Loading writes the same views and then re-spreads the compute weights (collective: all ranks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .flat_unit import FlatUnit
from .parallel.tp_slices import TPSlot


@dataclass(frozen=True)
class Fragment:
    name: str  # parameter name in the model, e.g. "layers.0.attention.wq.weight"
    unit: str
    shape: torch.Size  # full parameter shape
    numel: int
    start: int  # [start, end) of the parameter's flattened data held here
    end: int
    primary: bool  # OS-replica index 0: the copy a checkpoint writer saves
    master: torch.Tensor  # fp32 views into the OS shard, end - start elements each
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    # Tensor parallelism: `shape`, `numel`, `start`/`end` are of the rank's local shard, and this maps them
    # into the full parameter (amsp/parallel/tp_slices.py). None: the parameter is whole on this rank.
    tp: TPSlot | None = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.shape) if self.tp is None else tuple(self.tp.global_shape)

    STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def unit_fragments(u: FlatUnit) -> list[Fragment]:
    out = []
    for s in u.slots:
        lo, hi = max(s.offset, u.os_lo), min(s.offset + s.numel, u.os_hi)
        if lo >= hi:
            continue
        a, b = lo - u.os_lo, hi - u.os_lo
        # A TP-replicated copy is written by TP rank 0 only (norm_counted marks the one copy).
        out.append(Fragment(s.name, u.name, s.shape, s.numel, lo - s.offset, hi - s.offset,
                            u.rank < u.deg.os and s.norm_counted, u.master[a:b], u.exp_avg[a:b], u.exp_avg_sq[a:b],
                            s.tp))
    return out


@torch.no_grad()
def load_fragment(frag: Fragment, values: dict[str, torch.Tensor]) -> None:
    """Copy saved values (each the fragment's [start, end) piece, any shape) into the shard."""
    for key in Fragment.STATE_KEYS:
        if key not in values:
            raise KeyError(f"{frag.name}: missing {key!r} when loading (have {sorted(values)})")
        src = values[key].reshape(-1)
        if src.numel() != frag.end - frag.start:
            raise ValueError(f"{frag.name}.{key}: expected {frag.end - frag.start} elements "
                             f"([{frag.start}, {frag.end}) of {frag.numel}), got {src.numel()}")
        getattr(frag, key).copy_(src)
