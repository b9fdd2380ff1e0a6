"""Each bad input is a one-line DataError naming the file (or key) and the problem; nothing is damaged."""
import os
import shutil
from types import SimpleNamespace

import pytest

from data.indexed_dataset import IndexedDataset
from data.pipeline import build_data
from data.preprocess import preprocess
from data.tokenizer import Tokenizer, check_fits_model, train_bpe
from tests.data.conftest import raises_one_line, write_jsonl


def test_missing_input_file(tmp_path, tokenizer_model):
    missing = str(tmp_path / "nope.jsonl")
    raises_one_line(lambda: preprocess([missing], str(tmp_path / "o"), tokenizer_model, progress=False),
                    missing, "not found")
    raises_one_line(lambda: preprocess([str(tmp_path / "x.jsonl")], str(tmp_path / "o"), str(tmp_path / "t.model"),
                                       progress=False), "t.model", "not found")


def test_empty_input_and_empty_folder(tmp_path, tokenizer_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    raises_one_line(lambda: preprocess([str(empty)], str(tmp_path / "o"), tokenizer_model, progress=False),
                    str(empty), "empty input")
    (tmp_path / "dir").mkdir()
    raises_one_line(lambda: preprocess([str(tmp_path / "dir")], str(tmp_path / "o"), tokenizer_model, progress=False),
                    "dir", "no ")
    assert not any(p.name.startswith("o.") for p in tmp_path.iterdir())  # nothing written


def test_nonexistent_text_field(tmp_path, tokenizer_model):
    src = write_jsonl(tmp_path / "d.jsonl", ["hello"], field="body")
    raises_one_line(lambda: preprocess([str(src)], str(tmp_path / "o"), tokenizer_model, text_field="text",
                                       progress=False), str(src), "no text field 'text'", "body")


def test_undecodable_bytes_leave_an_existing_dataset_untouched(tmp_path, tokenizer_model, dataset_prefix):
    prefix = str(tmp_path / "out")
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(dataset_prefix + ext, prefix + ext)
    before = {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx", ".json")}
    good = write_jsonl(tmp_path / "a.jsonl", ["fine text " * 50] * 200)
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "broken \xff\xfe bytes"}\n')
    raises_one_line(lambda: preprocess([str(good), str(bad)], prefix, tokenizer_model, workers=2, progress=False),
                    str(bad), "undecodable bytes")
    assert {ext: open(prefix + ext, "rb").read() for ext in before} == before
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl", "out.bin", "out.idx", "out.json"]  # no temp files


_PREEMPTED_PREPROCESS = """
import signal, sys
from data.errors import DataError
from data.preprocess import preprocess
caught = []
signal.signal(signal.SIGTERM, lambda *a: caught.append(a[0]))  # like amsp.resilience.PreemptionHandler
for _ in range(int(sys.argv[5])):  # the hang was a race: repeat to give it many chances
    try:
        preprocess(sys.argv[1:3], sys.argv[3], sys.argv[4], workers=2, progress=False)
    except DataError as e:
        print("DataError:", e)
"""


def test_bad_input_stops_the_pool_even_when_sigterm_is_handled(tmp_path, tokenizer_model):
    # A training run holds a SIGTERM handler that only records the signal. Forked pool workers used
    # to inherit it, so the SIGTERM that Pool.terminate() sends on an input error was swallowed and
    # the pool's join waited forever. Run in a subprocess so a regression fails on the timeout.
    import subprocess
    import sys

    good = write_jsonl(tmp_path / "a.jsonl", ["fine text " * 50] * 400)
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "broken \xff\xfe bytes"}\n')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    repeats = 20
    proc = subprocess.run([sys.executable, "-c", _PREEMPTED_PREPROCESS, str(good), str(bad), str(tmp_path / "o"),
                           tokenizer_model, str(repeats)], capture_output=True, text=True, timeout=180, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("undecodable bytes") == repeats, proc.stdout


@pytest.mark.parametrize("damage, names", [
    ("truncate_bin", (".bin", "truncated or corrupt data")),
    ("truncate_idx", (".idx", "truncated or corrupt index")),
    ("bad_header", (".idx", "not an MMIDIDX")),
    ("bad_pointer", (".idx", "byte pointers disagree")),
    ("missing_bin", (".bin", "not found")),
])
def test_corrupt_or_truncated_files(tmp_path, dataset_prefix, damage, names):
    prefix = str(tmp_path / "c")
    for ext in (".bin", ".idx"):
        shutil.copy(dataset_prefix + ext, prefix + ext)
    idx = bytearray(open(prefix + ".idx", "rb").read())
    if damage == "truncate_bin":
        os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") - 2)
    elif damage == "truncate_idx":
        open(prefix + ".idx", "wb").write(idx[:-5])
    elif damage == "bad_header":
        open(prefix + ".idx", "wb").write(b"NOTANIDX\x00" + idx[9:])
    elif damage == "bad_pointer":
        n_seq = int.from_bytes(idx[18:26], "little")
        off = 34 + 4 * n_seq + 8 * 2  # third pointer
        idx[off] ^= 0x40
        open(prefix + ".idx", "wb").write(idx)
    elif damage == "missing_bin":
        os.remove(prefix + ".bin")
    raises_one_line(lambda: IndexedDataset(prefix), prefix + names[0], names[1])


def test_tokenizer_larger_than_the_model_names_both_sizes(tokenizer_model):
    tok = Tokenizer(tokenizer_model)  # 400 pieces -> padded to 512 with multiple 128
    raises_one_line(lambda: check_fits_model(tok, 500, 128), "400", "512", "model.vocab_size=500")
    assert check_fits_model(tok, 512, 128) == 512
    assert check_fits_model(tok, 400, 8) == 400


def _data_cfg(**kw):
    base = dict(prefix=None, blend=None, tokenizer=None, split=[90.0, 10.0], split_seed=1234, valid_samples=8,
                seed=None, pad_vocab_multiple=128, prefetch=2, cache_dir=None, builtin=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_dataset_made_with_another_tokenizer(tmp_path, dataset_prefix, texts):
    (tmp_path / "t.txt").write_text("\n".join(texts[:5]))
    other = train_bpe([str(tmp_path / "t.txt")], str(tmp_path / "other"), vocab_size=200, byte_fallback=False,
                      threads=1)
    cfg = _data_cfg(prefix=dataset_prefix, tokenizer=other, cache_dir=str(tmp_path / "cache"))
    raises_one_line(lambda: build_data(cfg, seq_len=16, seed=1, train_samples=10, model_vocab_size=512),
                    dataset_prefix + ".json", "different models")
    # without the metadata record the token ids themselves are checked
    prefix = str(tmp_path / "nometa")
    for ext in (".bin", ".idx"):
        shutil.copy(dataset_prefix + ext, prefix + ext)
    cfg = _data_cfg(prefix=prefix, tokenizer=other, cache_dir=str(tmp_path / "cache"))
    raises_one_line(lambda: build_data(cfg, seq_len=16, seed=1, train_samples=10, model_vocab_size=512),
                    prefix + ".bin", "token id", "200 pieces")


def test_config_errors_name_the_key(tmp_path, dataset_prefix, tokenizer_model):
    raises_one_line(lambda: build_data(_data_cfg(prefix=dataset_prefix), seq_len=16, seed=1, train_samples=10,
                                       model_vocab_size=512), "data.tokenizer", "required")
    raises_one_line(lambda: build_data(_data_cfg(blend=[[0.5, dataset_prefix], [-1, dataset_prefix]],
                                                 tokenizer=tokenizer_model), seq_len=16, seed=1, train_samples=10,
                                       model_vocab_size=512), "data.blend", "positive")
    second = str(tmp_path / "second")  # another dataset: a prefix listed twice is refused (same sample stream)
    for ext in (".bin", ".idx", ".json"):
        shutil.copyfile(dataset_prefix + ext, second + ext)
    cfg = _data_cfg(blend=[[0.7, dataset_prefix], [0.3, second]], tokenizer=tokenizer_model,
                    cache_dir=str(tmp_path / "cache"))
    data = build_data(cfg, seq_len=16, seed=1, train_samples=100, model_vocab_size=512)
    assert len(data.train) == 100 and data.valid is not None and 0 < data.unigram_entropy < 7


def test_builtin_tokenizer_size_follows_the_model():
    from data.pipeline import builtin_vocab_size

    cfg = _data_cfg(builtin=SimpleNamespace(vocab_size=None))
    assert builtin_vocab_size(cfg, 8192) == 8192 and builtin_vocab_size(cfg, 512) == 512
    assert builtin_vocab_size(cfg, 128256) == 32000 and builtin_vocab_size(cfg, 1000) == 896
    raises_one_line(lambda: builtin_vocab_size(cfg, 256), "model.vocab_size", "too small")
    assert builtin_vocab_size(_data_cfg(builtin=SimpleNamespace(vocab_size=1000)), 8192) == 1000


def test_missing_paths_are_errors_and_bare_names_mean_hub_datasets(tmp_path, monkeypatch):
    from data.sources import resolve_inputs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    assert resolve_inputs(["allenai/c4", "wikitext"]) == [("allenai/c4", "hub"), ("wikitext", "hub")]
    for missing in ("docs.jsonl", "./docs", "/abs/docs", "corpus/part1", "a b"):
        raises_one_line(lambda: resolve_inputs([missing]), missing, "not found")


def test_null_and_empty_text_records_are_counted_not_silently_dropped(tmp_path, tokenizer_model, caplog):
    import json
    import logging

    src = tmp_path / "mixed.jsonl"
    rows = [{"text": "kept one " * 20}, {"text": None}, {"text": ""}, {"text": "kept two " * 20}, {"other": 1}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = str(tmp_path / "o")
    with caplog.at_level(logging.WARNING, logger="data.preprocess"):
        stats = preprocess([str(src)], prefix, tokenizer_model, progress=False)
    assert stats.documents == 2 and stats.skipped_empty == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"skipped 3 of 5 records with no text: 3 records whose 'text' field was null, missing or "
                        f"empty ({src}: 3)"]
    assert json.load(open(prefix + ".json"))["skipped_empty"] == 3
    assert IndexedDataset(prefix).num_docs == 2
    # nothing but null/empty text: the error says how many records were skipped
    only = tmp_path / "nulls.jsonl"
    only.write_text('{"text": null}\n{"text": ""}\n')
    raises_one_line(lambda: preprocess([str(only)], str(tmp_path / "n"), tokenizer_model, progress=False),
                    str(only), "empty input", "(2 records with null or empty text)")


def test_clean_input_logs_no_skip_warning(tmp_path, tokenizer_model, caplog):
    import logging

    src = write_jsonl(tmp_path / "clean.jsonl", ["fine text " * 20] * 3)
    with caplog.at_level(logging.WARNING, logger="data.preprocess"):
        stats = preprocess([str(src)], str(tmp_path / "o"), tokenizer_model, progress=False)
    assert stats.skipped_empty == 0 and not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("split, docs, why", [
    ([100.0, 0.0], None, "data.split=[100.0, 0.0] gives the validation split no documents"),
    ([90.0, 10.0], 1, "too few documents for a validation split with data.split=[90.0, 10.0]: {prefix} "
                      "(1 documents)"),
])
def test_empty_validation_split_warns_once(tmp_path, dataset_prefix, tokenizer_model, caplog, monkeypatch,
                                           split, docs, why):
    import logging

    monkeypatch.delenv("RANK", raising=False)
    prefix = dataset_prefix
    if docs is not None:
        prefix = str(tmp_path / "one")
        preprocess([str(write_jsonl(tmp_path / "one.jsonl", ["a single document " * 100]))], prefix,
                   tokenizer_model, progress=False)
    cfg = _data_cfg(prefix=prefix, tokenizer=tokenizer_model, split=split, cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="data.pipeline"):
        data = build_data(cfg, seq_len=16, seed=1, train_samples=10, model_vocab_size=512)
    assert data.valid is None and len(data.train) >= 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["validation is off: " + why.format(prefix=prefix) + (
        " (each source needs at least 2 documents; add data or raise the validation share)" if docs else
        " (set a validation share, e.g. [98, 2])")]
    # a usable split stays quiet; validation explicitly off (data.valid_samples=0) is not warned about
    caplog.clear()
    for kw in (dict(prefix=dataset_prefix), dict(prefix=prefix, valid_samples=0)):
        with caplog.at_level(logging.WARNING, logger="data.pipeline"):
            build_data(_data_cfg(tokenizer=tokenizer_model, cache_dir=str(tmp_path / "cache"), **kw), seq_len=16,
                       seed=1, train_samples=10, model_vocab_size=512)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
