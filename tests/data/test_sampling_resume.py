"""Packed samples, exact resume across data-parallel world sizes, blending proportions, validation."""
import numpy as np
import pytest
import torch

from data.blending import BlendedDataset, blending_index
from data.dataset import GPTDataset, split_documents
from data.indexed_dataset import IndexedDataset
from data.loader import MicroBatchLoader, validation_batches
from data.sampling import micro_batch_indices

SEQ = 32


@pytest.fixture(scope="module")
def train_ds(dataset_prefix, tmp_path_factory):
    ind = IndexedDataset(dataset_prefix)
    return GPTDataset(ind, (0, ind.num_docs), SEQ, 400, seed=11, cache_dir=tmp_path_factory.mktemp("cache"))


def test_samples_pack_documents_in_visiting_order(train_ds):
    ind = train_ds.indexed
    stream = np.concatenate([ind.doc(int(d)) for d in train_ds.index.doc_index]).astype(np.int64)
    for i in (0, 1, 7, len(train_ds) - 1):
        j = int(train_ds.index.shuffle_index[i])
        sample = train_ds[i]
        assert sample.shape == (SEQ + 1,)
        assert np.array_equal(sample, stream[j * SEQ: j * SEQ + SEQ + 1])  # one-token overlap between samples
    assert len(train_ds) >= 400


def test_index_is_cached_and_reused(dataset_prefix, tmp_path):
    ind = IndexedDataset(dataset_prefix)
    a = GPTDataset(ind, (0, ind.num_docs), SEQ, 100, seed=3, cache_dir=tmp_path)
    entries = list((tmp_path / "index").iterdir())
    assert len([e for e in entries if e.is_dir()]) == 1
    b = GPTDataset(ind, (0, ind.num_docs), SEQ, 100, seed=3, cache_dir=tmp_path)
    assert np.array_equal(a.index.shuffle_index, b.index.shuffle_index)
    assert len([e for e in (tmp_path / "index").iterdir() if e.is_dir()]) == 1
    GPTDataset(ind, (0, ind.num_docs), SEQ, 100, seed=4, cache_dir=tmp_path)  # new key, new entry
    assert len([e for e in (tmp_path / "index").iterdir() if e.is_dir()]) == 2


def test_more_epochs_never_change_the_order_of_the_earlier_ones(dataset_prefix, tmp_path):
    # A run resumed with a larger max_steps builds more epochs; the samples it already planned to see
    # must come in the same order (each epoch is shuffled on its own, see data/dataset.py).
    ind = IndexedDataset(dataset_prefix)
    tokens = int(ind.doc_lengths.sum())
    one_epoch = tokens // SEQ - 5
    short = GPTDataset(ind, (0, ind.num_docs), SEQ, one_epoch, seed=9, cache_dir=tmp_path)
    long = GPTDataset(ind, (0, ind.num_docs), SEQ, 3 * one_epoch, seed=9, cache_dir=tmp_path)
    assert (short.num_epochs, long.num_epochs) == (1, 3) and len(long) > 2 * len(short)
    for i in range(len(short)):
        assert np.array_equal(short[i], long[i]), f"sample {i} differs"
    # Epoch by epoch: every sample of epoch e comes before any of epoch e + 1, each exactly once.
    order = np.asarray(long.index.shuffle_index)
    b = long.epoch_bounds
    for e in range(long.num_epochs):
        assert sorted(order[b[e]:b[e + 1]].tolist()) == list(range(b[e], b[e + 1]))
    # Epochs shorter than a sample (the fixture's last two documents are a few tokens) still index
    # every sample's last token.
    last_two = (ind.num_docs - 2, ind.num_docs)
    assert int(ind.doc_lengths[last_two[0]:].sum()) < SEQ
    tiny = GPTDataset(ind, last_two, SEQ, 50, seed=9, cache_dir=tmp_path)
    assert len(tiny) >= 50 and all(tiny[i].shape == (SEQ + 1,) for i in range(len(tiny)))
    assert tiny.doc_epochs > tiny.num_epochs + 1


def _run(source, gbs, mbs, world, consumed, steps):
    """Micro-batches of `steps` steps for each rank, concatenated in global (rank) order per step."""
    loaders = [MicroBatchLoader(source, gbs, mbs, r, world, consumed_samples=consumed) for r in range(world)]
    out = []
    for _ in range(steps):
        per_rank = [torch.cat([next(ld)[0] for _ in range(ld.micro_per_step)]) for ld in loaders]
        out.append(torch.cat(per_rank))
    states = [ld.state_dict() for ld in loaders]
    for ld in loaders:
        ld.close()
    return torch.cat(out), states


def test_resume_on_another_world_size_sees_the_same_samples(train_ds):
    gbs, mbs, k, total = 16, 2, 3, 8
    full, _ = _run(train_ds, gbs, mbs, world=1, consumed=0, steps=total)
    first, states = _run(train_ds, gbs, mbs, world=2, consumed=0, steps=k)
    assert all(s == {"consumed_samples": k * gbs} for s in states)
    second, _ = _run(train_ds, gbs, mbs, world=4, consumed=states[0]["consumed_samples"], steps=total - k)
    assert torch.equal(torch.cat([first, second]), full)
    # and those are exactly the samples 0..total*gbs of the global order
    expect = torch.from_numpy(np.stack([train_ds[i][:-1] for i in range(total * gbs)]))
    assert torch.equal(full, expect)


def test_load_state_dict_restarts_prefetch_at_the_new_position(train_ds):
    ld = MicroBatchLoader(train_ds, 8, 4, 0, 1, prefetch=3)
    for _ in range(3):  # one and a half steps
        next(ld)
    assert ld.state_dict() == {"consumed_samples": 8}
    ld.load_state_dict({"consumed_samples": 40})
    x, y = next(ld)
    assert torch.equal(x, torch.from_numpy(np.stack([train_ds[i][:-1] for i in range(40, 44)])))
    assert torch.equal(y, torch.from_numpy(np.stack([train_ds[i][1:] for i in range(40, 44)])))
    assert ld.take_wait_seconds() >= 0.0
    ld.close()


def test_rank_blocks_partition_the_global_batch():
    got = np.concatenate([np.concatenate(micro_batch_indices(48, 24, 3, r, 4)) for r in range(4)])
    assert got.tolist() == list(range(48, 72))
    with pytest.raises(ValueError, match="not divisible"):
        micro_batch_indices(0, 10, 2, 0, 4)


def test_loader_stops_at_the_end_of_the_dataset(train_ds):
    n = len(train_ds)
    ld = MicroBatchLoader(train_ds, 8, 8, 0, 1, consumed_samples=(n // 8 - 1) * 8)
    next(ld)
    with pytest.raises(StopIteration):
        next(ld)
    ld.close()


def test_blend_within_one_sample_of_the_weights_over_10000_samples(tmp_path, dataset_prefix):
    weights = [0.7, 0.3]
    di, dsi = blending_index(weights, 10_000, tmp_path)
    counts = np.zeros(2)
    for i, d in enumerate(np.asarray(di)):
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(weights) * (i + 1)) <= 1.0), i
    # the blended dataset reads the members' own samples
    ind = IndexedDataset(dataset_prefix)
    a = GPTDataset(ind, (0, 30), 8, int((di == 0).sum()), 1, tmp_path)
    b = GPTDataset(ind, (30, ind.num_docs), 8, int((di == 1).sum()), 1, tmp_path)
    blended = BlendedDataset([a, b], di, dsi)
    for i in (0, 1, 2, 9999):
        member = a if di[i] == 0 else b
        assert np.array_equal(blended[i], member[int(dsi[i])])


def test_split_and_validation_iterator_cover_every_validation_sample(dataset_prefix, tmp_path):
    ind = IndexedDataset(dataset_prefix)
    (t0, t1), (v0, v1) = split_documents(ind.num_docs, [90, 10], "x")
    assert t0 == 0 and t1 == v0 and v1 == ind.num_docs and v1 - v0 >= 1
    assert split_documents(10, [99, 1], "x")[1] == (9, 10)  # a requested split is never empty
    valid = GPTDataset(ind, (v0, v1), SEQ, 16, 5, tmp_path, name="valid")
    rows = [torch.cat([b[0] for b in validation_batches(valid, 2, r, 2, num_samples=16)]) for r in range(2)]
    # round k = samples [4k, 4k+4): rank 0 takes the first two, rank 1 the next two
    for k in range(4):
        for r in range(2):
            expect = torch.from_numpy(np.stack([valid[i][:-1] for i in range(4 * k + 2 * r, 4 * k + 2 * r + 2)]))
            assert torch.equal(rows[r][2 * k:2 * k + 2], expect)
