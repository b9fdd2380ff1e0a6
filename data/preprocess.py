"""Tokenize documents into a Megatron-compatible indexed dataset (PREFIX.bin + PREFIX.idx).

    python -m data.preprocess --input corpus/ --output-prefix out/corpus --tokenizer tok.model \\
        --text-field text --workers 8

Documents stream from the reader (main process) to worker processes in chunks; a bounded window
of chunks is in flight, and results are written in input order, so memory stays bounded whatever
the corpus size. EOS is appended to every document. Outputs are written under temporary names and
renamed at the end; PREFIX.json records the tokenizer and counts so training can check that the
dataset matches its tokenizer (Megatron's own tools ignore that file).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

import numpy as np

from data.errors import DataError
from data.indexed_dataset import IndexedDatasetWriter, token_dtype
from data.sources import iter_documents
from data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_worker_tok: Tokenizer | None = None


def _init_worker(model_file: str) -> None:
    global _worker_tok
    # A forked worker inherits the parent's signal handlers: a training run's preemption handler (or a
    # test runner's) only records SIGTERM, and a worker that swallows the SIGTERM Pool.terminate()
    # sends on an input error never exits, so the pool's join waits forever. Workers take SIGTERM's
    # default action, and ignore Slurm's USR1/USR2, which are meant for the training process. The
    # parent blocks SIGTERM across the fork (_pool_with_default_sigterm), so none arrives before this.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _worker_tok = Tokenizer(model_file)


def _pool_with_default_sigterm(ctx, workers: int, model_file: str):
    """ctx.Pool whose workers start with SIGTERM blocked until _init_worker has reset its handler (the
    pool's helper threads, which may start replacement workers, inherit the blocked mask too)."""
    masks = hasattr(signal, "pthread_sigmask")  # POSIX; elsewhere there is no fork and no mask
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if masks else None
    try:
        return ctx.Pool(workers, initializer=_init_worker, initargs=(model_file,))
    finally:
        if masks:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def encode_chunk(texts: list[str], tok: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a chunk of documents, each followed by EOS: (flat ids int32, lengths int32)."""
    tok = tok or _worker_tok
    ids = tok.encode_batch(texts, add_eos=True)
    lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def _chunks(docs: Iterator[str], max_docs: int, max_chars: int) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for text in docs:
        chunk.append(text)
        chars += len(text)
        if len(chunk) >= max_docs or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    seconds: float
    max_token_id: int
    skipped_empty: int = 0  # records whose text field was null, missing or empty (not written)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def _progress(enabled: bool):
    from tqdm import tqdm

    return tqdm(unit="doc", disable=not enabled, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_model: str, *, text_field: str = "text",
               workers: int = 1, split: str = "train", text_sample_by: str = "document",
               chunk_docs: int = 64, chunk_chars: int = 1 << 20, progress: bool = True) -> PreprocessStats:
    """Tokenize `inputs` into OUTPUT_PREFIX.{bin,idx,json}; returns counts and timing."""
    if workers < 1:
        raise DataError("--workers", f"must be >= 1, got {workers}")
    tok = Tokenizer(tokenizer_model)
    dtype = token_dtype(tok.vocab_size)
    skipped: dict[str, int] = {}
    docs = iter_documents(inputs, text_field=text_field, split=split, text_sample_by=text_sample_by,
                          skipped=skipped)
    writer = IndexedDatasetWriter(output_prefix, dtype)
    # fork keeps worker start-up cheap (the workers only need sentencepiece); spawn elsewhere.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    t0 = time.perf_counter()
    max_id = -1
    bar = _progress(progress)
    try:
        with _pool_with_default_sigterm(ctx, workers, tok.model_file) as pool:
            window: collections.deque = collections.deque()

            def drain_one() -> None:
                nonlocal max_id
                flat, lengths = window.popleft().get()
                writer.add_documents(flat, lengths)
                if flat.size:
                    max_id = max(max_id, int(flat.max()))
                bar.update(len(lengths))
                dt = time.perf_counter() - t0
                bar.set_postfix_str(f"{writer.num_tokens / dt:,.0f} tok/s", refresh=False)

            for chunk in _chunks(docs, chunk_docs, chunk_chars):
                window.append(pool.apply_async(encode_chunk, (chunk,)))
                if len(window) >= 2 * workers:  # bounded in-flight work = bounded memory
                    drain_one()
            while window:
                drain_one()
        _report_skipped(skipped, writer.num_docs, text_field)
        if writer.num_docs == 0:
            raise DataError(",".join(inputs), f"empty input: no document has text in field {text_field!r}"
                                              + (f" ({sum(skipped.values())} records with null or empty text)"
                                                 if skipped else ""))
        if os.path.exists(f"{output_prefix}.json"):
            os.remove(f"{output_prefix}.json")  # never leave an old record beside new tokens
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    stats = PreprocessStats(writer.num_docs, writer.num_tokens, seconds, max_id, sum(skipped.values()))
    meta = {"tokenizer": tok.model_file, "tokenizer_sha256": tok.fingerprint(), "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "dtype": np.dtype(dtype).name, "inputs": list(inputs), "text_field": text_field,
            **asdict(stats)}
    tmp = f"{output_prefix}.json.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, f"{output_prefix}.json")
    return stats


def _report_skipped(skipped: dict[str, int], written: int, text_field: str) -> None:
    """One WARNING line counting the records dropped for null/empty text, per file (never silent)."""
    total = sum(skipped.values())
    if total:
        per = ", ".join(f"{src}: {n}" for src, n in skipped.items())
        log.warning("skipped %d of %d records whose %r text was null, missing or empty (%s)", total,
                    total + written, text_field, per)


def read_metadata(prefix: str) -> dict | None:
    """PREFIX.json written by preprocess(), or None for files made by other tools."""
    path = f"{prefix}.json"
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(path, f"unreadable dataset metadata ({e})") from None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m data.preprocess",
                                 description="Tokenize documents into Megatron-LM .bin/.idx files.")
    ap.add_argument("--input", nargs="+", required=True,
                    help="files (.jsonl .json .parquet .txt .arrow), folders of them, or hub dataset names")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    ap.add_argument("--tokenizer", required=True, help="sentencepiece .model (python -m data.tokenizer trains one)")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--split", default="train", help="split of a hub dataset")
    ap.add_argument("--text-sample-by", default="document", choices=["document", "line", "paragraph"],
                    help="how plain-text files are cut into documents")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        s = preprocess(a.input, a.output_prefix, a.tokenizer, text_field=a.text_field, workers=a.workers,
                       split=a.split, text_sample_by=a.text_sample_by, progress=not a.no_progress)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {a.output_prefix}.bin/.idx: {s.documents} documents, {s.tokens} tokens in {s.seconds:.1f} s "
          f"({s.documents / max(s.seconds, 1e-9):,.0f} docs/s, {s.tokens_per_s:,.0f} tokens/s)"
          + (f"; skipped {s.skipped_empty} records with null or empty text" if s.skipped_empty else ""))


if __name__ == "__main__":
    main()
