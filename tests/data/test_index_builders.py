"""The pure index builders: pinned hash values (for the C++ port), Megatron equivalence, properties."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data import index_builders as ib


@pytest.fixture(autouse=True)
def numpy_reference(monkeypatch):
    """These tests specify the numpy reference; tests/csrc compares the C++ dispatch against it."""
    monkeypatch.setattr(ib, "_native", lambda: None)


def test_splitmix64_matches_the_published_sequence():
    # Reference splitmix64 generator seeded with 0: its outputs are splitmix64(k * golden) for k=0,1,...
    first = ib.splitmix64(np.array([0], dtype=np.uint64))[0]
    assert int(first) == 0xE220A8397B1DCDAF
    golden = 0x9E3779B97F4A7C15
    second = ib.splitmix64(np.array([golden], dtype=np.uint64))[0]
    assert int(second) == 0x6E789E6AA1B965F4


def _py_splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_hash_rule_matches_plain_python_integers():
    m = (1 << 64) - 1
    for n, seed, stream in ((50, 1234, 0), (40, -5, 3), (30, 2**64 - 1, ib.SAMPLE_STREAM)):
        base = _py_splitmix64(_py_splitmix64(seed & m) ^ stream)
        keys = [_py_splitmix64(base ^ i) for i in range(n)]
        assert ib.hash_keys(n, seed, stream).tolist() == keys
        assert ib._permutation(n, seed, stream).tolist() == sorted(range(n), key=lambda i: (keys[i], i))


def test_shuffle_order_pinned_values():
    # Pinned so an implementation change (or the C++ port) cannot silently change every run's data order.
    assert ib.shuffle_order(10, 1234, 0).tolist() == PINNED_SEED1234_EPOCH0
    assert ib.build_shuffle_index(6, 7).tolist() == PINNED_SHUFFLE_SEED7


@given(n=st.integers(0, 300), seed=st.integers(-2**63, 2**64 - 1), epoch=st.integers(0, 50))
@settings(max_examples=60, deadline=None)
def test_shuffle_order_is_a_deterministic_permutation(n, seed, epoch):
    p = ib.shuffle_order(n, seed, epoch)
    assert p.dtype == np.int64 and sorted(p.tolist()) == list(range(n))
    assert np.array_equal(p, ib.shuffle_order(n, seed, epoch))


def test_shuffles_differ_by_seed_epoch_and_stream():
    a = ib.shuffle_order(1000, 1, 0)
    assert not np.array_equal(a, ib.shuffle_order(1000, 2, 0))
    assert not np.array_equal(a, ib.shuffle_order(1000, 1, 1))
    assert not np.array_equal(a, ib.build_shuffle_index(1000, 1))


def test_epoch_shuffle_index_blocks_are_independent_of_later_blocks():
    sizes = [7, 0, 5, 9]
    full = ib.build_epoch_shuffle_index(sizes, 3)
    assert full.dtype == np.int64 and sorted(full.tolist()) == list(range(21))
    start = 0
    for e, n in enumerate(sizes):
        block = full[start:start + n]
        assert block.tolist() == (ib._permutation(n, 3, ib.SAMPLE_STREAM - e) + start).tolist()
        start += n
    assert np.array_equal(ib.build_epoch_shuffle_index(sizes[:2], 3), full[:7])  # fewer epochs: a prefix
    assert np.array_equal(full[:7], ib.build_shuffle_index(7, 3))  # block 0 is the plain sample shuffle
    with pytest.raises(ValueError, match=">= 0"):
        ib.build_epoch_shuffle_index([3, -1], 3)


def test_doc_index_concatenates_epochs():
    d = ib.build_doc_index(7, 3, 5)
    assert d.dtype == np.int32 and len(d) == 21
    for e in range(3):
        assert d[7 * e:7 * (e + 1)].tolist() == ib.shuffle_order(7, 5, e).tolist()


def megatron_sample_index(sizes, doc_idx, seq_length, num_samples):
    """Megatron-LM's build_sample_idx loop (helpers.cpp), transcribed as the specification."""
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    doc_idx_index, doc_offset = 0, 0
    for i in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out[i] = (doc_idx_index, doc_offset)
    return out


@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=25), seq_len=st.integers(1, 30),
       epochs=st.integers(1, 3), seed=st.integers(0, 1000))
@settings(max_examples=120, deadline=None)
def test_sample_index_equals_megatron_loop(lengths, seq_len, epochs, seed):
    sizes = np.array(lengths, dtype=np.int32)
    doc_index = ib.build_doc_index(len(sizes), epochs, seed)
    total = int(sizes.sum()) * epochs
    if total < 2:
        return
    n = (total - 1) // seq_len
    got = ib.build_sample_index(sizes, doc_index, seq_len, n)
    assert got.shape == (n + 1, 2) and got.dtype == np.int64
    assert np.array_equal(got, megatron_sample_index(sizes, doc_index, seq_len, n))


def test_sample_index_rejects_too_many_samples():
    with pytest.raises(ValueError, match="need more than"):
        ib.build_sample_index(np.array([5], np.int32), np.array([0], np.int32), 4, 2)


def test_blending_index_greedy_rule_and_proportions():
    w = np.array([0.5, 0.3, 0.2])
    di, dsi = ib.build_blending_index(w, 10_000)
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    counts = np.zeros(3, dtype=np.int64)
    for i in range(10_000):  # every prefix within one sample of its share
        counts[di[i]] += 1
        assert np.all(np.abs(counts - w * (i + 1)) <= 1.0)
    for d in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert dsi[di == d].tolist() == list(range(int((di == d).sum())))
    with pytest.raises(ValueError, match="positive"):
        ib.build_blending_index(np.array([1.0, 0.0]), 10)


PINNED_SEED1234_EPOCH0 = [2, 3, 5, 6, 4, 0, 9, 1, 7, 8]
PINNED_SHUFFLE_SEED7 = [2, 0, 5, 4, 3, 1]
