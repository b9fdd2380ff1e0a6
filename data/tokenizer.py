"""Tokenizers: one interface (data/tok_base.py), three backends chosen by what the file is.

    sentencepiece  a .model protobuf (data/tok_sentencepiece.py; `python -m data.tokenizer` trains one)
    hf             a Hugging Face `tokenizers` tokenizer.json, or a folder holding one (data/tok_hf.py)
    tiktoken       a tiktoken BPE file in the LLaMA-3 format: "base64 rank" lines (data/tok_tiktoken.py)

The file's content decides, not its name (LLaMA-3 ships its tiktoken file as tokenizer.model).

Document format, everywhere (preprocessing, training, validation, the exported HF tokenizer): each
document is its ids followed by EOS, with no BOS; special-token spellings inside a document are
ordinary text. A tokenizer without EOS is refused. The vocabulary padded to data.pad_vocab_multiple
must fit the model's embedding (check_fits_model).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import tempfile
from typing import Sequence

from amsp.errors import one_line_errors
from data.errors import DataError
from data.tok_base import DOCUMENT_FORMAT, EXPECTED_KINDS, Tokenizer  # noqa: F401 - DOCUMENT_FORMAT re-exported
from data.outdir import Terminated, exit_stopped, make_parent, output_error, remove_if_empty, stop_signals
from data.tok_sentencepiece import MAX_SENTENCE_BYTES, check_vocab_size, train_bpe  # noqa: F401 - re-exported

log = logging.getLogger(__name__)
def _looks_like_tiktoken(head: bytes) -> bool:
    lines = [ln for ln in head.split(b"\n")[:-1] if ln.strip()] or [head]  # the last line may be cut
    return all(re.fullmatch(rb"[A-Za-z0-9+/]+={0,2} \d+\r?", ln) for ln in lines[:8])


def resolve_tokenizer_file(path: str) -> tuple[str, str]:
    """(kind, file) for a tokenizer path; DataError naming what was expected otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken"):
            if os.path.isfile(os.path.join(path, name)):
                return resolve_tokenizer_file(os.path.join(path, name))
        raise DataError(path, "folder holds no tokenizer.json, tokenizer.model or tokenizer.tiktoken")
    if not os.path.isfile(path):
        raise DataError(path, "tokenizer model not found")
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise DataError(path, f"cannot read the tokenizer ({e.strerror})") from None
    if not head.strip():
        raise DataError(path, f"empty tokenizer file; expected {EXPECTED_KINDS}")
    if head.lstrip()[:1] == b"{":
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(path, f"JSON that does not parse ({e}); expected {EXPECTED_KINDS}") from None
        if isinstance(doc, dict) and "model" in doc:
            return "hf", path
        raise DataError(path, f"JSON without a 'model' key (not a tokenizer.json); expected {EXPECTED_KINDS}")
    if _looks_like_tiktoken(head):
        return "tiktoken", path
    # Anything else can only be a sentencepiece ModelProto (binary); its loader names the problem.
    return "sentencepiece", path


def load_tokenizer(path: str) -> Tokenizer:
    kind, file = resolve_tokenizer_file(path)
    if kind == "hf":
        from data.tok_hf import HFTokenizer
        return HFTokenizer(file)
    if kind == "tiktoken":
        from data.tok_tiktoken import TiktokenTokenizer
        return TiktokenTokenizer(file)
    from data.tok_sentencepiece import SentencePieceTokenizer
    return SentencePieceTokenizer(file)


def check_fits_model(tok: Tokenizer, model_vocab_size: int, multiple: int) -> int:
    """The padded tokenizer vocabulary must fit the model's embedding; returns the padded size."""
    padded = tok.padded_vocab_size(multiple)
    if padded > model_vocab_size:
        raise DataError(tok.model_file, f"tokenizer vocabulary {tok.vocab_size} (padded to {padded}, a multiple "
                                        f"of data.pad_vocab_multiple={multiple}) exceeds model.vocab_size="
                                        f"{model_vocab_size}; use a larger model vocabulary or a smaller tokenizer")
    log.info("tokenizer %s (%s): %d pieces, padded to %d (model vocabulary %d)", tok.model_file, tok.kind,
             tok.vocab_size, padded, model_vocab_size)
    return padded


def sentence_pieces(line: str, limit: int = MAX_SENTENCE_BYTES) -> list[str]:
    """`line` (no newline) cut into pieces of at most `limit` UTF-8 bytes, at the last space of each
    window where there is one in its second half, else at a character boundary: sentencepiece drops
    a longer training line whole (a minified file, a document without newlines), so its text would
    never reach the vocabulary."""
    data = line.encode("utf-8")
    if len(data) <= limit:
        return [line]
    out, start = [], 0
    while len(data) - start > limit:
        end = start + limit
        space = data.rfind(b" ", start + limit // 2, end)
        if space > start:
            end = space + 1  # the space stays with the piece before it
        else:
            while data[end] & 0xC0 == 0x80:  # a UTF-8 continuation byte: back to its character's start
                end -= 1
        out.append(data[start:end].decode("utf-8"))
        start = end
    out.append(data[start:].decode("utf-8"))
    return out


def write_training_text(inputs: Sequence[str], out_file: str, text_field: str = "text",
                        max_docs: int | None = None) -> int:
    """Documents (data/sources.py: JSONL, Parquet, text, folders) as plain text for sentencepiece,
    which reads one sentence per line; lines over its limit are cut (sentence_pieces). Returns the
    number of documents."""
    from data.sources import iter_documents

    n = cut = 0
    with open(out_file, "w", encoding="utf-8") as f:
        for text in iter_documents(inputs, text_field=text_field):
            for line in text.removesuffix("\n").split("\n"):  # sentencepiece's lines: \n only
                pieces = sentence_pieces(line)
                cut += len(pieces) > 1
                f.writelines(p + "\n" for p in pieces)
            n += 1
            if n % 10000 == 0:
                log.info("read %d documents", n)
            if max_docs is not None and n >= max_docs:
                break
    if n == 0:
        raise DataError(",".join(inputs), f"no document has text in field {text_field!r}")
    if cut:
        log.info("cut %d lines longer than sentencepiece's %d-byte limit into pieces (it skips longer lines)",
                 cut, MAX_SENTENCE_BYTES)
    return n


def count_sentences(text_file: str) -> int:
    """The non-empty lines of a training text: the sentences sentencepiece loads (it skips empty ones)."""
    n = 0
    with open(text_file, "rb") as f:
        for line in f:
            n += line != b"\n"
    return n


def main(argv: Sequence[str] | None = None) -> None:
    """python -m data.tokenizer --input corpus.jsonl [more files or folders] --prefix out/tok --vocab-size 32000"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m data.tokenizer", description="Train a sentencepiece BPE "
                                 "tokenizer on documents (JSONL, JSON, Parquet, text files or folders of them).")
    ap.add_argument("--input", nargs="+", required=True, help="files or folders (comma-separated also accepted)")
    ap.add_argument("--prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--text-field", default="text", help="field holding the text in JSONL/Parquet records")
    ap.add_argument("--no-byte-fallback", action="store_true")
    ap.add_argument("--max-sentences", type=int, default=2_000_000,
                    help="at most this many lines, sampled at random, are trained on (0: all lines)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    inputs = [p for item in a.input for p in item.split(",") if p]
    stopped = None
    # SIGTERM (a Slurm time limit) and Ctrl-C stop it as they stop data.preprocess: one line, exit code 143
    # or 130, and the temporary folder (a full copy of the corpus) and .tmp-PID model files removed. Both
    # wait for sentencepiece's C++ training to return: Python runs signal handlers between its own steps.
    with stop_signals(), one_line_errors():  # a DataError is one line on stderr and exit code 2
        try:
            path, docs = _train_cli(a, inputs)
        except (Terminated, KeyboardInterrupt) as e:  # caught inside one_line_errors, as data.preprocess does
            stopped = e
    if stopped is not None:
        exit_stopped(stopped, f"{a.prefix}.model not written (an earlier one there is untouched, temporary "
                              "files removed)")
    print(f"wrote {path} ({load_tokenizer(path).vocab_size} pieces, from {docs} documents)")


def _train_cli(a, inputs: list[str]) -> tuple[str, int]:
    """main()'s work: (the .model written, the documents it was trained on)."""
    # Checked before any input is read; the floor that depends on the text is checked by train_bpe.
    check_vocab_size(a.vocab_size, not a.no_byte_fallback, "--vocab-size")
    if not (a.max_sentences == 0 or a.max_sentences > 100):  # sentencepiece's own INTERNAL check
        raise DataError("--max-sentences", f"must be 0 (all lines) or more than 100 (sentencepiece's minimum "
                                           f"sample), got {a.max_sentences}")
    if os.path.basename(a.prefix) in ("", ".", ".."):  # `tok/` would write the hidden tok/.model
        raise DataError("--prefix", f"{a.prefix!r} has no file name; give DIR/NAME to write DIR/NAME.model and "
                                    f"DIR/NAME.vocab")
    created = make_parent(a.prefix, "--prefix")
    try:
        try:
            # Hidden: with --prefix inside an --input folder, the folder's walk (data/sources.py skips hidden
            # entries) took the copy being written for one more document.
            tmp_dir = tempfile.TemporaryDirectory(prefix=".tmp", dir=os.path.dirname(os.path.abspath(a.prefix)))
        except OSError as e:  # a read-only directory
            raise output_error("--prefix", a.prefix, e) from None
        with tmp_dir as tmp:
            text_file = os.path.join(tmp, "documents.txt")
            try:
                docs = write_training_text(inputs, text_file, a.text_field)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the copy of the text beside PREFIX
                    raise output_error("--prefix", a.prefix, e, text_file) from None
                raise
            lines = count_sentences(text_file)
            log.info("training on %d documents (%.1f MB of text, %d lines)", docs,
                     os.path.getsize(text_file) / 1e6, lines)
            if 0 < a.max_sentences < lines:
                # sentencepiece samples silently: the vocabulary then comes from part of the text only.
                log.warning("sentencepiece trains on a random sample of %d of the %d lines (--max-sentences "
                            "%d; raise it, or 0, to train on all of them)", a.max_sentences, lines,
                            a.max_sentences)
            path = train_bpe([text_file], a.prefix, a.vocab_size, byte_fallback=not a.no_byte_fallback,
                             max_sentences=a.max_sentences, vocab_key="--vocab-size")
    except BaseException:
        remove_if_empty(created)
        raise
    return path, docs


if __name__ == "__main__":
    main()
