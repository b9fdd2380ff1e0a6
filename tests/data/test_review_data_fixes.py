"""What a reviewer's run of the data tools found: silent repetition of the validation split, a contradictory
validation log, meaningless preprocess options accepted, uncounted empty text files, JSON errors without a
line, silent tokenizer sampling, raw sentencepiece errors, and output directories handled two ways."""
import gzip
import json
import logging
import os
from types import SimpleNamespace

import pytest

from data.pipeline import build_data
from data.preprocess import main as preprocess_main
from data.preprocess import preprocess, read_metadata
from data.tokenizer import main as tokenizer_main
from data.tokenizer import train_bpe

from tests.data.conftest import raises_one_line, write_jsonl


def _data_cfg(**kw):
    base = dict(prefix=None, blend=None, tokenizer=None, split=[90.0, 10.0], split_seed=1234, valid_samples=8,
                seed=None, pad_vocab_multiple=128, prefetch=2, cache_dir=None, builtin=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _build(caplog, cfg, level=logging.INFO, **kw):
    caplog.clear()
    with caplog.at_level(level, logger="data"):
        data = build_data(cfg, seq_len=16, seed=1, train_samples=kw.get("train_samples", 10), model_vocab_size=512)
    return data, [r for r in caplog.records if r.name.startswith("data")]


# 1. A validation split too small for data.valid_samples repeats its samples: warned, as training's is.
def test_repeated_validation_split_is_warned(tmp_path, tokenizer_model, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    prefix = str(tmp_path / "short")
    preprocess([str(write_jsonl(tmp_path / "s.jsonl", [f"short document number {i}" for i in range(20)]))], prefix,
               tokenizer_model, progress=False)
    cfg = _data_cfg(prefix=prefix, tokenizer=tokenizer_model, split=[90.0, 10.0], valid_samples=64,
                    cache_dir=str(tmp_path / "cache"))
    data, records = _build(caplog, cfg)
    valid = data.valid
    distinct = int(valid.epoch_bounds[1])
    assert valid.num_epochs > 1 and distinct < 64 <= len(valid)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING and "validation split" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in records]
    assert f"the validation split of {prefix}" in warned[0]
    assert f"holds {distinct} distinct samples of 16+1 tokens" in warned[0]
    assert f"read {valid.num_epochs} times over by its {len(valid)} samples" in warned[0]
    # enough validation text for the samples asked for: no such warning
    _, records = _build(caplog, _data_cfg(prefix=prefix, tokenizer=tokenizer_model, split=[90.0, 10.0],
                                          valid_samples=1, cache_dir=str(tmp_path / "cache")))
    assert not [r for r in records if "validation split" in r.getMessage()]


# 2. "validation is off" is said once: no INFO line after it claiming a validation split.
def test_validation_off_is_said_once(tmp_path, dataset_prefix, tokenizer_model, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    one = str(tmp_path / "one")
    preprocess([str(write_jsonl(tmp_path / "one.jsonl", ["a single document " * 100]))], one, tokenizer_model,
               progress=False)
    cfg = _data_cfg(blend=[[0.5, dataset_prefix], [0.5, one]], tokenizer=tokenizer_model, split=[90.0, 10.0],
                    cache_dir=str(tmp_path / "cache"))
    data, records = _build(caplog, cfg)
    assert data.valid is None
    lines = [r.getMessage() for r in records if "validation" in r.getMessage() and "split of" not in r.getMessage()]
    held = data.split["valid_documents"][dataset_prefix]
    assert held > 0
    assert len(lines) == 1 and lines[0].startswith(
        f"validation is off: too few documents for a validation split with data.split=[90.0, 10.0]: "
        f"{one} (1 documents) (each source needs at least 2 documents; add data or raise the "
        f"validation share); the documents drawn for validation are still left out of training: "
        f"{dataset_prefix}: {held} documents, "), lines
    assert lines[0].endswith("% of its tokens"), lines
    # data.valid_samples=0: no validation set, and the log does not claim one
    cfg = _data_cfg(prefix=dataset_prefix, tokenizer=tokenizer_model, valid_samples=0,
                    cache_dir=str(tmp_path / "cache"))
    data, records = _build(caplog, cfg)
    msgs = [r.getMessage() for r in records]
    assert data.valid is None and not [m for m in msgs if "validation = " in m]
    assert [m for m in msgs if m.startswith("data: no validation set (data.valid_samples=0)")], msgs
    # validation on: the usual line
    _, records = _build(caplog, _data_cfg(prefix=dataset_prefix, tokenizer=tokenizer_model,
                                          cache_dir=str(tmp_path / "cache")))
    assert [r for r in records if r.getMessage().startswith("data: validation = a random 10.00%")]


def _cli_error(capsys, fn, argv):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    err = capsys.readouterr().err.strip()
    return e.value.code, err


# 3. --progress-every must be positive; --split is refused where no input has splits.
@pytest.mark.parametrize("every", ["0", "-5", "nan"])
def test_progress_every_must_be_positive(tmp_path, tokenizer_model, capsys, every):
    src = write_jsonl(tmp_path / "a.jsonl", ["some text"])
    code, err = _cli_error(capsys, preprocess_main, ["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                                                     "--tokenizer", tokenizer_model, "--workers", "1",
                                                     "--progress-every", every])
    assert code == 2 and len(err.splitlines()) == 1 and "--progress-every" in err and "> 0" in err, err
    assert not os.path.exists(tmp_path / "o.bin")


def test_split_refused_for_local_files(tmp_path, tokenizer_model, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", ["some text"])
    code, err = _cli_error(capsys, preprocess_main, ["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                                                     "--tokenizer", tokenizer_model, "--workers", "1",
                                                     "--no-progress", "--split", "nosuch"])
    assert code == 2 and len(err.splitlines()) == 1 and "--split" in err and "'nosuch'" in err, err
    assert str(src) in err and not os.path.exists(tmp_path / "o.bin")
    # without --split the same input is read as before
    assert preprocess([str(src)], str(tmp_path / "o"), tokenizer_model, progress=False).documents == 1


# 4. An empty .txt read one document per file is counted and warned as an empty record is, in words for text.
def test_empty_text_file_is_counted(tmp_path, tokenizer_model, caplog):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "n.jsonl").write_text('{"text": "x"}\n{"text": null}\n')
    inputs = [str(tmp_path / n) for n in ("empty.txt", "a.txt", "n.jsonl")]
    with caplog.at_level(logging.WARNING, logger="data.preprocess"):
        stats = preprocess(inputs, str(tmp_path / "o"), tokenizer_model, progress=False)
    assert stats.documents == 2 and stats.skipped_empty == 2
    meta = read_metadata(str(tmp_path / "o"))
    assert meta["sources"][0] == {"source": inputs[0], "documents": 0, "skipped_empty": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"skipped 2 of 4 records with no text: 1 records whose 'text' field was null, missing or "
                        f"empty ({inputs[2]}: 1); 1 empty text files ({inputs[0]}: 1)"], warnings
    # one document per line: an empty file has no lines, so nothing is skipped
    caplog.clear()
    stats = preprocess(inputs[:2], str(tmp_path / "l"), tokenizer_model, text_sample_by="line", progress=False)
    assert stats.skipped_empty == 0


def test_an_input_without_any_record_is_named(tmp_path, tokenizer_model, caplog):
    """An empty JSONL file (or an empty text file read by line) gave 0 documents and no warning: nothing was
    skipped from it, so only PREFIX.json's per-source counts showed it."""
    (tmp_path / "none.jsonl").write_text("")
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n')
    inputs = [str(tmp_path / n) for n in ("none.jsonl", "a.jsonl")]
    with caplog.at_level(logging.WARNING, logger="data.preprocess"):
        stats = preprocess(inputs, str(tmp_path / "o"), tokenizer_model, progress=False)
    assert stats.documents == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"1 input(s) held no records at all: {inputs[0]}"], warnings


# 5. JSON that is no record, and text fields holding numbers, are named by file and line.
@pytest.mark.parametrize("lines, where", [
    (['{"text": "a"}', '[1, 2]'], "line 2 is a JSON array, not an object"),
    (['{"text": "a"}', '"str"'], "line 2 is a JSON string, not an object"),
    (['[1, 2]'], "line 1 is a JSON array, not an object"),
    (['{"text": "a"}', '', '{"text": 5}'], "line 3: field 'text' holds int 5, not text"),
    (['{"text": "a"}', '{"text": ["x", "y"]}'], "line 2: field 'text' holds list [\"x\", \"y\"], not text"),
])
def test_json_lines_errors_name_the_line(tmp_path, tokenizer_model, lines, where):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    msg = raises_one_line(lambda: preprocess([str(src)], str(tmp_path / "o"), tokenizer_model, progress=False),
                          str(src), where)
    assert "ArrowInvalid" not in msg and "Column()" not in msg
    gz = tmp_path / "bad.jsonl.gz"  # compressed: the same line
    gz.write_bytes(gzip.compress(src.read_bytes()))
    raises_one_line(lambda: preprocess([str(gz)], str(tmp_path / "o"), tokenizer_model, progress=False), where)


@pytest.mark.parametrize("second, where", [
    ('{"text": "b', "line 2 is not valid JSON: Unterminated string starting at column 10"),
    ('{"text": "b\tc"}\n', "line 2 is not valid JSON: Invalid control character at column 12"),
])
def test_json_error_has_one_at(tmp_path, tokenizer_model, second, where):
    src = tmp_path / "bad.jsonl"  # json's messages for these end in "at": no "at at column"
    src.write_text('{"text": "a"}\n' + second)
    msg = raises_one_line(lambda: preprocess([str(src)], str(tmp_path / "o"), tokenizer_model, progress=False),
                          where)
    assert "at at" not in msg


def test_whole_document_json_non_text_names_the_record(tmp_path, tokenizer_model):
    src = tmp_path / "doc.json"  # one JSON document, not JSON Lines: no line to name, the record instead
    src.write_text(json.dumps([1, 2]))  # datasets reads this as a column 'text' of numbers
    raises_one_line(lambda: preprocess([str(src)], str(tmp_path / "o"), tokenizer_model, progress=False),
                    str(src), "record 1: field 'text' holds int 1, not text")


# 6. Tokenizer training: sampling is said; a vocabulary too small is one line naming --vocab-size and the floor.
def test_tokenizer_sampling_is_warned(tmp_path, caplog):
    src = tmp_path / "lines.txt"
    src.write_text("".join(f"line {i} of some text\n" for i in range(300)))
    with caplog.at_level(logging.INFO, logger="data.tokenizer"):
        tokenizer_main(["--input", str(src), "--prefix", str(tmp_path / "t"), "--vocab-size", "300",
                        "--max-sentences", "150"])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["sentencepiece trains on a random sample of 150 of the 300 lines (--max-sentences 150; "
                      "raise it, or 0, to train on all of them)"], warned
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data.tokenizer"):
        tokenizer_main(["--input", str(src), "--prefix", str(tmp_path / "t2"), "--vocab-size", "300"])
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("argv, expect", [
    (["--vocab-size", "0"], "--vocab-size: 0 is too small: a tokenizer needs at least 261 pieces"),
    (["--vocab-size", "100", "--no-byte-fallback"], None),  # enough for the static floor; the text decides
    (["--vocab-size", "4", "--no-byte-fallback"], "--vocab-size: 4 is too small: a tokenizer needs at least 5"),
    (["--vocab-size", "270"], "--vocab-size: 270 is too small for this text: it needs at least 300 pieces"),
    (["--vocab-size", "5000"], "--vocab-size: 5000 is more pieces than this text yields: at most "),
    (["--vocab-size", "300", "--max-sentences", "50"], "--max-sentences: must be 0 (all lines) or more than 100"),
    (["--vocab-size", "300", "--max-sentences", "-1"], "--max-sentences"),
])
def test_tokenizer_refuses_bad_sizes_in_one_line(tmp_path, capsys, argv, expect):
    src = tmp_path / "t.txt"
    src.write_text("The quick brown fox jumps over the lazy dog, 0123456789 times!\n" * 20)
    args = ["--input", str(src), "--prefix", str(tmp_path / "out" / "t"), *argv]
    if expect is None:
        tokenizer_main(args)
        assert os.path.isfile(tmp_path / "out" / "t.model")
        return
    code, err = _cli_error(capsys, tokenizer_main, args)
    assert code == 2 and len(err.splitlines()) == 1 and expect in err and "INTERNAL" not in err, err
    assert not os.path.exists(tmp_path / "out")  # the directory it made is removed again


@pytest.mark.parametrize("prefix", ["tok/", "tok/.", "."])
def test_tokenizer_prefix_without_a_file_name_is_refused(tmp_path, capsys, monkeypatch, prefix):
    """`--prefix tok/` wrote the hidden files tok/.model and tok/.vocab (data.preprocess refuses `out/`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 20)
    code, err = _cli_error(capsys, tokenizer_main, ["--input", "t.txt", "--prefix", prefix, "--vocab-size", "300"])
    assert code == 2 and err == (f"input error: --prefix: {prefix!r} has no file name; give DIR/NAME to write "
                                 "DIR/NAME.model and DIR/NAME.vocab"), err
    assert sorted(os.listdir(tmp_path)) == ["t.txt"]


def test_train_bpe_names_the_text_floor(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("abc abd abe\n" * 50)  # 6 characters: a b c d e and the space
    raises_one_line(lambda: train_bpe([str(src)], str(tmp_path / "t"), 8, byte_fallback=False, threads=1),
                    "vocab_size", "8 is too small for this text: it needs at least 10 pieces", "6 characters")


# 7. --output-prefix into a missing directory creates it, as data.tokenizer --prefix does; a failed run
# leaves no directory behind, and a file in the way is one line.
def test_output_directory_is_created(tmp_path, tokenizer_model, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", ["some text", "more text"])
    stats = preprocess([str(src)], str(tmp_path / "new" / "sub" / "o"), tokenizer_model, progress=False)
    assert stats.documents == 2 and os.path.isfile(tmp_path / "new" / "sub" / "o.bin")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 5}\n')
    raises_one_line(lambda: preprocess([str(bad)], str(tmp_path / "gone" / "sub" / "o"), tokenizer_model,
                                       progress=False), "line 2")
    assert not os.path.exists(tmp_path / "gone")
    (tmp_path / "afile").write_text("x")
    code, err = _cli_error(capsys, preprocess_main, ["--input", str(src), "--output-prefix",
                                                     str(tmp_path / "afile" / "o"), "--tokenizer", tokenizer_model,
                                                     "--workers", "1", "--no-progress"])
    assert code == 2 and "--output-prefix" in err and "is a file, not a directory" in err, err


def test_readme_tokenizer_fits_the_default_model():
    """The README's own-data commands train with the default model: its --vocab-size must fit it."""
    import pathlib
    import re

    from models.llama.config import PRESETS

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    sizes = [int(v) for v in re.findall(r"-m data\.tokenizer .*--vocab-size (\d+)", readme)]
    assert sizes, "no data.tokenizer command in the README"
    default = PRESETS["tiny"].vocab_size
    for v in sizes:
        assert -(-v // 128) * 128 <= default, f"--vocab-size {v} does not fit model.vocab_size={default}"
    assert not re.search(r"--output-prefix data/", readme), "datasets written into the data/ Python package"
