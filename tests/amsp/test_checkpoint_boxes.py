"""Checkpoint format 2: a fragment of a (TP-local) flattened shard becomes at most three boxes of the full
matrix, and 1-D parameters become runs of the flattened full tensor (pure, against torch ground truth)."""
import math

import pytest
import torch

from amsp.fragments import Fragment
from amsp.parallel.tp_slices import TPSlot
from amsp.train_state import _flat_boxes, _shaped_boxes


def _fragment(full: torch.Tensor, shard_dim, tp: int, rank: int, lo: int, hi: int) -> Fragment:
    slot = None if shard_dim is None else TPSlot(None, (), full.shape, shard_dim, tp, rank)
    local = full if shard_dim is None else full.chunk(tp, dim=shard_dim)[rank].contiguous()
    piece = local.reshape(-1)[lo:hi].clone()
    return Fragment("w", "u", local.shape, local.numel(), lo, hi, True, piece, None, None, slot)


@pytest.mark.parametrize("shape, shard_dim, tp", [((6, 8), 0, 2), ((6, 8), 1, 2), ((5, 12), 1, 4), ((6, 8), None, 1)])
def test_matrix_fragment_boxes_land_where_the_elements_are(shape, shard_dim, tp):
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    for rank in range(tp):
        numel = full.numel() // tp
        cols = shape[1] // (tp if shard_dim == 1 else 1)
        for lo, hi in [(0, numel), (3, numel - 2), (1, 2), (cols - 1, cols + 1), (cols, 2 * cols)]:
            f = _fragment(full, shard_dim, tp, rank, lo, hi)
            boxes = _shaped_boxes(f, f.master)
            assert len(boxes) <= 3
            seen = torch.zeros(shape, dtype=torch.bool)
            for (r, c), view in boxes:
                assert torch.equal(full[r:r + view.shape[0], c:c + view.shape[1]], view), (rank, lo, hi)
                seen[r:r + view.shape[0], c:c + view.shape[1]] = True
            assert seen.sum() == hi - lo  # every element once, nothing else


@pytest.mark.parametrize("shard_dim, tp", [(0, 4), (None, 1)])
def test_vector_fragment_runs(shard_dim, tp):
    full = torch.arange(16, dtype=torch.float32)
    for rank in range(tp):
        f = _fragment(full, shard_dim, tp, rank, 1, 16 // tp - 1)
        for offset, piece in _flat_boxes(f, f.master):
            assert torch.equal(full[offset:offset + piece.numel()], piece)
