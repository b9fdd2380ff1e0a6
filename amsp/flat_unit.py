"""One unit's sharded state and the collectives that move it (no hooks, no scheduling here).

Resident per rank (S = padded numel):
  p_shard     S/p  compute dtype   the rank's parameter shard (the full weights when p == 1)
  g_shard     S/g  fp32            gradient accumulation across micro-batches
  master, exp_avg, exp_avg_sq  S/os fp32   optimizer state
Transient: `full` (S, compute dtype, only when p > 1) holds the gathered weights between a gather
and the matching free; its storage is resized to 0 when freed, so the parameter views and the
tensors autograd saved in forward keep pointing at it and see the re-gathered data in backward.
With fp32 compute weights the master is not a tensor of its own but a view of the rank's OS chunk
inside its P shard (nesting puts it there): the optimizer then updates that chunk of the weights in
place and the spread brings the rest. The memory is exactly (param_bytes/p + 4/g +
Precision.optim_bytes/os) per element: 4/p + 4/g + 8/os in fp32, 2/p + 4/g + 12/os in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from .collectives import Comm, Handle
from .flat_buffer import ShardLayout
from .grad_accumulate import accumulate
from .grad_accumulate import native_available as native_accumulate_available
from .groups import UnitGroups
from .plan import Degrees
from .wgrad_fusion import wgrad_into
from .parallel.tp_slices import TPSlot


@dataclass
class ParamSlot:
    name: str  # full name in the model, e.g. "layers.0.attention.wq.weight"
    module: nn.Module
    attr: str
    shape: torch.Size
    offset: int  # start in the unit's flat buffer
    decays: bool
    # Tensor parallelism (amsp/parallel/tp_slices.py): the unit holds the rank's local shard (`shape` is the
    # local shape); the parameter is installed as a DTensor over that view with the same placement.
    tp: "TPSlot | None" = None
    # Whether this rank's copy counts in the global gradient norm: a parameter replicated over a TP group
    # (a Replicate DTensor, or a plain tensor when the model is tensor-parallel elsewhere) holds the same
    # gradient on each of the group's ranks, so only TP rank 0 counts it.
    norm_counted: bool = True

    @property
    def numel(self) -> int:
        return self.shape.numel()


class FlatUnit:
    def __init__(self, name: str, group: str, modules: list[nn.Module], slots: list[ParamSlot], deg: Degrees,
                 groups: UnitGroups, rank: int, world: int, compute_dtype: torch.dtype, grad_dtype: torch.dtype,
                 device: torch.device, comm: Comm):
        self.name, self.group, self.modules, self.slots, self.deg = name, group, modules, slots, deg
        self.groups, self.rank, self.world, self.comm = groups, rank, world, comm
        self.compute_dtype, self.grad_dtype, self.device = compute_dtype, grad_dtype, device
        self.layout = ShardLayout(sum(s.numel for s in slots), deg)
        lay = self.layout
        self.p_shard = torch.empty(lay.p_size, dtype=compute_dtype, device=device)
        self.g_shard = torch.zeros(lay.g_size, dtype=torch.float32, device=device)
        # After a step the G shard holds the last step's gradients; the next step's first gradients
        # overwrite them rather than being added to a zeroed buffer (one pass less, and no read).
        # Padding past the last slot is never written: it stays zero from here.
        self._g_stale = False
        self._native_acc = native_accumulate_available(device)
        self.os_lo, self.os_hi = lay.os_range(rank)
        self.master_is_weights = compute_dtype == torch.float32
        if self.master_is_weights:
            lo, hi = lay.os_in_p(rank)
            self.master = self.p_shard[lo:hi]
        else:
            self.master = torch.empty(lay.chunk, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(lay.chunk, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(lay.chunk, dtype=torch.float32, device=device)
        self.decay_segments = self._segments_where(lambda slot: slot.decays)
        # OS-local ranges left out of the gradient norm (TP-replicated copies on TP ranks other than 0)
        self.norm_excluded = self._segments_where(lambda slot: not slot.norm_counted)
        self.replicas = world // deg.os  # ranks holding the same OS shard
        self._flat, self._flat_filled = None, 0  # this micro-batch's reduce-scatter input while grads arrive
        # Offsets of slots whose gradient this backward's GEMM already wrote (fused_wgrad): their hook only drops
        self._wgrad_taken: set[int] = set()
        # Set by the optimizer's csrc kernel when its update wrote the compute weights (os = p), consumed by
        # the spread that follows every update
        self.weights_written = False
        if deg.p > 1:
            self.full = torch.empty(lay.padded, dtype=compute_dtype, device=device)
            self.full.untyped_storage().resize_(0)
            # Writes go through a separate alias: autograd's version counter of the parameter
            # views must not see the refill (the saved tensors are valid again once it lands).
            self._full_writer = torch.empty(0, dtype=compute_dtype, device=device).set_(
                self.full.untyped_storage(), 0, (lay.padded,))
        else:
            self.full = self.p_shard
        self.gathered = deg.p == 1
        self._gather: Handle | None = None
        self._grad_rs: tuple[Handle, torch.Tensor] | None = None
        self._os_rs: tuple[Handle, torch.Tensor] | None = None
        self._replica: tuple[Handle, torch.Tensor] | None = None
        self._spread: tuple[Handle, torch.Tensor] | None = None
        self.os_grad: torch.Tensor | None = None  # fp32 S/os gradient after the step's sync
        self.version = 0  # optimizer steps whose result this unit's p_shard holds

    # ---- construction ----
    def _segments_where(self, keep: Callable[[ParamSlot], bool]) -> list[tuple[int, int]]:
        """[start, end) ranges, local to the OS shard, of the parameters `keep` selects (e.g. those that
        take weight decay)."""
        segs = []
        for s in self.slots:
            lo, hi = max(s.offset, self.os_lo), min(s.offset + s.numel, self.os_hi)
            if keep(s) and lo < hi:
                segs.append((lo - self.os_lo, hi - self.os_lo))
        return segs

    @torch.no_grad()
    def fill_shards(self, fill: Callable[[ParamSlot, int, int, torch.Tensor], None]) -> None:
        """Initialise the P shard, and the fp32 master when it is a tensor of its own, from the
        slices of parameters that overlap them: fill(slot, start, end, out) writes elements
        [start, end) of the slot's flattened parameter into the 1-D tensor `out` (in out's dtype).
        The padding past the last parameter is zero. Nothing the size of the unit is allocated."""
        lay = self.layout
        targets = [(self.p_shard, *lay.p_range(self.rank))]
        if not self.master_is_weights:
            targets.append((self.master, self.os_lo, self.os_hi))
        for buf, lo, hi in targets:
            for s in self.slots:
                a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
                if a < b:
                    fill(s, a - s.offset, b - s.offset, buf[a - lo:b - lo])
            buf[max(lay.numel, lo) - lo:].zero_()

    def install_params(self) -> None:
        """Replace each (meta) parameter by a Parameter viewing the unit's gathered buffer."""
        for s in self.slots:
            view = self.full[s.offset:s.offset + s.numel].view(s.shape)
            if s.tp is not None:
                view = _as_dtensor(view, s.tp)
            setattr(s.module, s.attr, nn.Parameter(view, requires_grad=True))

    def param(self, slot: ParamSlot) -> nn.Parameter:
        return getattr(slot.module, slot.attr)

    # ---- memory ----
    def resident_bytes(self) -> dict[str, int]:
        def b(t):
            return t.numel() * t.element_size()
        master = 0 if self.master_is_weights else b(self.master)  # else counted in p
        return {"p": b(self.p_shard), "g": b(self.g_shard), "os": master + b(self.exp_avg) + b(self.exp_avg_sq)}

    def release(self) -> int:
        """Free the memory of every tensor this unit owns (its storages shrink to nothing, so views that
        others still hold, the model's parameters and the optimizer's splits, no longer pin it). The unit
        is unusable afterwards. No collective may be in flight into these buffers. Returns the bytes of
        storages that cannot shrink (a storage some code exposed through Tensor.numpy() is marked
        non-resizable by torch): those are freed only with their last reference."""
        kept = 0
        for t in (self.p_shard, self.g_shard, self.master, self.exp_avg, self.exp_avg_sq, self.full, self._flat,
                  self.os_grad):
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.resizable():
                storage.resize_(0)
            else:
                kept += storage.nbytes()
        self._flat, self.os_grad, self.gathered = None, None, False
        return kept

    # ---- P gather / free ----
    def start_gather(self, phase: str) -> None:
        if self.gathered or self._gather is not None:
            return
        self.full.untyped_storage().resize_(self.layout.padded * self.full.element_size())
        self._gather = self.comm.all_gather(self._full_writer, self.p_shard, self.groups.p, phase)

    def wait_gather(self, phase: str) -> None:
        if self.gathered:
            return
        if self._gather is None:
            self.start_gather(phase)
        self._gather.wait()
        self._gather, self.gathered = None, True

    def free(self) -> None:
        if self.deg.p == 1 or not self.gathered:
            return
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    # ---- gradients ----
    def take_grad(self, s: ParamSlot, param: nn.Parameter, first: bool) -> None:
        """One parameter's gradient for this micro-batch leaves autograd as soon as it is accumulated
        (the engine's post-accumulate hook), so a unit's gradient is never held twice. With g = 1 it
        is added straight into the G shard (the whole buffer: nothing to send); otherwise it is copied
        into the unit's flat reduce-scatter buffer, allocated at the unit's first gradient. Copying
        only once every gradient had arrived held the unit's autograd gradients and the flat copy at
        once: the head's 2 x 47 MiB was the peak of the last pipeline stage at tp 2. `first`: the
        unit's first gradient of this backward (a buffer left by an interrupted one is dropped)."""
        if param.grad is None:
            raise RuntimeError(f"{s.name} received no gradient in this backward")
        if s.offset in self._wgrad_taken:  # fused_wgrad wrote it; autograd's tensor is a placeholder
            self._wgrad_taken.discard(s.offset)
            self._flat_filled += self.deg.g > 1
            param.grad = None
            return
        if first:
            self._begin_backward()
        grad = param.grad if s.tp is None else _local_grad(param.grad, s.tp)
        if self.deg.g == 1:
            accumulate(self.g_shard[s.offset:s.offset + s.numel], grad, self._g_stale, self._native_acc)
        else:
            if self._flat is None:
                self._flat = torch.empty(self.layout.padded, dtype=self.grad_dtype, device=self.device)
            self._flat[s.offset:s.offset + s.numel].copy_(grad.reshape(-1))
            self._flat_filled += 1
        param.grad = None

    def _begin_backward(self) -> None:
        """The unit's first gradient of a backward: what an interrupted one left is dropped."""
        self._flat, self._flat_filled = None, 0
        self._wgrad_taken.clear()

    def fused_wgrad(self, s: ParamSlot, gy: torch.Tensor, x: torch.Tensor, first: bool) -> None:
        """A linear layer's weight gradient gy^T @ x computed straight into where take_grad would have put
        it (amsp/wgrad_fusion.py): the G shard with g = 1 (written over on the step's first micro-batch,
        else added), else the unit's reduce-scatter buffer. Its parameter hook follows and only drops
        autograd's placeholder. `first`: as take_grad's."""
        if first:
            self._begin_backward()
        if self.deg.g == 1:
            dest, overwrite = self.g_shard[s.offset:s.offset + s.numel], self._g_stale
        else:
            if self._flat is None:
                self._flat = torch.empty(self.layout.padded, dtype=self.grad_dtype, device=self.device)
            dest, overwrite = self._flat[s.offset:s.offset + s.numel], True
        wgrad_into(dest.view(s.shape), gy, x, overwrite)
        self._wgrad_taken.add(s.offset)

    def take_flat_grads(self) -> torch.Tensor | None:
        """After the unit's last take_grad: the flat buffer for launch_grad_reduce (padding zeroed), or
        None with g = 1 (already in the G shard)."""
        if self.deg.g == 1:
            self._g_stale = False  # every slot was written in this backward
            return None
        flat, filled, self._flat = self._flat, self._flat_filled, None
        if flat is None or filled != len(self.slots):
            raise RuntimeError(f"unit {self.name}: {filled} of {len(self.slots)} gradients arrived in this backward")
        used = self.slots[-1].offset + self.slots[-1].numel
        flat[used:].zero_()
        return flat

    def launch_grad_reduce(self, flat: torch.Tensor) -> None:
        """Reduce-scatter take_flat_grads' buffer over the G group (g > 1)."""
        with self.comm.permute_timer():
            send = self.layout.grad_send_order(flat)
        out = torch.empty(self.layout.g_size, dtype=self.grad_dtype, device=self.device)
        self._grad_rs = (self.comm.reduce_scatter(out, send, self.groups.g, "grad"), out)

    def finish_grad_reduce(self) -> None:
        if self._grad_rs is None:
            return
        handle, out = self._grad_rs
        handle.wait()
        accumulate(self.g_shard, out, self._g_stale, False)  # out is fp32 or the grad dtype: torch's ops
        self._g_stale = False
        self._grad_rs = None

    def launch_os_reduce(self) -> None:
        """Last micro-batch: G shard -> OS shard inside the OS group (stride-g ranks)."""
        lay = self.layout
        if self._g_stale:
            raise RuntimeError(f"unit {self.name}: its gradient sync started before any gradient of this step arrived")
        if self.deg.os == self.deg.g:
            self._os_rs = (None, self.g_shard)
            return
        send = self.g_shard if self.grad_dtype == torch.float32 else self.g_shard.to(self.grad_dtype)
        out = torch.empty(lay.chunk, dtype=self.grad_dtype, device=self.device)
        self._os_rs = (self.comm.reduce_scatter(out, send, self.groups.g_to_os, "grad_to_os"), out)

    def launch_replica_reduce(self) -> None:
        """All-reduce the OS-shard gradient across the OS replicas (the only traffic that must
        cross nodes when os fills whole nodes)."""
        handle, shard = self._os_rs
        if handle is not None:
            handle.wait()
        self._os_rs = None
        if shard.dtype != self.grad_dtype:
            shard = shard.to(self.grad_dtype)
        if self.replicas == 1:
            self._replica = (None, shard)
            return
        self._replica = (self.comm.all_reduce(shard, self.groups.os_replica, "grad_replica"), shard)

    def finish_sync(self) -> None:
        if self._replica is None and self.os_grad is not None:
            return  # already waited (synchronous gradient reduction)
        handle, shard = self._replica
        if handle is not None:
            handle.wait()
        self._replica = None
        self.os_grad = shard if shard.dtype == torch.float32 else shard.float()

    def zero_grad_state(self) -> None:
        self._g_stale = True  # the next backward overwrites the G shard (see __init__)
        self.os_grad = None

    # ---- parameter spread ----
    # The engine keeps at most a window of units with a spread in flight (amsp.engine); what one
    # holds from launch to finish is the spread's transient: the received S/p buffer and, in bf16,
    # the master's cast to the compute dtype (in fp32 the cast is the master itself).
    @torch.no_grad()
    def launch_spread(self) -> None:
        if self.deg.os == self.deg.p:
            # The OS shard is the whole P shard: nothing to gather. Write it now (no transient);
            # nobody reads this P shard before the unit's next forward, which finish_spread gates.
            # The optimizer's csrc kernel may have written it already, in the update's own pass.
            if not self.master_is_weights and not self.weights_written:
                self.p_shard.copy_(self.master)
            self.weights_written = False
            self._spread = (None, None)
            return
        src = self.master.to(self.compute_dtype)
        recv = torch.empty(self.layout.p_size, dtype=self.compute_dtype, device=self.device)
        # Booked on its step by book_spread when the engine queued it.
        self._spread = (self.comm.all_gather(recv, src, self.groups.spread, "spread", booked=True), recv)

    @torch.no_grad()
    def finish_spread(self) -> None:
        if self._spread is None:
            return
        handle, recv = self._spread
        if handle is not None:
            handle.wait()
        if recv is not None:
            with self.comm.permute_timer():
                self.layout.spread_to_p_order(recv, self.p_shard)
        self._spread = None
        self.version += 1

    def book_spread(self) -> None:
        """Book this unit's spread all-gather on the comm's current step. The engine books a step's
        spreads when step() queues them, so the step's statistics hold its whole spread even when the
        window launches part of it during the next forward."""
        if self.deg.os != self.deg.p:
            self.comm.book("spread", "all_gather", self.layout.p_size * self.p_shard.element_size(),
                           self.groups.spread)

    def spread_transient_bytes(self) -> int:
        """Bytes a spread of this unit holds while in flight (what the planner's window term counts)."""
        if self.deg.os == self.deg.p:
            return 0
        cast = 0 if self.master_is_weights else self.layout.chunk
        return (self.layout.p_size + cast) * self.p_shard.element_size()

    @property
    def spread_pending(self) -> bool:
        return self._spread is not None


def _as_dtensor(view: torch.Tensor, tp: TPSlot) -> torch.Tensor:
    """A DTensor whose local tensor is the view itself (no copy, same storage), so the gathered buffer's
    free/refill reaches it as it reaches plain parameter views."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return DTensor.from_local(view, tp.mesh, tp.placements, run_check=False, shape=tp.global_shape,
                                  stride=torch.empty(tp.global_shape, device="meta").stride())


def _local_grad(grad: torch.Tensor, tp: TPSlot) -> torch.Tensor:
    """The rank's piece of a DTensor gradient in the parameter's own placement. A replicated weight used
    on sequence-parallel activations gets a Partial gradient (each rank summed over its own positions):
    it is reduced over the TP group here, before the data-parallel reduction."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != tuple(tp.placements):
        from .routing_check import data_plane

        with data_plane():
            grad = grad.redistribute(tp.mesh, tp.placements)
    return grad.to_local()
