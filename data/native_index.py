"""Native (C++) versions of the index builders in data/index_builders.py.

Thin wrapper over `torch.ops.amsp_index.*` (csrc/index_helpers.cpp). Each function has the same
signature, output dtypes and error messages as its reference and is bit-identical to it (tests in
tests/csrc/test_native_index.py). Outputs are allocated here with numpy and filled in place by C++:
numpy requests transparent huge pages for large arrays, which makes their first-touch page faults
several times cheaper than torch's 4 KiB-page allocations (a large share of these builders' time).
`native()` builds/loads the extension on first use and returns this module, or None when the extension is unavailable (the loader has then warned once);
index_builders logs once which implementation it uses.
"""
from __future__ import annotations

import logging
import sys

import numpy as np
import torch

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
SAMPLE_STREAM = MASK64  # must equal index_builders.SAMPLE_STREAM

_loaded: bool | None = None


def _as_int64(value: int) -> int:
    """A value modulo 2**64 passed through a signed int64 schema argument (two's complement)."""
    value &= MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


def native():
    """This module when the C++ builders are loaded, else None."""
    global _loaded
    if _loaded is None:
        from csrc.loader import load_extension

        _loaded = load_extension() is not None
    return sys.modules[__name__] if _loaded else None


def unavailable_reason() -> str | None:
    from csrc.loader import unavailable_reason as why

    return why()


def _permute_into(out: np.ndarray, seed: int, stream: int) -> np.ndarray:
    """Fill out (a contiguous int32/int64 array or slice) with the permutation of range(len(out))."""
    torch.ops.amsp_index.permutation(_as_int64(seed), _as_int64(stream), torch.from_numpy(out))
    return out


def _permutation(n: int, seed: int, stream: int) -> np.ndarray:
    if n < 0:
        raise ValueError(f"permutation size must be >= 0, got {n}")
    return _permute_into(np.empty(n, dtype=np.int64), seed, stream)


def shuffle_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return _permutation(n, seed, epoch)


def build_doc_index(num_docs: int, num_epochs: int, seed: int) -> np.ndarray:
    if num_docs >= 2**31:
        raise ValueError(f"build_doc_index: {num_docs} documents do not fit int32 document ids")
    if num_epochs < 1:
        raise ValueError(f"build_doc_index: num_epochs must be >= 1, got {num_epochs}")
    if num_docs < 0:
        raise ValueError(f"permutation size must be >= 0, got {num_docs}")
    out = np.empty(num_docs * num_epochs, dtype=np.int32)
    for epoch in range(num_epochs):  # one independent shuffle per epoch, as in the reference
        _permute_into(out[epoch * num_docs:(epoch + 1) * num_docs], seed, epoch)
    return out


def build_sample_index(doc_lengths: np.ndarray, doc_index: np.ndarray, seq_len: int,
                       num_samples: int) -> np.ndarray:
    if seq_len < 1 or num_samples < 0:
        raise ValueError(f"build_sample_index: seq_len={seq_len} must be >= 1 and num_samples={num_samples} >= 0")
    # int32 and int64 tables go to C++ as they are; anything else is widened like the reference does.
    lengths, index = (np.ascontiguousarray(a if np.asarray(a).dtype in (np.int32, np.int64) else
                                           np.asarray(a, dtype=np.int64)) for a in (doc_lengths, doc_index))
    out = np.empty((num_samples + 1, 2), dtype=np.int64)
    torch.ops.amsp_index.build_sample_index(torch.from_numpy(lengths), torch.from_numpy(index), seq_len,
                                            num_samples, torch.from_numpy(out))
    return out


def build_shuffle_index(num_samples: int, seed: int) -> np.ndarray:
    return _permutation(num_samples, seed, SAMPLE_STREAM)


def build_epoch_shuffle_index(epoch_sizes: list[int], seed: int) -> np.ndarray:
    out = np.empty(sum(epoch_sizes), dtype=np.int64)
    start = 0
    for e, n in enumerate(epoch_sizes):
        _permute_into(out[start:start + n], seed, SAMPLE_STREAM - e)[...] += start
        start += n
    return out


def build_blending_index(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or len(w) > 32767 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"build_blending_index: weights must be a non-empty vector of finite positive "
                         f"numbers, got {w.tolist()}")
    # Normalised here, by numpy, so the rounding of the sum is the reference's exactly.
    w = w / w.sum()
    dataset_index, sample_index = np.empty(size, dtype=np.int16), np.empty(size, dtype=np.int64)
    torch.ops.amsp_index.build_blending_index(torch.from_numpy(w), size, torch.from_numpy(dataset_index),
                                              torch.from_numpy(sample_index))
    return dataset_index, sample_index
