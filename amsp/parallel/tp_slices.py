"""Where a tensor-parallel rank's local parameter elements sit in the full parameter.

A parameter split by TP (a DTensor with one Shard(d) placement on the TP mesh dim, even split) holds,
on TP rank r, the global index range [r*L, (r+1)*L) of dim d (L = global size / tp). Flattened row-major,
a local element range [lo, hi) is a union of runs that are contiguous in the flattened full parameter:
one run per index of the dims before d, each `L * inner` long (inner = product of the dims after d).
The engine uses this to initialise its shards from the model's element-wise init (so values do not
depend on tp), the checkpoint writer to store logical, TP-independent tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPSlot:
    """One parameter's TP placement: `shard_dim` None means replicated over the TP group."""

    mesh: object  # the DeviceMesh the DTensor lives on
    placements: tuple  # its placements, kept to re-wrap the local views
    global_shape: torch.Size
    shard_dim: int | None
    tp: int
    tp_rank: int

    @property
    def replicated(self) -> bool:
        return self.shard_dim is None

    @property
    def local_shape(self) -> torch.Size:
        if self.shard_dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.shard_dim] //= self.tp
        return torch.Size(shape)

    def global_runs(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(local offset, global offset, length) runs covering local flattened elements [lo, hi)."""
        if self.shard_dim is None:
            return [(lo, lo, hi - lo)] if hi > lo else []
        d = self.shard_dim
        local = self.local_shape
        inner = math.prod(self.global_shape[d + 1:])
        run = local[d] * inner  # contiguous in both layouts
        full_row = self.global_shape[d] * inner
        runs = []
        pos = lo
        while pos < hi:
            outer, within = divmod(pos, run)
            n = min(run - within, hi - pos)
            runs.append((pos, outer * full_row + self.tp_rank * run + within, n))
            pos += n
        return runs


def tp_slot_of(param, mesh_dim: str = "tp") -> TPSlot | None:
    """The TP placement of a (possibly meta) parameter, or None for a plain tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    if len(param.placements) != 1 or (names and names[0] != mesh_dim):
        raise ValueError(f"only 1-D tensor-parallel placements are supported, got {param.placements} on {names}")
    pl = param.placements[0]
    shard_dim = None
    if isinstance(pl, Shard):
        shard_dim = pl.dim % param.dim()
        if param.shape[shard_dim] % mesh.size():
            raise ValueError(f"uneven tensor-parallel split of dim {shard_dim} of {tuple(param.shape)} over "
                             f"{mesh.size()} ranks")
    elif not pl.is_replicate():
        raise ValueError(f"unsupported tensor-parallel placement {pl} for a parameter")
    return TPSlot(mesh, tuple(param.placements), torch.Size(param.shape), shard_dim, mesh.size(),
                  mesh.get_local_rank())
