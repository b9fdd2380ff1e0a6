"""Data preparation end to end: the input formats, one-line errors from the CLI, the .bin prefix,
the seeded random validation split by document, and weighted blends of several preprocessed corpora."""
import gzip
import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data.dataset import sample_split_documents
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from data.pipeline import build_data
from data.preprocess import preprocess, read_metadata
from data.tokenizer import Tokenizer
from tests.data.conftest import write_jsonl
from tests.data.test_preprocess_roundtrip import _megatron_style_read
from tests.data.test_train_builtin import ROOT


def _docs(tag: str, n: int) -> list[str]:
    return [f"{tag} document {i}: " + " ".join(f"{tag}{j}" for j in range(i % 7 + 3)) + "\n" for i in range(n)]


def _ids(tok: Tokenizer, docs) -> list[list[int]]:
    return [tok.encode(d) + [tok.eos_id] for d in docs]


def _read(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds.doc(i).tolist() for i in range(ds.num_docs)]


def _cfg(**kw):
    base = dict(prefix=None, blend=None, tokenizer=None, split=[80.0, 20.0], split_seed=1234, valid_samples=16,
                seed=None, pad_vocab_multiple=128, prefetch=2, cache_dir=None, builtin=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "data.preprocess", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_jsonl_compressed_jsonl_parquet_and_saved_datasets_in_one_folder(tmp_path, tokenizer_model, caplog):
    tok = Tokenizer(tokenizer_model)
    parts = {k: _docs(k, 3) for k in "abcde"}
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", parts["a"], field="body")
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in parts["b"])
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"body": t}) + "\n" for t in parts["c"]).encode()))
    pq.write_table(pa.table({"body": parts["d"], "n": [1, 2, 3]}), folder / "d.parquet")
    datasets.Dataset.from_dict({"body": parts["e"], "n": [1, 2, 3]}).save_to_disk(str(folder / "sub" / "e_saved"))
    with gzip.open(folder / "f_empty.jsonl.gz", "wt"):
        pass  # decompresses to nothing: no documents, no error, named in a warning
    (folder / "README.md").write_text("not data")
    (folder / ".hidden.jsonl").write_text("{}\n")
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        stats = preprocess([str(folder)], str(tmp_path / "all"), tokenizer_model, text_field="body", progress=False)
    assert _read(str(tmp_path / "all")) == _ids(tok, sum((parts[k] for k in "abcde"), []))  # sorted path order
    assert stats.documents == 15 and stats.text_bytes == sum(len(t.encode()) for t in sum(parts.values(), []))
    # the saved folder is one source (its state.json / dataset_info.json are not read as JSON data)
    meta = read_metadata(str(tmp_path / "all"))
    assert [(s["source"].split("/")[-1], s["documents"]) for s in meta["sources"]] == [
        ("a.jsonl", 3), ("b.jsonl.gz", 3), ("c.jsonl.zst", 3), ("d.parquet", 3), ("f_empty.jsonl.gz", 0),
        ("e_saved", 3)]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "ignoring 1 file(s) of unknown type" in warned[0] and "README.md" in warned[0]
    assert warned[1] == f"1 input(s) held no records at all: {folder / 'f_empty.jsonl.gz'}", warned
    # a saved DatasetDict: --split picks the split; a missing one names those that exist
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": parts["a"]}),
                          "validation": datasets.Dataset.from_dict({"text": parts["b"]})}).save_to_disk(
        str(tmp_path / "dd"))
    preprocess([str(tmp_path / "dd")], str(tmp_path / "dd_valid"), tokenizer_model, split="validation",
               progress=False)
    assert _read(str(tmp_path / "dd_valid")) == _ids(tok, parts["b"])
    with pytest.raises(DataError, match=r"no split 'test'; splits are \['train', 'validation'\] \(set --split\)"):
        preprocess([str(tmp_path / "dd")], str(tmp_path / "x"), tokenizer_model, split="test", progress=False)


@pytest.mark.parametrize("kind", ["parquet", "saved"])
def test_a_wrong_field_names_the_fields_that_exist(tmp_path, tokenizer_model, kind):
    if kind == "parquet":
        src = tmp_path / "d.parquet"
        pq.write_table(pa.table({"content": ["x y"], "id": [1]}), src)
    else:
        src = tmp_path / "saved"
        datasets.Dataset.from_dict({"content": ["x y"], "id": [1]}).save_to_disk(str(src))
    with pytest.raises(DataError) as e:
        preprocess([str(src)], str(tmp_path / "o"), tokenizer_model, text_field="text", progress=False)
    assert str(e.value) == f"{src}: no text field 'text'; fields are ['content', 'id'] (set --text-field)"


def test_cli_wrong_field_and_unknown_format_are_one_line_exit_2_and_a_bin_prefix_is_stripped(tmp_path, capsys,
                                                                                             tokenizer_model):
    from data.preprocess import main

    src = write_jsonl(tmp_path / "d.jsonl", _docs("w", 4))
    r = _cli("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer", tokenizer_model,
             "--text-field", "body", "--workers", "1")  # the real command, once
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"input error: {src}: no text field 'body'; fields are ['other', 'text'] "
                                     "(set --text-field)"]
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(SystemExit) as e:
        main(["--input", str(tmp_path / "t.csv"), "--output-prefix", str(tmp_path / "o"), "--tokenizer",
              tokenizer_model])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"input error: {tmp_path / 't.csv'}: unknown file type; expected .jsonl")
    assert not list(tmp_path.glob("o*"))  # nothing written
    # `--output-prefix out/x.bin` writes out/x.bin + out/x.idx (+ x.json), never x.bin.bin
    main(["--input", str(src), "--output-prefix", str(tmp_path / "x.bin"), "--tokenizer", tokenizer_model,
          "--workers", "1", "--no-progress"])
    out = capsys.readouterr()
    assert sorted(p.name for p in tmp_path.glob("x*")) == ["x.bin", "x.idx", "x.json"]
    assert f"wrote {tmp_path / 'x'}.bin/.idx: 4 documents" in out.out and out.err == ""  # --no-progress
    assert _read(str(tmp_path / "x")) == _ids(Tokenizer(tokenizer_model), _docs("w", 4))


def test_megatron_dtype_codes_and_layout_for_large_vocabularies(tmp_path):
    # uint16 (code 8) is checked on real preprocessing output in test_preprocess_roundtrip; int32 here
    w = IndexedDatasetWriter(str(tmp_path / "big"), np.int32)
    w.add_documents(np.array([70000, 128000, 1, 2, 3]), np.array([2, 3]))
    w.finalize()
    code, seqs, doc_idx = _megatron_style_read(str(tmp_path / "big"))
    assert code == 4 and [s.tolist() for s in seqs] == [[70000, 128000], [1, 2, 3]] and doc_idx.tolist() == [0, 1, 2]


def test_seeded_random_split_by_document():
    a = sample_split_documents(1000, [98, 2], seed=5, where="x")
    assert [len(p) for p in a] == [980, 20]
    assert np.array_equal(np.sort(np.concatenate(a)), np.arange(1000))  # disjoint and complete
    assert all(np.all(np.diff(p) > 0) for p in a)  # sorted ids
    b = sample_split_documents(1000, [98, 2], seed=5, where="x")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))  # same seed, same split
    c = sample_split_documents(1000, [98, 2], seed=6, where="x")
    assert not np.array_equal(a[1], c[1])  # another seed, another split
    assert a[1].min() < 300 and a[1].max() > 700  # spread over the file, not its tail
    assert [len(p) for p in sample_split_documents(10, [99, 1], 0, "x")] == [9, 1]  # never empty when asked for
    assert [len(p) for p in sample_split_documents(10, [100, 0], 0, "x")] == [10, 0]


def test_validation_split_samples_every_source_of_a_prefix_and_follows_split_seed(tmp_path, tokenizer_model):
    # Two sources written one after the other into one dataset: the old split (the last 20% of the
    # documents) took validation from the second source only.
    first, second = write_jsonl(tmp_path / "1.jsonl", _docs("p", 40)), write_jsonl(tmp_path / "2.jsonl", _docs("q", 40))
    prefix = str(tmp_path / "two")
    preprocess([str(first), str(second)], prefix, tokenizer_model, progress=False)
    n_first = read_metadata(prefix)["sources"][0]["documents"]
    assert n_first == 40

    def split_of(split_seed, seed=1):
        cfg = _cfg(prefix=prefix, tokenizer=tokenizer_model, split_seed=split_seed, cache_dir=str(tmp_path / "c"))
        data = build_data(cfg, seq_len=16, seed=seed, train_samples=32, model_vocab_size=512)
        return data, np.asarray(data.train.doc_ids), np.asarray(data.valid.doc_ids)

    data, train, valid = split_of(7)
    assert len(valid) == 16 and np.array_equal(np.sort(np.concatenate([train, valid])), np.arange(80))
    assert (valid < n_first).any() and (valid >= n_first).any()  # both sources in validation
    assert data.split == {"split": [80.0, 20.0], "split_seed": 7, "valid_documents": {prefix: 16}}
    assert np.array_equal(split_of(7, seed=2)[2], valid)  # the training seed does not move it
    assert not np.array_equal(split_of(8)[2], valid)  # data.split_seed does
    # the validation samples read only validation documents
    vdocs = {tuple(IndexedDataset(prefix).doc(int(i)).tolist()) for i in valid}
    stream = np.concatenate([np.asarray(d) for d in vdocs])
    assert np.isin(data.valid[0], stream).all()


def test_a_split_by_documents_that_is_not_what_data_split_says_is_warned(tmp_path, tokenizer_model, caplog):
    """The split is by documents: one long document drawn for validation took 99% of a small corpus's tokens,
    and the run trained on the rest many times over, with only an INFO line counting documents."""
    long = " ".join(f"w{j}" for j in range(3000)) + "\n"
    docs = _docs("p", 9) + [long]
    prefix = str(tmp_path / "lopsided")
    preprocess([str(write_jsonl(tmp_path / "l.jsonl", docs))], prefix, tokenizer_model, progress=False)
    ind = IndexedDataset(prefix)
    long_id = int(np.argmax(ind.doc_lengths))
    for seed in range(200):  # a split seed that draws the long document for validation (1 of 10 held out)
        if long_id in sample_split_documents(10, [90.0, 10.0], seed, "x")[1]:
            break
    cfg = _cfg(prefix=prefix, tokenizer=tokenizer_model, split=[90.0, 10.0], split_seed=seed,
               cache_dir=str(tmp_path / "c"))
    with caplog.at_level(logging.INFO, logger="data.pipeline"):
        data = build_data(cfg, seq_len=16, seed=1, train_samples=64, model_vocab_size=512)
    held = ind.doc_lengths[long_id] / ind.num_tokens
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"validation documents of {prefix} hold {100 * held:.1f}% of its tokens, against the 10.0% of "
               "documents" in w for w in warnings), warnings
    train_tokens = int(data.train.doc_lengths.sum())
    assert any(f"training split of {prefix} ({train_tokens} tokens) is read {data.train.num_epochs} times over"
               in w for w in warnings), warnings
    assert data.train.num_epochs > 1
    info = [r.getMessage() for r in caplog.records if "validation = a random 10.00% of the documents" in r.getMessage()]
    assert info and f"1 documents, {held:.2%} of its tokens" in info[0], info


def test_blend_of_two_preprocessed_corpora_follows_the_weights(tmp_path, tokenizer_model):
    # Letters-only and digits-only corpora: a sample (packed within one corpus) tells its corpus by its tokens.
    words = [" ".join("abcdefgh"[(i + j) % 8] * (j % 3 + 1) for j in range(12)) + "\n" for i in range(30)]
    digits = [" ".join(str((i * 7 + j) % 1000) for j in range(12)) + "\n" for i in range(30)]
    for name, docs in (("words", words), ("digits", digits)):
        preprocess([str(write_jsonl(tmp_path / f"{name}.jsonl", docs))], str(tmp_path / name), tokenizer_model,
                   progress=False)
    tok_sets = {n: set(IndexedDataset(str(tmp_path / n)).tokens().tolist()) for n in ("words", "digits")}
    only_words = tok_sets["words"] - tok_sets["digits"]
    only_digits = tok_sets["digits"] - tok_sets["words"]
    forms = [f"0.8 {tmp_path / 'words'} 0.2 {tmp_path / 'digits.bin'}",  # Megatron's --data-path form
             [[0.8, str(tmp_path / "words")], [0.2, str(tmp_path / "digits")]],
             [4, str(tmp_path / "words"), 1, str(tmp_path / "digits")]]  # relative weights, flat
    runs = []
    for blend in forms:
        cfg = _cfg(blend=blend, tokenizer=tokenizer_model, cache_dir=str(tmp_path / "c"))
        data = build_data(cfg, seq_len=16, seed=3, train_samples=500, model_vocab_size=512)
        assert [p for _, p in data.sources] == [str(tmp_path / "words"), str(tmp_path / "digits")]
        runs.append([data.train[i] for i in range(500)])
    assert all(np.array_equal(x, y) for r in runs[1:] for x, y in zip(runs[0], r))  # the three forms agree
    kinds = []
    for s in runs[0]:
        w, d = bool(only_words & set(s.tolist())), bool(only_digits & set(s.tolist()))
        assert w != d, s
        kinds.append(w)
    assert abs(np.mean(kinds) - 0.8) <= 0.01  # 400 of 500 from the 0.8 corpus (greedy blending: within 1 sample)
    assert abs(np.mean(kinds[:100]) - 0.8) <= 0.01  # already over the first steps


def test_progress_lines_in_a_log_every_interval_and_none_when_disabled():
    import io

    from data.progress import Progress

    now = [0.0]
    log_file = io.StringIO()  # not a terminal: whole lines, every `every` seconds
    p = Progress(True, stream=log_file, every=30.0, clock=lambda: now[0])
    for t in (10.0, 20.0, 31.0, 40.0, 62.0):
        now[0] = t
        p.update(100, 5000, 20000, skipped=2)
    p.close()
    lines = log_file.getvalue().splitlines()
    assert len(lines) == 3  # at 31 s, at 62 s, and the final line
    assert lines[-1] == ("preprocess: 500 docs (8 docs/s) | 25.00k tokens (403 tokens/s) | 100.00kB text "
                         "(1.61kB/s) | skipped 2 empty | 62.0 s")
    quiet = io.StringIO()
    q = Progress(False, stream=quiet, every=0.0, clock=lambda: now[0])
    q.update(1, 1, 1)
    q.close()
    assert quiet.getvalue() == ""
