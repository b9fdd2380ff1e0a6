"""Hugging Face `tokenizers` backend: a tokenizer.json (or a folder holding one).

Only tokenizer.json decides how text is encoded (a copy of that one file is the whole tokenizer):
the special ids are found by name among its tokens. Encoding follows data/tok_base.py's document
format: the file's post-processor (e.g. a template that adds BOS) is not applied, and special
tokens spelled out in a document are ordinary text (`encode_special_tokens`).
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

from data.errors import DataError
from data.tok_base import Tokenizer

# Spellings of the special tokens across common tokenizers (LLaMA-3, LLaMA-1/2, GPT-2, Gemma, ...).
EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "<|eos|>", "[EOS]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
UNK_NAMES = ("<unk>", "[UNK]", "<|unk|>")


def _first_id(tok, names: Sequence[str]) -> int:
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return -1


class HFTokenizer(Tokenizer):
    kind = "hf"
    copy_name = "tokenizer.json"

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        self.model_file = os.path.abspath(path)
        try:
            self.tok = _Tok.from_file(self.model_file)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception on a bad file
            raise DataError(path, f"not a loadable tokenizers tokenizer.json ({str(e).splitlines()[0]})") from None
        self.tok.no_truncation()
        self.tok.no_padding()
        self.tok.encode_special_tokens = True
        self.eos_id = _first_id(self.tok, EOS_NAMES)
        if self.eos_id < 0:
            raise DataError(path, "the tokenizer has no EOS token (looked for " + ", ".join(EOS_NAMES)
                                  + "); documents cannot be separated")
        self.bos_id, self.pad_id = _first_id(self.tok, BOS_NAMES), _first_id(self.tok, PAD_NAMES)
        self.unk_id = _first_id(self.tok, UNK_NAMES)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False, threads: int = 1) -> list[list[int]]:
        # `tokenizers` parallelises batches itself (TOKENIZERS_PARALLELISM); preprocessing workers
        # are forked processes, where the library turns that off on its own.
        tail = [self.eos_id] if add_eos else []
        return [e.ids + tail for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def hf_tokenizer(self):
        from tokenizers import Tokenizer as _Tok

        tok = _Tok.from_str(self.tok.to_str())
        tok.encode_special_tokens = True
        return tok
