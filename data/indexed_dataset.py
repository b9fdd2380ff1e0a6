"""Megatron-LM's indexed dataset (MMIDIDX): PREFIX.bin holds tokens, PREFIX.idx says where.

.idx layout (all little-endian), as written by megatron/core/datasets/indexed_dataset.py:
    9 bytes   b"MMIDIDX\\x00\\x00"
    uint64    version = 1
    uint8     dtype code of the tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
              7 float32, 8 uint16)
    uint64    sequence count S
    uint64    document count D (= number of documents + 1)
    int32[S]  sequence lengths in tokens
    int64[S]  byte pointers of the sequences into .bin
    int64[D]  document indices: 0, then the index of the sequence that ends each document
(multimodal files append int8[S] modes, which this reader ignores.)
.bin is the tokens of all sequences back to back. Here one document is one sequence, as in
Megatron's GPT preprocessing; files with several sequences per document still read correctly,
the document being its sequences concatenated.
"""
from __future__ import annotations

import os
import struct
from typing import BinaryIO

import numpy as np

from data.errors import DataError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # 34 bytes before the arrays


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (ids < 65536), int32 otherwise."""
    return np.uint16 if vocab_size <= 65536 else np.int32


def bin_path(prefix: str) -> str:
    return f"{prefix}.bin"


def idx_path(prefix: str) -> str:
    return f"{prefix}.idx"


def write_index(f: BinaryIO, dtype, lengths: np.ndarray, doc_indices: np.ndarray) -> None:
    """Write an .idx for sequences of the given lengths (pointers follow from lengths and dtype)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    f.write(HEADER)
    f.write(struct.pack("<Q", VERSION))
    f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
    f.write(struct.pack("<Q", len(lengths)))
    f.write(struct.pack("<Q", len(doc_indices)))
    f.write(lengths.astype("<i4").tobytes())
    f.write(pointers.astype("<i8").tobytes())
    f.write(np.asarray(doc_indices, dtype="<i8").tobytes())


class IndexedDatasetWriter:
    """Streams documents into PREFIX.bin.tmp / PREFIX.idx.tmp; finalize() renames them into place.

    Until finalize() nothing exists under the final names, so an interrupted or failed run leaves
    any earlier dataset at PREFIX untouched. Memory held: one int32 length per document.
    """

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise DataError(prefix, f"token dtype {self.dtype} has no MMIDIDX code")
        parent = os.path.dirname(os.path.abspath(prefix))
        if not os.path.isdir(parent):
            raise DataError(prefix, f"output directory {parent} does not exist")
        tag = f".tmp-{os.getpid()}"
        self.tmp_bin, self.tmp_idx = bin_path(prefix) + tag, idx_path(prefix) + tag
        self._bin = open(self.tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self.num_docs = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and their lengths."""
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        self._bin.write(tokens.tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.num_tokens += int(tokens.size)
        self.num_docs += len(lengths)

    def finalize(self) -> None:
        self.prepare()
        self.commit()

    def prepare(self) -> None:
        """Finish both temporary files; the step that can run out of disk space. The final names are
        still untouched, so a caller can write its own files before commit() (preprocess's PREFIX.json)."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        with open(self.tmp_idx, "wb") as f:
            write_index(f, self.dtype, lengths, np.arange(len(lengths) + 1, dtype=np.int64))

    def commit(self) -> None:
        """Rename the prepared files into place (renames need no space)."""
        os.replace(self.tmp_bin, bin_path(self.prefix))
        os.replace(self.tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        """Drop the temporary files (the final names were never touched)."""
        try:
            self._bin.close()  # flushes what is buffered: on a full disk that fails again, and is no news
        except OSError:
            pass
        for p in (self.tmp_bin, self.tmp_idx):
            if os.path.exists(p):
                os.remove(p)


class IndexedDataset:
    """Memory-mapped reader that validates the whole layout on open (one-line DataError if not)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                raise DataError(p, "file not found (expected PREFIX.idx and PREFIX.bin from python -m data.preprocess)")
        idx_size = os.path.getsize(ipath)
        if idx_size < _FIXED:
            raise DataError(ipath, f"truncated index: {idx_size} bytes, the header alone is {_FIXED}")
        with open(ipath, "rb") as f:
            head = f.read(_FIXED)
        if head[:9] != HEADER:
            raise DataError(ipath, f"not an MMIDIDX index (header {head[:9]!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != VERSION:
            raise DataError(ipath, f"unsupported MMIDIDX version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(ipath, f"unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        body = n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_size not in (_FIXED + body, _FIXED + body + n_seq):  # + n_seq: multimodal modes
            raise DataError(ipath, f"truncated or corrupt index: {idx_size} bytes, header promises "
                                   f"{_FIXED + body} for {n_seq} sequences and {n_doc} document indices")
        mm = np.memmap(ipath, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=_FIXED)
        self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=_FIXED + 4 * n_seq)
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=n_doc, offset=_FIXED + 12 * n_seq)
        self._check(ipath, bpath, n_seq, n_doc)
        self._bin = np.memmap(bpath, mode="r", dtype=self.dtype) if os.path.getsize(bpath) else np.zeros(0, self.dtype)
        # A document is its sequences back to back in .bin: one contiguous token range.
        first_seq = self.document_indices[:-1]
        seq_ends = np.cumsum(self.sequence_lengths, dtype=np.int64)
        bounds = np.concatenate([[0], seq_ends]).astype(np.int64)  # bounds[k] = start of sequence k
        self.doc_starts = bounds[first_seq]
        self.doc_lengths = bounds[self.document_indices[1:]] - self.doc_starts

    def _check(self, ipath: str, bpath: str, n_seq: int, n_doc: int) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if n_doc < 1 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
            raise DataError(ipath, "corrupt document indices (must start at 0, never decrease and end at "
                                   f"the sequence count {n_seq})")
        if np.any(lengths < 0):
            raise DataError(ipath, "corrupt index: negative sequence length")
        item = self.dtype.itemsize
        expected = np.zeros(n_seq, dtype=np.int64)
        if n_seq > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * item, out=expected[1:])
        if n_seq and not np.array_equal(expected, pointers):
            raise DataError(ipath, "corrupt index: byte pointers disagree with the sequence lengths")
        want = int(lengths.astype(np.int64).sum()) * item
        have = os.path.getsize(bpath)
        if have != want:
            raise DataError(bpath, f"truncated or corrupt data: {have} bytes, the index needs {want} "
                                   f"({int(lengths.sum())} tokens of {self.dtype})")

    @property
    def num_docs(self) -> int:
        return len(self.doc_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.doc_lengths.sum())

    def doc(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of document i from offset (a view into the memory map)."""
        start = int(self.doc_starts[i]) + offset
        end = int(self.doc_starts[i] + self.doc_lengths[i]) if length is None else start + length
        return self._bin[start:end]

    def tokens(self) -> np.ndarray:
        """All tokens as one memory-mapped array."""
        return self._bin
