"""SentencePiece backend: load a .model, train a BPE model, convert it to a `tokenizers` tokenizer.

Models trained here keep text exactly (identity normalisation, whitespace kept, byte fallback for
anything outside the vocabulary), which matters for source code and makes decode(encode(t)) == t.
Special ids: pad 0, unk 1, bos 2, eos 3. Like every sentencepiece model with add_dummy_prefix (the
default), a text is encoded with a "▁" (space) in front: " x" is "▁▁x".
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Sequence

import sentencepiece as spm

from data.errors import DataError
from data.tok_base import EXPECTED_KINDS, Tokenizer


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"
    copy_name = "tokenizer.model"

    def __init__(self, model_file: str):
        self.model_file = os.path.abspath(model_file)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.model_file)
        except (RuntimeError, OSError) as e:
            raise DataError(model_file, f"not a sentencepiece model ({e}); a tokenizer is {EXPECTED_KINDS}") from None
        self.eos_id = self.sp.eos_id()
        self._require_eos()
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
        # The serialized model, not the file bytes: datasets made before other backends existed
        # recorded this hash.
        import hashlib
        return hashlib.sha256(self.sp.serialized_model_proto()).hexdigest()

    def hf_tokenizer(self):
        return sentencepiece_to_hf(self.sp, self.model_file)


def _model_proto(sp: spm.SentencePieceProcessor):
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(sp.serialized_model_proto())
    return m, pb


def sentencepiece_to_hf(sp: spm.SentencePieceProcessor, name: str = "sentencepiece model"):
    """The same tokenizer as a `tokenizers` BPE: the text is normalised as sentencepiece does (spaces
    become "▁", one "▁" in front with add_dummy_prefix), then merged over the whole text without a
    pre-tokenizer (sentencepiece does not split at spaces when encoding); merges follow the piece
    order (a BPE model's score), characters outside the vocabulary fall back to byte pieces.
    A normalisation rule (nmt_nfkc, ...) is applied from the model's compiled character map, and
    remove_extra_whitespaces as sentencepiece does it. Models this cannot reproduce (non-BPE, user-
    defined symbols) are refused with a ValueError."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    m, pb = _model_proto(sp)
    T = pb.ModelProto.SentencePiece
    ns, ts = m.normalizer_spec, m.trainer_spec
    problems = []
    if ts.model_type != pb.TrainerSpec.BPE:
        problems.append(f"model_type={pb.TrainerSpec.ModelType.Name(ts.model_type)} (only BPE converts exactly)")
    if not ns.escape_whitespaces:
        problems.append("escape_whitespaces=false")
    user = [p.piece for p in m.pieces if p.type == T.USER_DEFINED]
    if user:
        problems.append(f"{len(user)} user-defined symbols")
    if problems:
        raise ValueError(f"{name}: cannot export this sentencepiece model exactly as a tokenizer.json: "
                         + "; ".join(problems))
    vocab = {p.piece: i for i, p in enumerate(m.pieces)}
    mergeable = {p.piece: i for i, p in enumerate(m.pieces) if p.type == T.NORMAL}
    merges = []
    for piece, i in mergeable.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in mergeable and right in mergeable:
                merges.append((i, mergeable[left], mergeable[right], left, right))
    merges.sort()
    unk = m.pieces[sp.unk_id()].piece if sp.unk_id() >= 0 else None
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk,
                                 byte_fallback=ts.byte_fallback, fuse_unk=True, ignore_merges=False))
    steps = []
    if ns.precompiled_charsmap:  # a normalisation rule (nmt_nfkc, ...) compiled into the model
        steps.append(normalizers.Precompiled(ns.precompiled_charsmap))
    if ns.remove_extra_whitespaces:  # sentencepiece trims spaces at both ends and collapses runs of them
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if ns.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if ns.add_dummy_prefix else []))
    tok.encode_special_tokens = True  # control pieces in text are ordinary text in sentencepiece
    control = [p.piece for p in m.pieces if p.type in (T.CONTROL, T.UNKNOWN)]
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    return tok


# sentencepiece's longest training line in bytes; it skips longer lines without a word at minloglevel=2, so
# writers of training text cut their lines to this (data/tokenizer.py write_training_text).
MAX_SENTENCE_BYTES = 16384


SPECIAL_PIECES = 4  # pad, unk, bos, eos (ids 0..3)
BYTE_PIECES = 256  # <0x00>..<0xFF>, with byte fallback


def min_vocab_size(byte_fallback: bool) -> int:
    """The smallest vocabulary sentencepiece can train here, whatever the text: the special pieces, the
    byte pieces with byte fallback, and one character. Its real floor is higher: every character of the
    text (those covering 99.95% of it) needs a piece of its own, so text with C characters needs
    SPECIAL_PIECES (+ BYTE_PIECES) + C; train_bpe names that number when it is missed."""
    return SPECIAL_PIECES + (BYTE_PIECES if byte_fallback else 0) + 1


def _floor_explained(byte_fallback: bool) -> str:
    return (f"{SPECIAL_PIECES} special pieces" + (f" + {BYTE_PIECES} byte pieces" if byte_fallback else "")
            + " + one piece per distinct character of the text")


def check_vocab_size(vocab_size: int, byte_fallback: bool, key: str) -> None:
    """The floor that holds for any text (sentencepiece's own error for 0 or 100 is an INTERNAL check)."""
    floor = min_vocab_size(byte_fallback)
    if vocab_size < floor:
        raise DataError(key, f"{vocab_size} is too small: a tokenizer needs at least {floor} pieces "
                             f"({_floor_explained(byte_fallback)})")


# sentencepiece's check: "Vocabulary size is smaller than required_chars. 100 vs 287."
_REQUIRED_CHARS = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


# and: "Vocabulary size too high (2000). Please set it to a value <= 432."
_TOO_HIGH = re.compile(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)")


def train_bpe(input_files: Sequence[str], model_prefix: str, vocab_size: int, *, byte_fallback: bool = True,
              max_sentences: int = 2_000_000, threads: int | None = None, vocab_key: str = "vocab_size") -> str:
    """Train a BPE model from plain-text files (one sentence per line); returns the .model path.

    Written under a temporary prefix and renamed, so a cache never holds half a model. A vocabulary too
    small for sentencepiece is one line naming `vocab_key` and the smallest size that works.
    """
    check_vocab_size(vocab_size, byte_fallback, vocab_key)
    for f in input_files:
        if not os.path.isfile(f):
            raise DataError(f, "tokenizer training input not found")
    tmp = f"{model_prefix}.tmp-{os.getpid()}"
    kwargs = dict(
        input=",".join(input_files), model_prefix=tmp, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=byte_fallback, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        split_digits=True, input_sentence_size=max_sentences, shuffle_input_sentence=True,
        max_sentence_length=MAX_SENTENCE_BYTES, num_threads=threads or max(1, os.cpu_count() or 1), minloglevel=2,
        train_extremely_large_corpus=False,
    )
    # Sentence sampling is random in sentencepiece; a fixed seed keeps cached tokenizers reproducible.
    spm.set_random_generator_seed(0)
    try:
        _train_and_rename(kwargs, tmp, model_prefix, vocab_size, byte_fallback, vocab_key)
    except BaseException:
        # Ctrl-C or SIGTERM lands only after the C++ training returned, beside its finished files.
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
        raise
    return model_prefix + ".model"


def _train_and_rename(kwargs: dict, tmp: str, model_prefix: str, vocab_size: int, byte_fallback: bool,
                      vocab_key: str) -> None:
    floor = min_vocab_size(byte_fallback)
    try:
        spm.SentencePieceTrainer.train(**kwargs)
    except RuntimeError as e:
        m = _REQUIRED_CHARS.search(str(e))
        if m:
            need = int(m.group(2))
            raise DataError(vocab_key, f"{vocab_size} is too small for this text: it needs at least {need} pieces "
                                       f"({_floor_explained(byte_fallback)}: {need - floor + 1} characters)") from None
        m = _TOO_HIGH.search(str(e))
        if m:  # BPE merges run out on a small text: the size it could reach
            raise DataError(vocab_key, f"{vocab_size} is more pieces than this text yields: at most {m.group(1)} "
                                       "(give more text or a smaller size)") from None
        raise DataError(model_prefix, f"sentencepiece training failed: {e}") from None
    os.replace(tmp + ".model", model_prefix + ".model")
    os.replace(tmp + ".vocab", model_prefix + ".vocab")
