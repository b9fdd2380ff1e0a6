"""Tokenizer kinds: chosen by what the file is, exact against the reference library, clear errors.

Reference for each backend: sentencepiece for .model files, the `tokenizers` library for
tokenizer.json, and for tiktoken files both tiktoken's own encoding and the byte-level BPE the file
was derived from (trained here with `tokenizers`, tests/tokenizer_files.py).
"""
import base64
import json
import random

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFLib

from data.errors import DataError
from data.tok_tiktoken import _bytes_to_unicode
from data.tokenizer import DOCUMENT_FORMAT, Tokenizer, check_fits_model, load_tokenizer, main
from tests.data.conftest import write_jsonl
from tests.tokenizer_files import TRICKY, make_tiktoken_file, make_tokenizer_json, training_texts


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer_model):
    d = tmp_path_factory.mktemp("kinds")
    return {"sentencepiece": tokenizer_model, "hf": str(make_tokenizer_json(d / "hf" / "tokenizer.json")),
            "tiktoken": str(make_tiktoken_file(d / "tt" / "tokenizer.model"))}


def samples(n_random=400):
    rng = random.Random(0)
    alphabet = list(" \t\n\r ab_():xyz日é🚀<>/s'0123456789")
    texts = TRICKY + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(n_random)]
    texts += [t[i:i + 300] for t in training_texts(10) for i in range(0, 3000, 499)]
    return texts + [" " * k + "x" for k in range(20)] + ["\t" * k + " " * (k % 3) + "\n" * (k % 4) for k in range(12)]


def test_kind_is_chosen_by_content_not_name(files, tmp_path):
    # The tiktoken file is named tokenizer.model (as LLaMA-3 ships it); the sentencepiece one is renamed .json.
    sp_as_json = tmp_path / "weird.json"
    sp_as_json.write_bytes(open(files["sentencepiece"], "rb").read())
    assert load_tokenizer(files["tiktoken"]).kind == "tiktoken"
    assert load_tokenizer(str(sp_as_json)).kind == "sentencepiece"
    assert load_tokenizer(files["hf"]).kind == "hf"
    folder = load_tokenizer(files["hf"].rsplit("/", 1)[0])
    assert folder.kind == "hf" and folder.model_file == files["hf"]
    # Tokenizer(path), the interface, loads the right backend for older callers.
    t = Tokenizer(files["tiktoken"])
    assert type(t).__name__ == "TiktokenTokenizer" and isinstance(t, Tokenizer)
    assert {load_tokenizer(f).copy_name for f in files.values()} == {"tokenizer.model", "tokenizer.json",
                                                                    "tokenizer.tiktoken"}


def test_sentencepiece_backend_is_sentencepiece(files):
    tok, sp = load_tokenizer(files["sentencepiece"]), spm.SentencePieceProcessor(model_file=files["sentencepiece"])
    texts = samples()
    assert [tok.encode(t) for t in texts] == [sp.encode(t) for t in texts]
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size) == (3, 2, 0, 400)
    assert tok.encode(" x") == sp.encode(" x") and sp.id_to_piece(tok.encode(" x")[0]).startswith("▁▁")


def test_hf_backend_is_tokenizers_without_post_processing(files):
    tok, ref = load_tokenizer(files["hf"]), HFLib.from_file(files["hf"])
    for t in samples():
        want = ref.encode(t, add_special_tokens=False).ids
        if "<|" not in t:  # special spellings: see test_special_spellings_are_ordinary_text
            assert tok.encode(t) == want, t
        assert tok.decode(tok.encode(t)) == t
    assert (tok.bos_id, tok.eos_id) == (ref.token_to_id("<|begin_of_text|>"), ref.token_to_id("<|end_of_text|>"))


def test_tiktoken_backend_matches_tiktoken_and_the_source_bpe(files):
    import tiktoken

    tok = load_tokenizer(files["tiktoken"])
    ranks = {base64.b64decode(a): int(b) for a, b in (ln.split() for ln in open(files["tiktoken"]))}
    n = len(ranks)
    assert tok.vocab_size == n + 256 and (tok.bos_id, tok.eos_id) == (n, n + 1)
    enc = tiktoken.Encoding("ref", pat_str=tok.enc._pat_str, mergeable_ranks=ranks, special_tokens={})
    # The BPE the file was derived from splits text into the same tokens (compared as bytes).
    src = HFLib.from_file(files["tiktoken"].replace("tokenizer.model", "tokenizer.src.json"))
    char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    texts = samples()
    for t in texts:
        ids = tok.encode(t)
        assert ids == enc.encode_ordinary(t), t
        src.encode_special_tokens = True  # special spellings are text in both
        src_tokens = [bytes(char_to_byte[c] for c in s) for s in src.encode(t, add_special_tokens=False).tokens]
        assert [enc.decode_single_token_bytes(i) for i in ids] == src_tokens, t
        assert tok.decode(ids) == t
    assert tok.encode_batch(texts[:5], add_eos=True) == [enc.encode_ordinary(t) + [n + 1] for t in texts[:5]]


@pytest.mark.parametrize("kind", ["sentencepiece", "hf", "tiktoken"])
def test_conversion_to_tokenizers_is_exact(files, kind):
    """hf_tokenizer() is what the HF export writes; it must give the ids training saw."""
    tok = load_tokenizer(files[kind])
    conv = tok.hf_tokenizer()
    for t in samples():
        assert conv.encode(t, add_special_tokens=False).ids == tok.encode(t), t


@pytest.mark.parametrize("kind", ["sentencepiece", "hf", "tiktoken"])
def test_special_spellings_are_ordinary_text_and_eos_ends_documents(files, kind):
    tok = load_tokenizer(files[kind])
    for text in ("<|end_of_text|>", "</s>", "a<|begin_of_text|>b<s>"):
        ids = tok.encode(text)
        assert tok.eos_id not in ids and tok.bos_id not in ids and tok.decode(ids) == text
    batch = tok.encode_batch(["one", "two words"], add_eos=True)
    assert batch == [tok.encode("one") + [tok.eos_id], tok.encode("two words") + [tok.eos_id]]
    assert tok.document_format == DOCUMENT_FORMAT == {"bos_per_document": False, "eos_per_document": True,
                                                      "special_tokens_in_text": "ordinary"}


def test_vocabulary_fit_and_fingerprint(files, tmp_path):
    tok = load_tokenizer(files["tiktoken"])
    assert check_fits_model(tok, 1024, 128) == 128 * -(-tok.vocab_size // 128)
    with pytest.raises(DataError, match="exceeds model.vocab_size=256"):
        check_fits_model(tok, 256, 128)
    copy = tmp_path / "copy.tiktoken"
    copy.write_bytes(open(files["tiktoken"], "rb").read())
    assert load_tokenizer(str(copy)).fingerprint() == tok.fingerprint() != load_tokenizer(files["hf"]).fingerprint()


def _error(path) -> str:
    with pytest.raises(DataError) as e:
        load_tokenizer(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_tokenizer_files_are_one_line_errors(tmp_path, files):
    assert _error(tmp_path / "missing.model").endswith("tokenizer model not found")
    (tmp_path / "empty").write_text("")
    assert "empty tokenizer file; expected a sentencepiece .model, a tokenizers tokenizer.json" in _error(
        tmp_path / "empty")
    (tmp_path / "garbage").write_bytes(b"\x00\xff garbage" * 10)
    assert "not a sentencepiece model (" in _error(tmp_path / "garbage")
    (tmp_path / "other.json").write_text('{"vocab": {}}')
    assert "JSON without a 'model' key" in _error(tmp_path / "other.json")
    (tmp_path / "broken.json").write_text('{"model": ')
    assert "JSON that does not parse" in _error(tmp_path / "broken.json")
    (tmp_path / "empty_dir").mkdir()
    assert "folder holds no tokenizer.json, tokenizer.model or tokenizer.tiktoken" in _error(tmp_path / "empty_dir")
    lines = open(files["tiktoken"]).read().splitlines()
    (tmp_path / "bad_line.tiktoken").write_text("\n".join(lines[:20] + ["QUJD notanumber"] + lines[20:]))
    assert "line 21 is not 'base64-token rank'" in _error(tmp_path / "bad_line.tiktoken")
    (tmp_path / "gap.tiktoken").write_text("\n".join(lines[:-2] + [lines[-1].split()[0] + " 99999"]))
    assert "ranks must be 0.." in _error(tmp_path / "gap.tiktoken")
    (tmp_path / "no_bytes.tiktoken").write_text("\n".join(f"{ln.split()[0]} {i}" for i, ln in enumerate(lines[1:])))
    assert "single bytes have no token (e.g. b'\\x00')" in _error(tmp_path / "no_bytes.tiktoken")
    doc = json.loads(open(files["hf"]).read())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] != "<|end_of_text|>"]
    del doc["model"]["vocab"]["<|end_of_text|>"]
    (tmp_path / "no_eos.json").write_text(json.dumps(doc))
    assert "has no EOS token (looked for <|end_of_text|>, </s>" in _error(tmp_path / "no_eos.json")


def test_cli_trains_on_documents_not_raw_jsonl(tmp_path, texts, capsys, monkeypatch):
    import data.tokenizer as cli

    src = write_jsonl(tmp_path / "docs.jsonl", texts, field="content")
    seen = {}
    real_train = cli.train_bpe

    def spy(files, *args, **kwargs):
        seen["text"] = open(files[0], encoding="utf-8").read()
        return real_train(files, *args, **kwargs)

    monkeypatch.setattr(cli, "train_bpe", spy)
    main(["--input", str(src), "--prefix", str(tmp_path / "tok"), "--vocab-size", "400", "--text-field", "content"])
    assert "wrote" in capsys.readouterr().out
    # sentencepiece saw the documents' text, one after the other, not the JSONL records.
    assert seen["text"] == "".join(t if t.endswith("\n") else t + "\n" for t in texts)
    assert load_tokenizer(str(tmp_path / "tok.model")).vocab_size == 400
    with pytest.raises(SystemExit) as e:
        main(["--input", str(src), "--prefix", str(tmp_path / "t2"), "--vocab-size", "400", "--text-field", "body"])
    assert e.value.code == 2  # as data.preprocess: an input error is exit code 2 and one line on stderr
    assert "no text field 'body'" in capsys.readouterr().err


def test_cli_trains_on_every_document_however_long(tmp_path, capsys):
    """sentencepiece skips a training line over 16384 bytes without a word: a long document without
    newlines (minified code, a scraped page) never reached the vocabulary, yet the CLI counted it."""
    words = ["alpha", "beta", "delta"]
    long_doc = " ".join(words[k % 3] for k in range(24000))  # ~140 KB on one line
    short = [f"short document {k} about nothing much" for k in range(30)]
    src = write_jsonl(tmp_path / "docs.jsonl", [long_doc] + short)
    main(["--input", str(src), "--prefix", str(tmp_path / "tok"), "--vocab-size", "300"])
    assert "from 31 documents" in capsys.readouterr().out
    tok = load_tokenizer(str(tmp_path / "tok.model"))
    # The long document's words are the corpus's most frequent: whole pieces of the vocabulary.
    assert all(len(tok.encode(w)) == 1 for w in ("alpha", "beta", "delta"))
