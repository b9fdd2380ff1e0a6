"""Pure index builders behind sampling and blending (reference implementations).

Every sample the trainer sees is located through these five functions, so the global sample order is
a pure function of their inputs. They use fully specified integer / IEEE-double arithmetic (no
numpy RandomState or Generator), so that a C++ port can reproduce them bit for bit; csrc/ may add
a faster dispatch here, and all callers go through these names.

Hash rule (shared by shuffle_order and build_shuffle_index), all arithmetic modulo 2**64:
    splitmix64(x):  z = x + 0x9E3779B97F4A7C15
                    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
                    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
                    return z ^ (z >> 31)
    key(seed, stream, i) = splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ i)
A permutation of range(n) is the stable argsort of key(seed, stream, i) for i in range(n) (ties,
which need a 64-bit collision, keep index order). shuffle_order uses stream = epoch;
build_shuffle_index uses stream = SAMPLE_STREAM, a value no epoch reaches, and
build_epoch_shuffle_index uses SAMPLE_STREAM - e for its block e (counting down, so the two ranges
of streams never meet). Seeds and epochs are taken modulo 2**64.
"""
from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
SAMPLE_STREAM = MASK64  # stream tag of the sample shuffle; epochs count up from 0

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


_NATIVE: list = []  # [module or None], resolved on first use


def _native():
    """The bit-identical C++ builders (csrc/ through data/native_index.py), or None to use the numpy
    references below. Built on first use, decided once and logged once; tests that need the
    references themselves monkeypatch this function to return None."""
    if not _NATIVE:
        import logging

        from . import native_index

        _NATIVE.append(native_index.native())
        logging.getLogger(__name__).info(
            "index builders: %s", "native C++ (csrc/index_helpers.cpp)" if _NATIVE[0] is not None
            else f"numpy reference (native extension unavailable: {native_index.unavailable_reason()})")
    return _NATIVE[0]


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def hash_keys(n: int, seed: int, stream: int) -> np.ndarray:
    """key(seed, stream, i) for i in range(n), as uint64."""
    base = splitmix64(np.array([seed & MASK64], dtype=np.uint64))
    base = splitmix64(base ^ np.uint64(stream & MASK64))
    return splitmix64(base ^ np.arange(n, dtype=np.uint64))


def _permutation(n: int, seed: int, stream: int) -> np.ndarray:
    if n < 0:
        raise ValueError(f"permutation size must be >= 0, got {n}")
    return np.argsort(hash_keys(n, seed, stream), kind="stable").astype(np.int64)


def shuffle_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) (int64) determined by (seed, epoch)."""
    if (native := _native()) is not None:
        return native.shuffle_order(n, seed, epoch)
    return _permutation(n, seed, epoch)


def build_doc_index(num_docs: int, num_epochs: int, seed: int) -> np.ndarray:
    """Documents in visiting order: one independent shuffle per epoch, concatenated (int32)."""
    if (native := _native()) is not None:
        return native.build_doc_index(num_docs, num_epochs, seed)
    if num_docs >= 2**31:
        raise ValueError(f"build_doc_index: {num_docs} documents do not fit int32 document ids")
    if num_epochs < 1:
        raise ValueError(f"build_doc_index: num_epochs must be >= 1, got {num_epochs}")
    return np.concatenate([shuffle_order(num_docs, seed, e) for e in range(num_epochs)]).astype(np.int32)


def build_sample_index(doc_lengths: np.ndarray, doc_index: np.ndarray, seq_len: int,
                       num_samples: int) -> np.ndarray:
    """Megatron's sample_idx: row i = (position in doc_index, token offset in that document).

    Documents are laid end to end in doc_index order; sample i covers the seq_len + 1 tokens from
    row i to row i + 1 inclusive, so consecutive samples share one token (the last input's target is
    the next sample's first input). Equivalently, sample i starts at stream position i * seq_len,
    and a position p belongs to the first document whose end lies beyond p (empty documents are
    skipped), except that row 0 is always (0, 0). This is exactly what Megatron's sequential build_sample_idx loop produces.
    """
    if (native := _native()) is not None:
        return native.build_sample_index(doc_lengths, doc_index, seq_len, num_samples)
    if seq_len < 1 or num_samples < 0:
        raise ValueError(f"build_sample_index: seq_len={seq_len} must be >= 1 and num_samples={num_samples} >= 0")
    lengths = np.asarray(doc_lengths, dtype=np.int64)[np.asarray(doc_index, dtype=np.int64)]
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    # The last sample's final token (position num_samples * seq_len) must exist.
    if num_samples * seq_len >= total:
        raise ValueError(f"build_sample_index: {num_samples} samples of {seq_len}+1 tokens need more than "
                         f"the {total} tokens in doc_index")
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    rows = np.searchsorted(ends, positions, side="right")
    starts = ends[rows] - lengths[rows]
    out = np.stack([rows, positions - starts], axis=1).astype(np.int64)
    out[0] = 0  # Megatron starts at (0, 0) even when the first document is empty (same tokens)
    return out


def build_shuffle_index(num_samples: int, seed: int) -> np.ndarray:
    """Permutation of range(num_samples) (int64) giving the global sample order."""
    if (native := _native()) is not None:
        return native.build_shuffle_index(num_samples, seed)
    return _permutation(num_samples, seed, SAMPLE_STREAM)


def build_epoch_shuffle_index(epoch_sizes, seed: int) -> np.ndarray:
    """Global sample order (int64) that visits epoch blocks in turn.

    Block e is the next epoch_sizes[e] sample ids; it is permuted by key(seed, SAMPLE_STREAM - e, .)
    and offset to its place. Each block's order depends only on (seed, e, its size), so building
    more epochs never changes the order of the earlier ones (a run extended with a larger
    max_steps sees the same samples up to where it stopped), and block 0 is build_shuffle_index.
    """
    sizes = [int(n) for n in epoch_sizes]
    if any(n < 0 for n in sizes):
        raise ValueError(f"build_epoch_shuffle_index: block sizes must be >= 0, got {sizes}")
    if (native := _native()) is not None:
        return native.build_epoch_shuffle_index(sizes, seed)
    out = np.empty(sum(sizes), dtype=np.int64)
    start = 0
    for e, n in enumerate(sizes):
        out[start:start + n] = _permutation(n, seed, SAMPLE_STREAM - e) + start
        start += n
    return out


def build_blending_index(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blending: at each position choose the dataset furthest behind its share.

    For position i (with i treated as at least 1), the dataset with the largest error
    weights[d] * max(i, 1) - count[d] is chosen (the lowest d on ties), in IEEE double arithmetic.
    Returns (dataset_index int16, dataset_sample_index int64).
    """
    if (native := _native()) is not None:
        return native.build_blending_index(weights, size)
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or len(w) > 32767 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"build_blending_index: weights must be a non-empty vector of finite positive "
                         f"numbers, got {w.tolist()}")
    w = w / w.sum()
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    weights_list = w.tolist()
    counts_list = [0] * len(w)
    for i in range(size):
        x = float(max(i, 1))
        best, best_err = 0, weights_list[0] * x - counts_list[0]
        for d in range(1, len(weights_list)):
            err = weights_list[d] * x - counts_list[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        dataset_sample_index[i] = counts_list[best]
        counts_list[best] += 1
    return dataset_index, dataset_sample_index
