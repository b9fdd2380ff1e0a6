"""Weight initialisation that any slice of any parameter can be computed from on its own.

Element i of parameter `name` depends only on (seed, name, i) and the config: the parameter's
flattened index space is cut into fixed chunks of CHUNK elements, and chunk c is drawn from a
generator seeded by (seed, crc32(name), c). A data-parallel wrapper can therefore initialise
exactly the ranges a rank holds, on its own device, and get the same values as the whole model
built in one process, whatever the plan, world size or rank. Drawing one chunk never needs more
than CHUNK fp32 elements of scratch.

Values are equal across machines for one device type, not across device types: the CPU and CUDA
generators are different algorithms (and PyTorch's CUDA normal kernel sizes its launch by the
GPU's multiprocessor count, so CUDA values can also differ between GPU models). Build the
reference model on the same kind of device as the run it is compared with.
"""
from __future__ import annotations

import hashlib
import math
import zlib

import torch

from .config import LlamaConfig

CHUNK = 1 << 20  # elements per independently seeded chunk: 4 MB of fp32 scratch at most
BASE_STD = 0.02
RESIDUAL_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight")


def init_std(cfg: LlamaConfig, name: str) -> float | None:
    """Standard deviation of a parameter's normal init; None for norm gains (initialised to one)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(RESIDUAL_PROJECTIONS):
        # Scaled init of the projections that add into the residual stream (GPT-2 / Megatron).
        return BASE_STD / math.sqrt(2 * cfg.n_layers)
    return BASE_STD


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """A 63-bit generator seed for one chunk; hashed so that nearby (seed, name, chunk) triples do
    not give related streams."""
    key = f"{seed}/{zlib.crc32(name.encode())}/{chunk}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_slice_into(cfg: LlamaConfig, name: str, shape: torch.Size | tuple[int, ...], start: int, end: int,
                    seed: int, out: torch.Tensor) -> None:
    """Write elements [start, end) of parameter `name` (flattened) into the 1-D tensor `out`, on
    out's device and in out's dtype (rounded from fp32 element by element, as a whole-tensor cast
    would). Only the chunks overlapping the range are drawn."""
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"{name}: range [{start}, {end}) outside [0, {numel})")
    if out.dim() != 1 or out.numel() != end - start:
        raise ValueError(f"{name}: out must be 1-D with {end - start} elements, got shape {tuple(out.shape)}")
    std = init_std(cfg, name)
    if std is None:
        out.fill_(1.0)
        return
    if start == end:
        return
    scratch = torch.empty(min(CHUNK, numel), dtype=torch.float32, device=out.device)
    for c in range(start // CHUNK, (end - 1) // CHUNK + 1):
        c_lo = c * CHUNK
        drawn = scratch[:min(CHUNK, numel - c_lo)]  # always the whole chunk: values depend on its length
        gen = torch.Generator(device=out.device).manual_seed(chunk_seed(seed, name, c))
        drawn.normal_(generator=gen).mul_(std)
        lo, hi = max(start, c_lo), min(end, c_lo + drawn.numel())
        out[lo - start:hi - start].copy_(drawn[lo - c_lo:hi - c_lo])


def init_slice(cfg: LlamaConfig, name: str, shape: torch.Size | tuple[int, ...], start: int, end: int, seed: int,
               device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elements [start, end) of parameter `name` (flattened), as a new 1-D tensor on `device`."""
    out = torch.empty(max(end - start, 0), dtype=dtype, device=device)  # a bad range is named below
    init_slice_into(cfg, name, shape, start, end, seed, out)
    return out
