"""What every tokenizer backend provides (data/tokenizer.py picks the backend from the file).

Document format, the same for every backend and in preprocessing, training, validation and export:
a document is encoded as its text's ids followed by EOS, never with a BOS. Text is always ordinary
text: a special token's spelling inside a document ("</s>", "<|end_of_text|>") is encoded as the
characters it is made of, so a document can never inject a document boundary.
"""
from __future__ import annotations

import hashlib
import math
from abc import ABCMeta, abstractmethod
from typing import Iterable, Sequence

from data.errors import DataError

EXPECTED_KINDS = ("a sentencepiece .model, a tokenizers tokenizer.json (or a folder holding one), or a tiktoken "
                  "BPE file ('base64 rank' lines)")
# What a dataset's metadata records about how documents were encoded (data/preprocess.py).
DOCUMENT_FORMAT = {"bos_per_document": False, "eos_per_document": True, "special_tokens_in_text": "ordinary"}


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _LoadsBackend(ABCMeta):
    # Tokenizer(path) keeps working for callers written before there were several backends: calling
    # the interface itself loads the backend the file needs; a backend class constructs normally.
    def __call__(cls, *args, **kwargs):
        if cls is Tokenizer:
            from data.tokenizer import load_tokenizer
            return load_tokenizer(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Tokenizer(metaclass=_LoadsBackend):
    """Interface of the backends. `Tokenizer(path)` loads whichever backend the file needs."""

    kind: str = ""  # "sentencepiece" | "hf" | "tiktoken"
    document_format = DOCUMENT_FORMAT  # recorded in every dataset's metadata (data/preprocess.py)
    copy_name: str = ""  # the file name a run directory keeps its copy under (train.py)
    model_file: str  # absolute path of the one file that defines the tokenizer
    eos_id: int
    bos_id: int = -1  # -1: the tokenizer has none
    pad_id: int = -1
    unk_id: int = -1

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        ...

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        ...

    @abstractmethod
    def encode_batch(self, texts: Sequence[str], add_eos: bool = False, threads: int = 1) -> list[list[int]]:
        ...

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        ...

    def fingerprint(self) -> str:
        """sha256 identifying the tokenizer a dataset was made with."""
        return file_sha256(self.model_file)

    @abstractmethod
    def hf_tokenizer(self):
        """A `tokenizers.Tokenizer` whose encode(text, add_special_tokens=False) equals encode(text)
        (models/llama/hf.py writes it as the exported tokenizer.json)."""

    def padded_vocab_size(self, multiple: int) -> int:
        if multiple < 1:
            raise DataError("data.pad_vocab_multiple", f"must be >= 1, got {multiple}")
        return multiple * math.ceil(self.vocab_size / multiple)

    def _require_eos(self) -> None:
        if self.eos_id is None or self.eos_id < 0:
            raise DataError(self.model_file, f"the {self.kind} tokenizer has no EOS token; documents cannot be "
                                             "separated")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_file!r}, vocab_size={self.vocab_size})"
