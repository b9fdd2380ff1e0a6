"""C++ index builders (csrc/index_helpers.cpp) are bit-identical to data/index_builders.py."""
import numpy as np
import pytest

from data import index_builders as ref
from data import native_index as nat


@pytest.fixture(scope="module")
def native(native_ext):
    mod = nat.native()
    assert mod is not None
    return mod


@pytest.fixture(autouse=True)
def numpy_reference(monkeypatch):
    # index_builders dispatches to the C++ builders when they are built: compare against the numpy
    # bodies themselves.
    monkeypatch.setattr(ref, "_native", lambda: None)


def test_index_builders_dispatch_to_native(native, monkeypatch):
    monkeypatch.undo()
    assert ref._native() is native
    _same(ref.build_shuffle_index(1000, 5), native.build_shuffle_index(1000, 5))


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a, b)


@pytest.mark.parametrize("n", [0, 1, 2, 17, 1023, 1024, 4096, 100_003, 1_500_000])
def test_shuffle_order_identical(native, n):
    for seed, epoch in [(0, 0), (1234, 3), (2**64 - 1, 2**63 + 7), (-5, 1)]:
        _same(native.shuffle_order(n, seed, epoch), ref.shuffle_order(n, seed, epoch))


def test_shuffle_index_and_doc_index_identical(native):
    rng = np.random.default_rng(0)
    for _ in range(5):
        n, seed = int(rng.integers(0, 50_000)), int(rng.integers(0, 2**63))
        _same(native.build_shuffle_index(n, seed), ref.build_shuffle_index(n, seed))
        epochs = int(rng.integers(1, 4))
        _same(native.build_doc_index(n, epochs, seed), ref.build_doc_index(n, epochs, seed))
        sizes = [int(k) for k in rng.integers(0, 20_000, epochs)]
        _same(native.build_epoch_shuffle_index(sizes, seed), ref.build_epoch_shuffle_index(sizes, seed))


@pytest.mark.parametrize("seq_len", [1, 3, 128, 2048])
def test_sample_index_identical(native, seq_len):
    rng = np.random.default_rng(seq_len)
    lengths = rng.integers(0, 3000, 4000)  # includes empty documents
    lengths[rng.integers(0, 4000, 50)] = 0
    lengths[ref.build_doc_index(4000, 1, 7)[:3]] = 0  # the first documents visited are empty
    for doc_index in (ref.build_doc_index(4000, 2, 7), ref.build_doc_index(4000, 1, 7).astype(np.int64)):
        total = int(lengths[doc_index].sum())
        for num_samples in (0, 1, (total - 1) // seq_len):
            _same(native.build_sample_index(lengths, doc_index, seq_len, num_samples),
                  ref.build_sample_index(lengths, doc_index, seq_len, num_samples))


def test_sample_index_errors_match(native):
    lengths, doc_index = np.array([5, 3]), np.array([0, 1], dtype=np.int32)
    for args in ((lengths, doc_index, 4, 2), (lengths, doc_index, 0, 1)):
        with pytest.raises(ValueError) as want:
            ref.build_sample_index(*args)
        with pytest.raises(ValueError) as got:
            native.build_sample_index(*args)
        assert str(got.value) == str(want.value)


def test_sample_index_rejects_bad_document_ids_like_numpy(native):
    # The native builder stops reading doc_index once the last sample is placed, yet must still
    # reject an out-of-range id anywhere in it (the reference gathers every row); negative ids wrap.
    lengths = np.array([5, 3, 4, 6])
    for bad_row, bad_id in ((0, 4), (3, 7), (3, -5), (1, 2**31 - 1)):
        doc_index = np.array([0, 1, 2, 3], dtype=np.int32)
        doc_index[bad_row] = bad_id
        with pytest.raises(IndexError) as want:
            ref.build_sample_index(lengths, doc_index, 2, 2)
        with pytest.raises(IndexError) as got:
            native.build_sample_index(lengths, doc_index, 2, 2)
        assert str(got.value) == str(want.value)
    wrapped = np.array([-1, -4, 1, 2], dtype=np.int64)
    _same(native.build_sample_index(lengths, wrapped, 3, 5), ref.build_sample_index(lengths, wrapped, 3, 5))


@pytest.mark.parametrize("n_datasets", [1, 2, 3, 8, 9, 10])
def test_blending_index_identical(native, n_datasets):
    rng = np.random.default_rng(n_datasets)
    for weights in (rng.random(n_datasets) + 1e-3, np.ones(n_datasets), rng.integers(1, 9, n_datasets)):
        for size in (0, 1, 7, 20_000):
            got, want = native.build_blending_index(weights, size), ref.build_blending_index(weights, size)
            _same(got[0], want[0])
            _same(got[1], want[1])
    with pytest.raises(ValueError, match="weights must be"):
        native.build_blending_index([1.0, -1.0], 3)
