"""Which global samples a data-parallel rank reads, as a pure function of the consumed count.

The global batch of a step is the samples [consumed, consumed + global_batch) in the global order.
Rank r of W takes the contiguous block [consumed + r*B/W, consumed + (r+1)*B/W) and cuts it into
micro-batches in order. Concatenating the ranks' blocks in rank order gives back the global batch,
so a run can stop at any step and resume on any world size (that divides the batch) and still see
exactly the samples an uninterrupted run would have seen.
"""
from __future__ import annotations

import numpy as np


def rank_block(consumed: int, global_batch: int, rank: int, world: int) -> range:
    """Global sample indices of `rank`'s share of the step starting at `consumed`."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} is not divisible by {world} data-parallel ranks")
    per = global_batch // world
    start = consumed + rank * per
    return range(start, start + per)


def micro_batch_indices(consumed: int, global_batch: int, micro_batch: int, rank: int, world: int) -> list[np.ndarray]:
    """The rank's micro-batches for the step starting at `consumed`, in order."""
    block = rank_block(consumed, global_batch, rank, world)
    if len(block) % micro_batch:
        raise ValueError(f"per-rank batch {len(block)} is not divisible by micro_batch_size={micro_batch}")
    idx = np.arange(block.start, block.stop, dtype=np.int64)
    return [idx[m:m + micro_batch] for m in range(0, len(idx), micro_batch)]
