"""Fixed-length samples packed across document boundaries (Megatron GPTDataset semantics).

A split is a set of an indexed dataset's documents: a seeded random sample of them (the train /
validation split, sample_split_documents) or a contiguous range. Its documents are visited epoch
after epoch, each epoch in its own seeded order (build_doc_index), laid end to end and cut into
samples of seq_len + 1 tokens that share one token with the next (build_sample_index). A sample
belongs to the epoch its first token lies in; the samples are visited epoch by epoch, each epoch's
in its own seeded order (build_epoch_shuffle_index). Nothing about epoch e depends on how many
epochs are built, so a run resumed with a larger max_steps sees exactly the samples, in the same
order, that it would have seen had it been launched that long (the last sample of an epoch reads
into the next epoch's documents, so one more epoch of documents is indexed than of samples). The
three index arrays are cached on disk, keyed by everything they depend on.
"""
from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass

import numpy as np
import xxhash

from data import index_builders
from data.cache import cache_key, file_identity, locked, save_json, save_npy
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, idx_path

log = logging.getLogger(__name__)
_INDEX_VERSION = 2  # bump when the index recipe changes, so stale caches are not reused
# Hash stream of the train/validation split: far from the epoch streams (0, 1, ...) and from the
# sample streams (SAMPLE_STREAM - e) of index_builders, so the split never correlates with an order.
SPLIT_STREAM = 1 << 63


def split_documents(num_docs: int, weights: list[float], where: str) -> list[tuple[int, int]]:
    """Contiguous document ranges for train/validation(/test) split weights (Megatron's --split)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not 1 <= len(w) <= 3 or np.any(w < 0) or w[0] <= 0:
        raise DataError("data.split", f"expected 1-3 non-negative weights with a positive train weight, got {weights}")
    bounds = np.round(np.concatenate([[0], np.cumsum(w / w.sum())]) * num_docs).astype(np.int64)
    counts = np.diff(bounds)
    # A requested validation/test split gets at least one document while train keeps at least one.
    for k in range(1, len(w)):
        if w[k] > 0 and counts[k] == 0 and counts[0] > 1:
            counts[k], counts[0] = 1, counts[0] - 1
    bounds = np.concatenate([[0], np.cumsum(counts)])
    ranges = [(int(bounds[k]), int(bounds[k + 1])) for k in range(len(w))]
    if ranges[0][1] <= ranges[0][0]:
        raise DataError(where, f"{num_docs} documents leave none for training with data.split={weights}")
    return ranges


def sample_split_documents(num_docs: int, weights: list[float], seed: int, where: str) -> list[np.ndarray]:
    """A seeded random split by document: sorted int64 document ids of each split (train, validation[, test]).

    Each split gets as many documents as split_documents gives its range, so a requested validation
    split is never empty while train keeps one. Which documents: every document i has the key
    key(seed, SPLIT_STREAM, i) of index_builders (distinct for distinct i: splitmix64 is a bijection);
    the documents with the smallest keys are held out (validation first, then test) and the rest
    train. Held-out documents are therefore spread uniformly over the whole file, whatever order its
    sources were written in; the same seed gives the same split on any machine; and a document's
    place depends only on its own key, so appending documents moves few of the earlier ones.
    """
    counts = [end - start for start, end in split_documents(num_docs, weights, where)]
    held = sum(counts[1:])
    if held == 0:
        return [np.arange(num_docs, dtype=np.int64)] + [np.zeros(0, dtype=np.int64) for _ in counts[1:]]
    keys = index_builders.hash_keys(num_docs, seed, SPLIT_STREAM)
    held_ids = np.argpartition(keys, held - 1)[:held]
    held_ids = held_ids[np.argsort(keys[held_ids], kind="stable")].astype(np.int64)
    train = np.ones(num_docs, dtype=bool)
    train[held_ids] = False
    out = [np.flatnonzero(train).astype(np.int64)]
    start = 0
    for n in counts[1:]:
        out.append(np.sort(held_ids[start:start + n]))
        start += n
    return out


def epochs_needed(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Fewest epochs that hold num_samples samples (sample i starts at token i * seq_len of the stream
    and belongs to the epoch it starts in)."""
    if tokens_per_epoch <= 0:
        raise ValueError("epochs_needed: the split has no tokens")
    return (max(num_samples, 1) - 1) * seq_len // tokens_per_epoch + 1


def epoch_sample_bounds(tokens_per_epoch: int, seq_len: int, num_epochs: int) -> np.ndarray:
    """b[e] = the first sample that starts in epoch e or later (ceil(e * tokens / seq_len)), e = 0..num_epochs;
    epoch e's samples are [b[e], b[e + 1])."""
    e = np.arange(num_epochs + 1, dtype=np.int64)
    return -(-(e * tokens_per_epoch) // seq_len)


@dataclass
class SampleIndex:
    doc_index: np.ndarray  # int32, positions within the split's documents
    sample_index: np.ndarray  # int64 (n + 1, 2)
    shuffle_index: np.ndarray  # int64 (n,)


def _documents_key(documents) -> list | dict:
    """What identifies a split's documents in a cache key: the range itself, or a hash of the ids."""
    if isinstance(documents, np.ndarray):
        ids = np.ascontiguousarray(documents, dtype=np.int64)
        return {"n": int(len(ids)), "xxh3_128": xxhash.xxh3_128_hexdigest(ids.tobytes())}
    return [int(documents[0]), int(documents[1])]  # unchanged since v2: existing caches stay valid


class GPTDataset:
    """Samples of seq_len + 1 tokens from some documents of an indexed dataset.

    `documents` is a (start, end) range of document ids or an array of sorted document ids (a split
    from sample_split_documents)."""

    def __init__(self, indexed: IndexedDataset, documents, seq_len: int, num_samples: int,
                 seed: int, cache_dir: pathlib.Path, name: str = "train"):
        self.indexed, self.seq_len, self.name = indexed, seq_len, name
        if isinstance(documents, np.ndarray):
            self.doc_ids = np.asarray(documents, dtype=np.int64)
            what = f"{len(self.doc_ids)} sampled documents"
        else:
            self.doc_ids = np.arange(int(documents[0]), int(documents[1]), dtype=np.int64)
            what = f"documents {int(documents[0])}..{int(documents[1])}"
        self.doc_lengths = np.ascontiguousarray(indexed.doc_lengths[self.doc_ids]).astype(np.int32)
        tokens = int(self.doc_lengths.sum(dtype=np.int64))
        if tokens == 0:
            raise DataError(idx_path(indexed.prefix), f"the {name} split ({what}) has no tokens")
        self.num_epochs = epochs_needed(tokens, seq_len, num_samples)
        # Every sample that starts in the chosen epochs is indexed, whatever the exact number asked for.
        self.epoch_bounds = epoch_sample_bounds(tokens, seq_len, self.num_epochs)
        self.num_samples = int(self.epoch_bounds[-1])
        # The last sample's final token lies in a later epoch of documents (the next one, or several
        # when an epoch is shorter than a sample).
        self.doc_epochs = self.num_samples * seq_len // tokens + 1
        inputs = {"v": _INDEX_VERSION, "idx": file_identity(idx_path(indexed.prefix)), "docs": _documents_key(documents),
                  "seq_len": seq_len, "epochs": self.num_epochs, "seed": seed}
        self.index = _load_or_build(cache_dir / "index" / cache_key(inputs), inputs,
                                    lambda: self._build(seed))
        log.info("%s split of %s: %d documents, %d tokens, %d epochs -> %d samples of %d+1 tokens",
                 name, indexed.prefix, len(self.doc_ids), tokens, self.num_epochs, self.num_samples, seq_len)

    def _build(self, seed: int) -> SampleIndex:
        doc_index = index_builders.build_doc_index(len(self.doc_lengths), self.doc_epochs, seed)
        sample_index = index_builders.build_sample_index(self.doc_lengths, doc_index, self.seq_len, self.num_samples)
        shuffle_index = index_builders.build_epoch_shuffle_index(np.diff(self.epoch_bounds), seed)
        return SampleIndex(doc_index, sample_index, shuffle_index)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of the i-th sample in visiting order (int64, seq_len + 1)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name} sample {i} out of range [0, {self.num_samples})")
        j = int(self.index.shuffle_index[i])
        (r0, o0), (r1, o1) = self.index.sample_index[j], self.index.sample_index[j + 1]
        docs = self.doc_ids[self.index.doc_index[r0:r1 + 1]]
        if r0 == r1:
            return self.indexed.doc(int(docs[0]), int(o0), int(o1 - o0 + 1)).astype(np.int64)
        pieces = [self.indexed.doc(int(docs[0]), int(o0))]
        pieces += [self.indexed.doc(int(d)) for d in docs[1:-1]]
        pieces.append(self.indexed.doc(int(docs[-1]), 0, int(o1 + 1)))
        return np.concatenate(pieces).astype(np.int64)

    def leading_tokens(self, max_tokens: int) -> np.ndarray:
        """The tokens of this split's first documents in file order, about max_tokens of them (whole
        documents, at least one): read as one slice per run of consecutive document ids."""
        ends = np.cumsum(self.doc_lengths, dtype=np.int64)
        take = self.doc_ids[:int(np.searchsorted(ends, max_tokens)) + 1]
        breaks = np.flatnonzero(np.diff(take) != 1) + 1
        first, last = take[np.r_[0, breaks]], take[np.r_[breaks - 1, len(take) - 1]]
        starts, stops = self.indexed.doc_starts[first], self.indexed.doc_starts[last] + self.indexed.doc_lengths[last]
        tokens = self.indexed.tokens()
        return np.concatenate([tokens[int(a):int(b)] for a, b in zip(starts, stops)])


def _load_or_build(d: pathlib.Path, inputs: dict, build) -> SampleIndex:
    names = ("doc_index", "sample_index", "shuffle_index")
    with locked(d):
        if not (d / "done.json").exists():
            d.mkdir(parents=True, exist_ok=True)
            built = build()
            for n in names:
                save_npy(d / f"{n}.npy", getattr(built, n))
            save_json(d / "done.json", inputs)  # written last: marks the entry complete
    return SampleIndex(*(np.load(d / f"{n}.npy", mmap_mode="r") for n in names))
