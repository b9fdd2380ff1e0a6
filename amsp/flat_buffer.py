"""The nesting layout of one unit's flat buffer (pure index arithmetic, no torch.distributed).

A unit's parameters are flattened, in module order, into one buffer of S elements (numel padded
to a multiple of os) cut into os equal chunks. Rank r sits at position q = r mod os of its OS
group, written q = a*g + c*p + b with b = q mod p (position in the P group), c = (q // p) mod (g/p)
and a = q // g (position in the stride-g G->OS group). Its OS shard is chunk

    chunk(b, c, a) = (b * (g/p) + c) * (os/g) + a          (reversed digits)

so the P shard of b is the contiguous run of chunks b*(os/p) .. (b+1)*(os/p), the G shard of
(b, c) is contiguous inside it, and the OS shard lies inside that (nesting). Consequences:
  * P all-gather over the P group (ascending b): plain, the output is the full buffer;
  * G->OS reduce-scatter over the stride-g group (ascending a): plain, on the G shard;
  * OS-replica all-reduce: plain (every member holds the same chunk);
  * G reduce-scatter over g consecutive ranks (group position c*p + b): the send buffer is the
    full gradient with its S/g blocks transposed from (b, c) order to (c, b) order;
  * spread all-gather over the stride-p group (ascending k = a*(g/p) + c): the received S/p
    buffer holds OS chunks in (a, c) order and is transposed to the P shard's (c, a) order.
The two transposes are one copy each (`grad_send_order`, `spread_to_p_order`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import Degrees


@dataclass(frozen=True)
class ShardLayout:
    numel: int  # real (unpadded) elements of the unit
    deg: Degrees

    @property
    def padded(self) -> int:
        return -(-self.numel // self.deg.os) * self.deg.os

    @property
    def chunk(self) -> int:
        """Elements per OS chunk (the OS shard size)."""
        return self.padded // self.deg.os

    @property
    def p_size(self) -> int:
        return self.padded // self.deg.p

    @property
    def g_size(self) -> int:
        return self.padded // self.deg.g

    def digits(self, rank: int) -> tuple[int, int, int]:
        """(b, c, a) of a global rank: P-group position, G-inside-P digit, G->OS position."""
        p, g, os_ = self.deg.p, self.deg.g, self.deg.os
        q = rank % os_
        return q % p, (q // p) % (g // p), q // g

    def os_chunk(self, rank: int) -> int:
        b, c, a = self.digits(rank)
        p, g, os_ = self.deg.p, self.deg.g, self.deg.os
        return (b * (g // p) + c) * (os_ // g) + a

    # ---- [start, end) element ranges in the full (unsharded) buffer ----
    def os_range(self, rank: int) -> tuple[int, int]:
        s = self.os_chunk(rank) * self.chunk
        return s, s + self.chunk

    def g_range(self, rank: int) -> tuple[int, int]:
        b, c, _ = self.digits(rank)
        s = (b * (self.deg.g // self.deg.p) + c) * self.g_size
        return s, s + self.g_size

    def p_range(self, rank: int) -> tuple[int, int]:
        b, _, _ = self.digits(rank)
        return b * self.p_size, (b + 1) * self.p_size

    def os_in_g(self, rank: int) -> tuple[int, int]:
        """The OS shard's range inside the rank's G shard."""
        return self.os_range(rank)[0] - self.g_range(rank)[0], self.os_range(rank)[1] - self.g_range(rank)[0]

    def os_in_p(self, rank: int) -> tuple[int, int]:
        return self.os_range(rank)[0] - self.p_range(rank)[0], self.os_range(rank)[1] - self.p_range(rank)[0]

    def g_in_p(self, rank: int) -> tuple[int, int]:
        return self.g_range(rank)[0] - self.p_range(rank)[0], self.g_range(rank)[1] - self.p_range(rank)[0]

    # ---- the two permutation copies ----
    def grad_send_order(self, full: torch.Tensor) -> torch.Tensor:
        """Full gradient (buffer order) -> G reduce-scatter input (block j = c*p + b is G shard (b, c))."""
        p, g = self.deg.p, self.deg.g
        if p == 1 or p == g:
            return full  # (b, c) and (c, b) orders coincide when one digit is trivial
        return full.view(p, g // p, self.g_size).transpose(0, 1).reshape(-1)

    def spread_to_p_order(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Spread all-gather output ((a, c) chunk order) -> the P shard ((c, a) order), into `out`."""
        p, g, os_ = self.deg.p, self.deg.g, self.deg.os
        if g == p or g == os_:
            out.copy_(gathered)
            return
        out.view(g // p, os_ // g, self.chunk).copy_(gathered.view(os_ // g, g // p, self.chunk).transpose(0, 1))

    def spread_needs_permute(self) -> bool:
        return not (self.deg.g == self.deg.p or self.deg.g == self.deg.os)
