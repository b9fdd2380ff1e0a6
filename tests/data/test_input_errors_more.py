"""More bad input: a broken line deep in a file is named by its line (and byte offset), SIGTERM and
killed runs leave no temporary files, a prefix needs a file name, and data.blend refuses a prefix
listed twice and weights prefixes given without weights by their tokens (as Megatron does)."""
import gzip
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from data.indexed_dataset import IndexedDataset
from data.pipeline import build_data
from data.preprocess import main, preprocess
from tests.data.conftest import raises_one_line, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lines(n: int, bad_line: int, bad: bytes) -> bytes:
    """n JSON lines of varied length with `bad` as line bad_line (1-based); more rows than one read block."""
    rows = [json.dumps({"text": f"doc {i} " + "word " * (i % 37)}).encode() for i in range(n)]
    rows[bad_line - 1] = bad
    return b"\n".join(rows) + b"\n"


def test_a_line_that_is_not_json_is_one_stderr_line_naming_its_line(tmp_path, tokenizer_model):
    # `datasets` counted the row inside an internal read block ("in row 566") and logged the failure
    # twice on stderr before the error line.
    src = tmp_path / "docs.jsonl"
    src.write_bytes(_lines(6000, 5000, b"not json at line 5000"))
    proc = subprocess.run([sys.executable, "-m", "data.preprocess", "--input", str(src), "--output-prefix",
                           str(tmp_path / "o"), "--tokenizer", tokenizer_model, "--workers", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"input error: {src}: line 5000 is not valid JSON: Expecting value at "
                                        "column 1"], proc.stderr[-2000:]


def test_bad_json_in_compressed_and_multi_line_json_files(tmp_path, tokenizer_model):
    gz = tmp_path / "docs.jsonl.gz"
    gz.write_bytes(gzip.compress(_lines(3000, 2500, b'{"text": "trailing comma",}')))
    raises_one_line(lambda: preprocess([str(gz)], str(tmp_path / "o"), tokenizer_model, progress=False),
                    str(gz), "line 2500 is not valid JSON")
    assert logging.getLogger("datasets").level != logging.CRITICAL + 1  # silenced only while it reads
    # One JSON document over many lines: its first line ("[") alone is no JSON, the error is on line 4.
    doc = tmp_path / "docs.json"
    doc.write_text('[\n {"text": "a"},\n {"text": "b"}\n {"text": "c"}\n]\n')
    raises_one_line(lambda: preprocess([str(doc)], str(tmp_path / "o"), tokenizer_model, progress=False),
                    str(doc), "line 4 is not valid JSON", "delimiter")


@pytest.mark.parametrize("compressed", [False, True])
def test_undecodable_bytes_name_line_and_byte_offset(tmp_path, tokenizer_model, compressed):
    data = _lines(6000, 5000, b'{"text": "bad \xff byte"}')
    offset = data.index(b"\xff")
    src = tmp_path / ("docs.jsonl.gz" if compressed else "docs.jsonl")
    src.write_bytes(gzip.compress(data) if compressed else data)
    msg = raises_one_line(lambda: preprocess([str(src)], str(tmp_path / "o"), tokenizer_model, progress=False),
                          str(src), "undecodable bytes", "line 5000", f"byte offset {offset}", "0xff")
    assert ("decompressed" in msg) == compressed
    txt = tmp_path / "notes.txt"
    txt.write_bytes(b"fine\n" * 3 + b"caf\xc3(\n")
    raises_one_line(lambda: preprocess([str(txt)], str(tmp_path / "o"), tokenizer_model, progress=False),
                    str(txt), "undecodable bytes", "line 4", "byte offset 18")


def _tokens_written(folder) -> bool:
    return any(p.name.startswith("out.bin.tmp-") and p.stat().st_size for p in folder.iterdir())


def test_sigterm_removes_the_temporary_files_and_keeps_the_old_dataset(tmp_path, tokenizer_model, dataset_prefix):
    prefix = str(tmp_path / "out")
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(dataset_prefix + ext, prefix + ext)
    before = {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx", ".json")}
    src = write_jsonl(tmp_path / "big.jsonl", [f"document {i} " + "some words to tokenize " * 40
                                               for i in range(60_000)])
    proc = subprocess.Popen([sys.executable, "-m", "data.preprocess", "--input", str(src), "--output-prefix", prefix,
                             "--tokenizer", tokenizer_model, "--workers", "2", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not _tokens_written(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # until the pool's tokens reach the temporary .bin
        assert proc.poll() is None, "preprocess ended before the SIGTERM; make the input bigger"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM" in err
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl", "out.bin", "out.idx", "out.json"]
    assert {ext: open(prefix + ext, "rb").read() for ext in before} == before


def test_temporary_files_of_killed_runs_are_removed_at_start(tmp_path, tokenizer_model, caplog):
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        old = time.time() - 3600
        stale = [tmp_path / f"out.{ext}.tmp-{dead.pid}" for ext in ("bin", "idx", "json")]
        kept = [tmp_path / f"out.bin.tmp-{live.pid}",  # a live run
                tmp_path / f"out2.bin.tmp-{dead.pid}",  # another prefix
                tmp_path / "out.bin.tmp-notapid"]
        for p in stale + kept:
            p.write_bytes(b"x")
            os.utime(p, (old, old))
        recent = tmp_path / f"out.idx.tmp-{dead.pid + 1_000_000}"  # no such pid, but just written
        recent.write_bytes(b"x")
        src = write_jsonl(tmp_path / "d.jsonl", ["hello world"] * 3)
        with caplog.at_level(logging.WARNING, logger="data.preprocess"):
            preprocess([str(src)], str(tmp_path / "out"), tokenizer_model, progress=False)
    finally:
        live.kill()
        live.wait()
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept) and recent.exists()
    warned = [r.getMessage() for r in caplog.records if "temporary file" in r.getMessage()]
    assert len(warned) == 1 and all(str(p) in warned[0] for p in stale), warned
    assert IndexedDataset(str(tmp_path / "out")).num_docs == 3


def test_an_output_prefix_without_a_file_name_is_refused(tmp_path, tokenizer_model, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", ["hello world"] * 3)
    out = tmp_path / "od"
    out.mkdir()
    for prefix in (f"{out}/", f"{out}/.bin", f"{out}/."):
        raises_one_line(lambda: preprocess([str(src)], prefix, tokenizer_model, progress=False),
                        "--output-prefix", repr(prefix), "no file name")
    with pytest.raises(SystemExit) as e:
        main(["--input", str(src), "--output-prefix", f"{out}/", "--tokenizer", tokenizer_model, "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--output-prefix" in err[0] and "no file name" in err[0], err
    assert os.listdir(out) == []


def _cfg(**kw):
    base = dict(prefix=None, blend=None, tokenizer=None, split=[90.0, 10.0], split_seed=1234, valid_samples=8,
                seed=None, pad_vocab_multiple=128, prefetch=2, cache_dir=None, builtin=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _build(tmp_path, tokenizer_model, **kw):
    cfg = _cfg(tokenizer=tokenizer_model, cache_dir=str(tmp_path / "cache"), **kw)
    return build_data(cfg, seq_len=16, seed=1, train_samples=100, model_vocab_size=512)


def test_a_prefix_listed_twice_in_the_blend_is_refused(tmp_path, tokenizer_model, dataset_prefix):
    # Both members would draw the same samples in the same order (same data, same seed).
    same = os.path.join(os.path.dirname(dataset_prefix), ".", os.path.basename(dataset_prefix) + ".bin")
    for blend in (f"1 {dataset_prefix} 1 {dataset_prefix}", [[0.7, dataset_prefix], [0.3, same]]):
        raises_one_line(lambda: _build(tmp_path, tokenizer_model, blend=blend), "data.blend", dataset_prefix,
                        "twice", "weights added up")
    raises_one_line(lambda: _build(tmp_path, tokenizer_model, prefix=f"{tmp_path}/"), "data.prefix", "no file name")


def test_prefixes_without_weights_are_weighted_by_their_tokens(tmp_path, tokenizer_model, dataset_prefix,
                                                               texts, caplog):
    small = str(tmp_path / "small")
    preprocess([str(write_jsonl(tmp_path / "s.jsonl", texts[:20]))], small, tokenizer_model, progress=False)
    tokens = [IndexedDataset(p).num_tokens for p in (dataset_prefix, small)]
    for blend in (f"{dataset_prefix} {small}", [dataset_prefix, small]):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="data.blending"):
            data = _build(tmp_path, tokenizer_model, blend=blend)
        assert [p for _, p in data.sources] == [dataset_prefix, small]
        assert np.allclose([w for w, _ in data.sources], np.array(tokens) / sum(tokens))
        logged = [r.getMessage() for r in caplog.records if "weighted by tokens" in r.getMessage()]
        assert len(logged) == 1 and f"{tokens[1]:,} tokens" in logged[0], logged
        assert len(data.train) == 100
    data = _build(tmp_path, tokenizer_model, blend=small)  # one prefix alone, as Megatron's --data-path PREFIX
    assert data.sources == [(1.0, small)]


@pytest.mark.parametrize("blend", ["0.5 {a} {b}", "{a} 0.5 {b} 0.5", "0.5 {a} 0.5"])
def test_weights_for_some_prefixes_only_are_an_error(tmp_path, tokenizer_model, dataset_prefix, blend):
    blend = blend.format(a=dataset_prefix, b=str(tmp_path / "b"))
    raises_one_line(lambda: _build(tmp_path, tokenizer_model, blend=blend), "data.blend", "a weight before every "
                    "prefix", "or none")
