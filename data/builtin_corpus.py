"""The built-in corpus: the Python standard library's own sources, present on every machine.

Each .py file of the stdlib (tests and site-packages excluded) is one document: real English prose in
docstrings and comments mixed with code. prepare_builtin() turns it, once per machine, into
    .cache/builtin/<key>/corpus.jsonl      the documents, read back through the normal pipeline
    .cache/builtin/<key>/tok<V>.model      a sentencepiece BPE tokenizer trained on them
    .cache/builtin/<key>/tok<V>.bin/.idx   the tokenized Megatron dataset
where <key> hashes the file list and the size limit, so a different Python or a different limit gets
its own entry, and each vocabulary size its own tokenizer and tokens next to the shared corpus. Each step is skipped when its output
already exists; a lock makes concurrent ranks wait for the first one instead of repeating the work.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import sysconfig
import time
from dataclasses import dataclass

from data.cache import cache_key, locked
from data.errors import DataError
from data.preprocess import preprocess, read_metadata
from data.tokenizer import train_bpe

log = logging.getLogger(__name__)
_VERSION = 1  # bump when the corpus or preparation recipe changes
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class BuiltinCorpus:
    tokenizer_model: str
    prefix: str
    documents: int
    num_bytes: int


def stdlib_files(max_bytes: int) -> list[pathlib.Path]:
    """Stdlib sources in path order, up to max_bytes in total."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts))
    out, total = [], 0
    for p in files:
        if total >= max_bytes:
            break
        out.append(p)
        total += p.stat().st_size
    if not out:
        raise DataError(root, "no Python standard library sources found for the built-in corpus")
    return out


def _write_corpus(files: list[pathlib.Path], jsonl: pathlib.Path, txt: pathlib.Path) -> tuple[int, int]:
    docs, size, skipped = 0, 0, 0
    tmp_j, tmp_t = (p.with_name(f"{p.name}.tmp-{os.getpid()}") for p in (jsonl, txt))
    with open(tmp_j, "w", encoding="utf-8") as fj, open(tmp_t, "w", encoding="utf-8") as ft:
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                skipped += 1
                continue
            if not text.strip():
                continue
            fj.write(json.dumps({"text": text, "path": p.name}) + "\n")
            ft.write(text if text.endswith("\n") else text + "\n")
            docs += 1
            size += len(text.encode())
    os.replace(tmp_t, txt)
    os.replace(tmp_j, jsonl)  # last: its presence means both files are complete
    if skipped:
        log.info("built-in corpus: skipped %d stdlib files that are not UTF-8 text", skipped)
    return docs, size


def prepare_builtin(cache_root: pathlib.Path, max_bytes: int, vocab_size: int, workers: int = 2) -> BuiltinCorpus:
    files = stdlib_files(max_bytes)
    # The corpus is shared by every vocabulary size; the tokenizer and tokens are named by it.
    key = cache_key({"v": _VERSION, "python": sys.version, "max_bytes": max_bytes,
                     "files": [(str(p), p.stat().st_size) for p in files]})
    d = cache_root / "builtin" / key
    d.mkdir(parents=True, exist_ok=True)
    jsonl, txt = d / "corpus.jsonl", d / "corpus.txt"
    tok_prefix = d / f"tok{vocab_size}"
    with locked(d / "prepare"):
        t0 = time.perf_counter()
        if not jsonl.exists():
            docs, size = _write_corpus(files, jsonl, txt)
            log.info("built-in corpus: %d stdlib files, %.1f MB of text -> %s", docs, size / 1e6, jsonl)
        if not (model := pathlib.Path(f"{tok_prefix}.model")).exists():
            train_bpe([str(txt)], str(tok_prefix), vocab_size)
            log.info("built-in corpus: trained a %d-piece BPE tokenizer -> %s", vocab_size, model)
        if not pathlib.Path(f"{tok_prefix}.idx").exists():
            stats = preprocess([str(jsonl)], str(tok_prefix), str(model), workers=workers, progress=False)
            log.info("built-in corpus: tokenized %d documents into %d tokens (%.0f tokens/s) -> %s.bin/.idx",
                     stats.documents, stats.tokens, stats.tokens_per_s, tok_prefix)
        dt = time.perf_counter() - t0
        if dt > 1:
            log.info("built-in corpus prepared in %.1f s (cached under %s)", dt, d)
    meta = read_metadata(str(tok_prefix)) or {}
    return BuiltinCorpus(str(model), str(tok_prefix), int(meta.get("documents", 0)), txt.stat().st_size)
