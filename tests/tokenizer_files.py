"""Small tokenizers of every kind, made locally (no download), and the strings that tell them apart.

make_tokenizer_json trains a byte-level BPE with the `tokenizers` library (LLaMA-3 style: its
pre-tokenizer pattern, <|begin_of_text|>/<|end_of_text|>); make_tiktoken_file writes that BPE's
tokens as a tiktoken "base64 rank" file (single bytes first, then the merged tokens in merge order).
"""
from __future__ import annotations

import base64
import pathlib
import sysconfig

# Whitespace at either end and repeated, tabs, newlines, indented code, non-ASCII, special spellings.
TRICKY = [
    "x", " x", "  x", "x ", "x  ", "a  b   c", " leading and trailing ", "\tTabbed\tline\t", "line\nbreaks\n\n",
    "\n", " ", "   ", "\r\n windows\r\n", "def f(x):\n    if x:\n        return x  # done\n\treturn None\n",
    "naïve café résumé", "日本語のテキストです。", "emoji 🚀✓ 👩‍💻 and ZWJ", "Ωμέγα ελληνικά", "x²+y³=z⁴ ½",
    "mixed 中文 and English  with  spaces", "numbers 1234567 and 3.14159", "<s> and </s> spelled out",
    "<|end_of_text|><|begin_of_text|> spelled out", "<0x41> <unk> <pad>", "don't I'LL we've", "",
]


def training_texts(n: int = 40, max_chars: int = 3000) -> list[str]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(encoding="utf-8")[:max_chars] for f in sorted(root.glob("*.py"))[:n]]
    return texts + TRICKY * 3


def make_tokenizer_json(path: pathlib.Path, vocab_size: int = 600) -> pathlib.Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from data.tok_tiktoken import LLAMA3_PATTERN

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False)
    tok.train_from_iterator(training_texts(), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def make_tiktoken_file(path: pathlib.Path, vocab_size: int = 600) -> pathlib.Path:
    import json

    from data.tok_tiktoken import _bytes_to_unicode

    src = make_tokenizer_json(path.with_suffix(".src.json"), vocab_size)
    model = json.loads(src.read_text())["model"]
    char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    tokens = [bytes([b]) for b in range(256)]
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        tokens.append(bytes(char_to_byte[c] for c in left + right))
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")
    return path
