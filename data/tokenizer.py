"""SentencePiece tokenizer: train a BPE model or load a .model; vocabulary padding and model fit.

Trained models keep text exactly (identity normalisation, whitespace kept, byte fallback for
anything outside the vocabulary), which matters for source code and makes decode(encode(t)) == t.
Special ids: pad 0, unk 1, bos 2, eos 3.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
from typing import Iterable, Sequence

import sentencepiece as spm

from data.errors import DataError

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, model_file: str):
        if not os.path.isfile(model_file):
            raise DataError(model_file, "tokenizer model not found")
        self.model_file = os.path.abspath(model_file)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.model_file)
        except (RuntimeError, OSError) as e:
            raise DataError(model_file, f"not a sentencepiece model ({e})") from None
        self.eos_id = self.sp.eos_id()
        if self.eos_id < 0:
            raise DataError(model_file, "the tokenizer has no EOS piece; documents cannot be separated")
        self.bos_id, self.pad_id, self.unk_id = self.sp.bos_id(), self.sp.pad_id(), self.sp.unk_id()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False, threads: int = 1) -> list[list[int]]:
        # One thread by default: preprocessing parallelises over processes, and sentencepiece's
        # own default (all cores per call) would oversubscribe them.
        return self.sp.encode(list(texts), add_eos=add_eos, num_threads=threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        """sha256 of the serialized model: identifies the tokenizer a dataset was made with."""
        return hashlib.sha256(self.sp.serialized_model_proto()).hexdigest()

    def padded_vocab_size(self, multiple: int) -> int:
        if multiple < 1:
            raise DataError("data.pad_vocab_multiple", f"must be >= 1, got {multiple}")
        return multiple * math.ceil(self.vocab_size / multiple)


def check_fits_model(tok: Tokenizer, model_vocab_size: int, multiple: int) -> int:
    """The padded tokenizer vocabulary must fit the model's embedding; returns the padded size."""
    padded = tok.padded_vocab_size(multiple)
    if padded > model_vocab_size:
        raise DataError(tok.model_file, f"tokenizer vocabulary {tok.vocab_size} (padded to {padded}, a multiple "
                                        f"of data.pad_vocab_multiple={multiple}) exceeds model.vocab_size="
                                        f"{model_vocab_size}; use a larger model vocabulary or a smaller tokenizer")
    log.info("tokenizer %s: %d pieces, padded to %d (model vocabulary %d)", tok.model_file, tok.vocab_size,
             padded, model_vocab_size)
    return padded


def train_bpe(input_files: Sequence[str], model_prefix: str, vocab_size: int, *, byte_fallback: bool = True,
              max_sentences: int = 2_000_000, threads: int | None = None) -> str:
    """Train a BPE model from plain-text files (one sentence per line); returns the .model path.

    Written under a temporary prefix and renamed, so a cache never holds half a model.
    """
    for f in input_files:
        if not os.path.isfile(f):
            raise DataError(f, "tokenizer training input not found")
    tmp = f"{model_prefix}.tmp-{os.getpid()}"
    kwargs = dict(
        input=",".join(input_files), model_prefix=tmp, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=byte_fallback, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        split_digits=True, input_sentence_size=max_sentences, shuffle_input_sentence=True,
        max_sentence_length=16384, num_threads=threads or max(1, os.cpu_count() or 1), minloglevel=2,
        train_extremely_large_corpus=False,
    )
    # Sentence sampling is random in sentencepiece; a fixed seed keeps cached tokenizers reproducible.
    spm.set_random_generator_seed(0)
    try:
        spm.SentencePieceTrainer.train(**kwargs)
    except RuntimeError as e:
        raise DataError(model_prefix, f"sentencepiece training failed: {e}") from None
    os.replace(tmp + ".model", model_prefix + ".model")
    os.replace(tmp + ".vocab", model_prefix + ".vocab")
    return model_prefix + ".model"


def main(argv: Sequence[str] | None = None) -> None:
    """python -m data.tokenizer --input a.txt,b.txt --prefix out/tok --vocab-size 32000"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m data.tokenizer", description=main.__doc__)
    ap.add_argument("--input", required=True, help="comma-separated plain-text files, one sentence per line")
    ap.add_argument("--prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--no-byte-fallback", action="store_true")
    ap.add_argument("--max-sentences", type=int, default=2_000_000)
    a = ap.parse_args(argv)
    try:
        path = train_bpe(a.input.split(","), a.prefix, a.vocab_size, byte_fallback=not a.no_byte_fallback,
                         max_sentences=a.max_sentences)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {path} ({Tokenizer(path).vocab_size} pieces)")


if __name__ == "__main__":
    main()
