"""Preprocessing round trip and Megatron MMIDIDX format compatibility."""
import json
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.indexed_dataset import IndexedDataset, write_index
from data.preprocess import preprocess, read_metadata
from data.tokenizer import Tokenizer
from tests.data.conftest import UNICODE_DOC, write_jsonl


def test_every_document_is_its_encoding_plus_eos(dataset_prefix, texts, tokenizer_model):
    tok = Tokenizer(tokenizer_model)
    ds = IndexedDataset(dataset_prefix)
    assert ds.num_docs == len(texts)
    assert ds.dtype == np.uint16  # 400 pieces fit uint16
    for i, text in enumerate(texts):
        assert ds.doc(i).tolist() == tok.encode(text) + [tok.eos_id], i
    # identity normalisation + byte fallback: text survives exactly, unicode included
    k = texts.index(UNICODE_DOC)
    assert tok.decode(ds.doc(k)[:-1]) == UNICODE_DOC
    meta = read_metadata(dataset_prefix)
    assert meta["documents"] == len(texts) and meta["tokens"] == ds.num_tokens
    assert meta["tokenizer_sha256"] == tok.fingerprint()


def _megatron_style_read(prefix):
    """An independent reader written from Megatron-LM's documented .idx layout."""
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        assert struct.unpack("<Q", f.read(8))[0] == 1
        code = struct.unpack("<B", f.read(1))[0]
        n_seq = struct.unpack("<Q", f.read(8))[0]
        n_doc = struct.unpack("<Q", f.read(8))[0]
        lengths = np.frombuffer(f.read(4 * n_seq), dtype="<i4")
        pointers = np.frombuffer(f.read(8 * n_seq), dtype="<i8")
        doc_idx = np.frombuffer(f.read(8 * n_doc), dtype="<i8")
        assert f.read() == b""
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
             8: np.uint16}[code]
    data = np.fromfile(prefix + ".bin", dtype=dtype)
    seqs = [data[p // np.dtype(dtype).itemsize:][:n] for p, n in zip(pointers, lengths)]
    return code, seqs, doc_idx


def test_written_files_follow_megatron_layout(dataset_prefix, texts, tokenizer_model):
    tok = Tokenizer(tokenizer_model)
    code, seqs, doc_idx = _megatron_style_read(dataset_prefix)
    assert code == 8  # Megatron's code for uint16
    assert doc_idx.tolist() == list(range(len(texts) + 1))  # one sequence per document, leading 0
    assert [s.tolist() for s in seqs] == [tok.encode(t) + [tok.eos_id] for t in texts]


def test_reads_megatron_written_bytes_with_several_sequences_per_document(tmp_path):
    # Hand-built exactly as Megatron's IndexedDatasetBuilder writes it: int32 tokens (code 4),
    # 3 sequences in 2 documents (sentence-split style): doc 0 = seqs 0,1; doc 1 = seq 2.
    seqs = [[5, 6, 7], [8], [9, 10]]
    prefix = str(tmp_path / "m")
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4) + struct.pack("<Q", 3)
           + struct.pack("<Q", 3) + struct.pack("<3i", 3, 1, 2) + struct.pack("<3q", 0, 12, 16)
           + struct.pack("<3q", 0, 2, 3))
    open(prefix + ".idx", "wb").write(idx)
    open(prefix + ".bin", "wb").write(np.array(sum(seqs, []), dtype="<i4").tobytes())
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and ds.num_docs == 2
    assert ds.doc(0).tolist() == [5, 6, 7, 8] and ds.doc(1).tolist() == [9, 10]
    # and our writer produces byte-identical index bytes for the same content
    with open(tmp_path / "ours.idx", "wb") as f:
        write_index(f, np.int32, np.array([3, 1, 2]), np.array([0, 2, 3]))
    assert (tmp_path / "ours.idx").read_bytes() == idx


def test_parquet_text_and_folder_inputs(tmp_path, tokenizer_model):
    tok = Tokenizer(tokenizer_model)
    docs = ["def f(x):\n    return x\n", "print('hello')\n", "class A:\n    pass\n"]
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"content": docs[:2]}), folder / "a.parquet")
    write_jsonl(folder / "b.jsonl", docs[2:], field="content")
    preprocess([str(folder)], str(tmp_path / "p"), tokenizer_model, text_field="content", workers=1, progress=False)
    got = IndexedDataset(str(tmp_path / "p"))
    assert [got.doc(i).tolist() for i in range(got.num_docs)] == [tok.encode(d) + [tok.eos_id] for d in docs]
    (tmp_path / "t.txt").write_text("line one\nline two\n")
    preprocess([str(tmp_path / "t.txt")], str(tmp_path / "t"), tokenizer_model, text_sample_by="line", progress=False)
    t = IndexedDataset(str(tmp_path / "t"))
    assert [t.doc(i).tolist() for i in range(t.num_docs)] == [tok.encode(d) + [tok.eos_id] for d in ("line one", "line two")]


def test_int32_tokens_for_large_vocabularies(tmp_path):
    from data.indexed_dataset import IndexedDatasetWriter, token_dtype

    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.int32
    w = IndexedDatasetWriter(str(tmp_path / "big"), token_dtype(128256))
    w.add_documents(np.array([70000, 128000, 1]), np.array([2, 1]))
    w.finalize()
    ds = IndexedDataset(str(tmp_path / "big"))
    assert ds.dtype == np.int32 and ds.doc(0).tolist() == [70000, 128000]


def test_command_line(tmp_path, tokenizer_model, dataset_prefix, texts):
    import subprocess
    import sys

    from tests.data.test_train_builtin import ROOT

    src = write_jsonl(tmp_path / "d.jsonl", texts)
    cmd = [sys.executable, "-m", "data.preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "cli"),
           "--tokenizer", tokenizer_model, "--workers", "2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{len(texts)} documents" in r.stdout and "tokens/s" in r.stdout
    assert "docs/s" in r.stderr and "tokens/s" in r.stderr and "B/s" in r.stderr  # the progress line
    for ext in (".bin", ".idx"):
        assert open(str(tmp_path / "cli") + ext, "rb").read() == open(dataset_prefix + ext, "rb").read()
    r = subprocess.run(cmd[:4] + [str(tmp_path / "missing.jsonl")] + cmd[5:], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2  # an input error (amsp/errors.py)
    assert r.stderr.strip().splitlines()[-1] == (f"input error: {tmp_path / 'missing.jsonl'}: input file or folder "
                                                 "not found")
