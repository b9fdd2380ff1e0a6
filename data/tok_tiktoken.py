"""tiktoken backend for BPE files in the LLaMA-3 format, and their conversion to `tokenizers`.

The file holds one "base64(token bytes) rank" line per token, ranks 0..N-1, every single byte among
them. As in Meta's LLaMA-3 tokenizer, text is split with LLaMA-3's pre-tokenizer pattern and the
256 special tokens (<|begin_of_text|>, <|end_of_text|>, ..., reserved ones) take ids N..N+255.
Special tokens spelled out in a document are ordinary text (tiktoken's encode_ordinary).
"""
from __future__ import annotations

import base64
import binascii
import os
from typing import Iterable, Sequence

from data.errors import DataError
from data.tok_base import Tokenizer

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_NUM_RESERVED = 256
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, _NUM_RESERVED - 5)]


def read_bpe_ranks(path: str) -> dict[bytes, int]:
    """The "base64 rank" lines of a tiktoken file; a malformed file is one DataError line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error):
                raise DataError(path, f"line {n} is not 'base64-token rank' (tiktoken BPE format)") from None
            if token in ranks:
                raise DataError(path, f"line {n}: token {token!r} appears twice")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(path, f"ranks must be 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(path, f"{len(missing)} single bytes have no token (e.g. {bytes([missing[0]])!r}); a "
                              "byte-level BPE needs all 256")
    return ranks


class TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"
    copy_name = "tokenizer.tiktoken"

    def __init__(self, path: str):
        import tiktoken

        self.model_file = os.path.abspath(path)
        self.ranks = read_bpe_ranks(self.model_file)
        n = len(self.ranks)
        self.special_tokens = {t: n + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_PATTERN,
                                     mergeable_ranks=self.ranks, special_tokens=self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.pad_id = self.unk_id = -1

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False, threads: int = 1) -> list[list[int]]:
        ids = self.enc.encode_ordinary_batch(list(texts), num_threads=threads)
        if add_eos:
            for x in ids:
                x.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids])

    def hf_tokenizer(self):
        return tiktoken_to_hf(self.ranks, self.special_tokens)


def tiktoken_to_hf(ranks: dict[bytes, int], special_tokens: dict[str, int]):
    """The same tokenizer as a `tokenizers` byte-level BPE (the approach of transformers'
    TikTokenConverter): vocabulary = the ranks, spelled with GPT-2's byte-to-unicode map; a merge
    (left, right) for every split of a token into two tokens, ordered by the merged token's rank, so
    the lowest-rank pair merges first as in tiktoken; a pre-split piece that is itself a token is
    taken whole (ignore_merges), as tiktoken does."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    byte_to_char = _bytes_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(byte_to_char[x] for x in b)

    vocab = {spell(t): r for t, r in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], spell(left), spell(right)))
    merges.sort()
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], ignore_merges=True,
                                 fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    for name, i in sorted(special_tokens.items(), key=lambda kv: kv[1]):
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        if tok.token_to_id(name) != i:
            raise ValueError(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")
    tok.encode_special_tokens = True
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE vocabularies)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
