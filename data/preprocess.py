"""Tokenize documents into a Megatron-compatible indexed dataset (PREFIX.bin + PREFIX.idx).

    python -m data.preprocess --input corpus/ --output-prefix out/corpus --tokenizer tok.model \\
        --text-field text --workers 8

Inputs are anything data/sources.py reads (JSONL, compressed JSONL, Parquet, text, saved `datasets`
folders, folders of those, hub names). A `.bin` or `.idx` ending on the output prefix is dropped
(`out/corpus.bin` writes out/corpus.bin and out/corpus.idx). Bad input is one line and exit code 2.

Documents stream from the reader (main process) to worker processes in chunks; a bounded window
of chunks is in flight, and results are written in input order, so memory stays bounded whatever
the corpus size. EOS is appended to every document. Outputs are written under temporary names and
renamed at the end; PREFIX.json records the tokenizer and counts so training can check that the
dataset matches its tokenizer (Megatron's own tools ignore that file).
SIGTERM (a Slurm time limit) and Ctrl-C stop the CLI with one line, removing the temporary files (exit code
143 or 130); those of a run killed outright are removed by the next run at that prefix. The output may not
overwrite an input, nor lie inside an input folder (a later run would read its PREFIX.json as a document).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import logging
import multiprocessing as mp
import os
import re
import signal
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

import numpy as np

from amsp.errors import one_line_errors
from amsp.pid import pid_alive
from data.errors import DataError
from data.indexed_dataset import IndexedDatasetWriter, token_dtype
from data.outdir import Terminated, exit_stopped, make_parent, output_error, remove_if_empty, stop_signals
from data.progress import Progress
from data.sources import SourceTally, iter_documents
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
    # Ctrl-C reaches the whole process group: a worker that raised KeyboardInterrupt inside the result
    # queue's put() died holding its lock, and the parent's terminate() then waited forever. Workers
    # ignore SIGINT (blocked across the fork too); the parent stops them.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORK_BLOCKED)
    _worker_tok = Tokenizer(model_file)


_FORK_BLOCKED = {signal.SIGTERM, signal.SIGINT}


def _pool_with_default_sigterm(ctx, workers: int, model_file: str):
    """ctx.Pool whose workers start with SIGTERM and SIGINT blocked until _init_worker has reset their
    handlers (the pool's helper threads, which may start replacement workers, inherit the blocked mask
    too; Python runs signal handlers in the main thread only, so blocking them there loses nothing)."""
    masks = hasattr(signal, "pthread_sigmask")  # POSIX; elsewhere there is no fork and no mask
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _FORK_BLOCKED) if masks else None
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


def _encode_job(texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """encode_chunk in a worker, plus the chunk's UTF-8 size for the progress line (counted here, off
    the reader's critical path)."""
    flat, lengths = encode_chunk(texts)
    return flat, lengths, sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def _stop_pool(pool, in_flight, graceful: bool, timeout: float = 120.0) -> None:
    """Shut the pool down. Gracefully (at the end, or after a bad input): the chunks still in flight
    (at most 2 per worker) finish first and the workers exit on their own. Pool.terminate() kills
    workers where they are, and one killed while sending its result leaves the result queue's lock
    held, so terminate() then waits forever for the pool's task thread (a CPython race that the
    repeated bad-input runs of tests/data/test_bad_input.py met now and then). terminate() is kept
    for interrupts, and for chunks that do not finish within `timeout` seconds (a dead worker)."""
    deadline = time.monotonic() + timeout
    for r in in_flight if graceful else ():
        r.wait(max(0.0, deadline - time.monotonic()))
    if graceful and all(r.ready() for r in in_flight):
        pool.close()
    else:
        pool.terminate()
    pool.join()


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
    text_bytes: int = 0  # UTF-8 bytes of the documents written

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def dataset_prefix(path: str, key: str = "--output-prefix") -> str:
    """The prefix of PREFIX.bin/PREFIX.idx: a trailing .bin or .idx is dropped, as people often name
    the file they mean (`--output-prefix out/x.bin` writes out/x.bin and out/x.idx, not out/x.bin.bin).
    A prefix with no file name (`out/`, `out/.bin`) is refused: it would mean the hidden files
    out/.bin and out/.idx. `key` is the option or config key named in that error."""
    prefix = path
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix) and len(path) > len(suffix):
            prefix = path[:-len(suffix)]
            break
    if os.path.basename(prefix) in ("", ".", ".."):
        raise DataError(key, f"{path!r} has no file name; give DIR/NAME to use DIR/NAME.bin and DIR/NAME.idx")
    return prefix


_TEMP_SUFFIX = re.compile(r"\.(?:bin|idx|json)\.tmp-(\d+)")  # IndexedDatasetWriter's and preprocess()'s


def remove_stale_temp_files(prefix: str, min_age_s: float = 60.0) -> list[str]:
    """Remove PREFIX.{bin,idx,json}.tmp-PID files that a killed run left (SIGKILL, a lost node): no
    process PID is alive here and nothing wrote them for min_age_s. The age guard spares a live run on
    another node of a shared file system, whose PID this machine cannot see. Returns what was removed."""
    parent, name = os.path.split(os.path.abspath(prefix))
    if not os.path.isdir(parent):
        return []  # the writer reports the missing directory
    removed = []
    for entry in sorted(os.listdir(parent)):
        m = _TEMP_SUFFIX.fullmatch(entry[len(name):]) if entry.startswith(name) else None
        if m is None or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(parent, entry)
        try:
            if time.time() - os.path.getmtime(path) < min_age_s:
                continue
            os.remove(path)
        except FileNotFoundError:
            continue  # another run removed it first
        removed.append(path)
    if removed:
        log.warning("removed %d temporary file(s) left by an earlier run that was killed: %s", len(removed),
                    ", ".join(removed))
    return removed


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False  # b does not exist yet


def _visible_below(folder: str, path: str) -> bool:
    """Whether a walk of `folder` (data/sources.py, which skips hidden entries) would reach `path`."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(folder))
    parts = rel.split(os.sep)
    return parts[0] != ".." and not any(p.startswith(".") for p in parts)


def check_output_not_input(inputs: Sequence[str], output_prefix: str) -> None:
    """Refuse an output that is one of the inputs, or lies in an input folder, before anything is written.
    PREFIX.json named as an input was replaced by the metadata (the corpus lost); outputs in an input
    folder are read back as input by the next run (its PREFIX.json fails as a document without text), so
    that is refused too rather than silently skipping some files of a folder the user named."""
    outputs = [f"{output_prefix}{ext}" for ext in (".json", ".bin", ".idx")]
    for item in inputs:
        if os.path.isfile(item):
            for out in outputs:
                if _same_file(item, out):
                    raise DataError("--output-prefix", f"{output_prefix!r} would overwrite the input {item}; "
                                                       "choose another prefix")
        elif os.path.isdir(item) and _visible_below(item, outputs[0]):
            raise DataError("--output-prefix", f"{output_prefix!r} is inside the input folder {item}, whose "
                                               f"next read would take {os.path.basename(outputs[0])} for a "
                                               "document; write the dataset outside that folder")


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_model: str, *, text_field: str = "text",
               workers: int = 1, split: str | None = None, text_sample_by: str = "document",
               chunk_docs: int = 64, chunk_chars: int = 1 << 20, progress: bool = True,
               progress_every: float = 30.0) -> PreprocessStats:
    """Tokenize `inputs` into OUTPUT_PREFIX.{bin,idx,json}; returns counts and timing.

    progress: a throughput line on stderr (data/progress.py); progress_every: seconds between lines
    when stderr is not a terminal (> 0; progress=False turns the lines off). split: the split of a hub
    dataset or saved DatasetDict (None: "train"; an error where no input has splits)."""
    if workers < 1:
        raise DataError("--workers", f"must be >= 1, got {workers}")
    if not progress_every > 0:  # 0 or less would mean a line per chunk of documents; NaN never compares
        raise DataError("--progress-every", f"must be > 0 seconds, got {progress_every:g} (--no-progress turns "
                                            "the progress lines off)")
    output_prefix = dataset_prefix(output_prefix)
    check_output_not_input(inputs, output_prefix)
    remove_stale_temp_files(output_prefix)
    tok = Tokenizer(tokenizer_model)
    dtype = token_dtype(tok.vocab_size)
    tally: dict[str, SourceTally] = {}
    docs = iter_documents(inputs, text_field=text_field, split=split, text_sample_by=text_sample_by, tally=tally)
    # Created only now, after the arguments and the tokenizer checked out; removed again below if the
    # run fails and leaves it empty.
    created = make_parent(output_prefix, "--output-prefix")
    try:
        try:
            writer = IndexedDatasetWriter(output_prefix, dtype)
        except OSError as e:  # a read-only directory, /proc/self/x, ...
            raise output_error("--output-prefix", output_prefix, e) from None
    except BaseException:
        remove_if_empty(created)
        raise
    # fork keeps worker start-up cheap (the workers only need sentencepiece); spawn elsewhere.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    t0 = time.perf_counter()
    max_id = -1
    text_bytes = 0
    bar = Progress(progress, every=progress_every)
    tmp_json = f"{output_prefix}.json.tmp-{os.getpid()}"
    try:
        pool = _pool_with_default_sigterm(ctx, workers, tok.model_file)
        window: collections.deque = collections.deque()
        try:
            def drain_one() -> None:
                nonlocal max_id, text_bytes
                flat, lengths, nbytes = window.popleft().get()
                try:
                    writer.add_documents(flat, lengths)
                except OSError as e:  # a full disk: one line, not a traceback
                    raise output_error("--output-prefix", output_prefix, e, writer.tmp_bin) from None
                if flat.size:
                    max_id = max(max_id, int(flat.max()))
                text_bytes += nbytes
                bar.update(len(lengths), int(flat.size), nbytes, sum(t.skipped for t in tally.values()))

            for chunk in _chunks(docs, chunk_docs, chunk_chars):
                window.append(pool.apply_async(_encode_job, (chunk,)))
                if len(window) >= 2 * workers:  # bounded in-flight work = bounded memory
                    drain_one()
            while window:
                drain_one()
        except BaseException as e:
            _stop_pool(pool, window, graceful=isinstance(e, Exception))
            raise
        _stop_pool(pool, window, graceful=True)
        skipped = {src: t.skipped for src, t in tally.items() if t.skipped}
        _report_skipped(tally, writer.num_docs, text_field, text_sample_by)
        _report_empty_sources(tally)
        if writer.num_docs == 0:
            raise DataError(",".join(inputs), f"empty input: no document has text in field {text_field!r}"
                                              + (f" ({sum(skipped.values())} records with null or empty text)"
                                                 if skipped else ""))
        seconds = time.perf_counter() - t0
        stats = PreprocessStats(writer.num_docs, writer.num_tokens, seconds, max_id, sum(skipped.values()),
                                text_bytes)
        # Documents are written in source order: source k holds the next `documents` ids after source k-1's.
        sources = [{"source": src, "documents": t.documents, "skipped_empty": t.skipped}
                   for src, t in tally.items()]
        meta = {"tokenizer": tok.model_file, "tokenizer_kind": tok.kind, **tok.document_format,
                "tokenizer_sha256": tok.fingerprint(), "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id, "dtype": np.dtype(dtype).name, "inputs": list(inputs),
                "text_field": text_field, **asdict(stats), "sources": sources}
        # Every file is complete under its temporary name before any final name changes: a full disk
        # then leaves the earlier dataset whole, PREFIX.json included.
        try:
            writer.prepare()
            with open(tmp_json, "w") as f:
                json.dump(meta, f, indent=1)
        except OSError as e:
            raise output_error("--output-prefix", output_prefix, e) from None
        # Renames only from here. The old record goes first, so a run killed between the renames leaves
        # new tokens without a record rather than beside the old one.
        if os.path.exists(f"{output_prefix}.json"):
            os.remove(f"{output_prefix}.json")
        writer.commit()
        os.replace(tmp_json, f"{output_prefix}.json")
    except BaseException:
        writer.abort()
        if os.path.exists(tmp_json):
            os.remove(tmp_json)
        remove_if_empty(created)
        raise
    finally:
        bar.close()
    return stats


def _skip_reasons(tally: dict[str, SourceTally], text_field: str, text_sample_by: str) -> list[str]:
    """What was skipped, in words that fit each kind of source: a record's text field for JSON, Parquet,
    ...; an empty file, line or paragraph for plain text, which has no field."""
    empty = {"document": "empty text files", "line": "empty lines of text files",
             "paragraph": "empty paragraphs of text files"}[text_sample_by]
    reasons = []
    for text_kind, what in ((False, f"records whose {text_field!r} field was null, missing or empty"),
                            (True, empty)):
        per = {src: t.skipped for src, t in tally.items() if t.skipped and (t.builder == "text") == text_kind}
        if per:
            reasons.append(f"{sum(per.values())} {what} ({', '.join(f'{src}: {n}' for src, n in per.items())})")
    return reasons


def _report_skipped(tally: dict[str, SourceTally], written: int, text_field: str, text_sample_by: str) -> None:
    """One WARNING line counting the records dropped for null/empty text, per file (never silent)."""
    total = sum(t.skipped for t in tally.values())
    if total:
        log.warning("skipped %d of %d records with no text: %s", total, total + written,
                    "; ".join(_skip_reasons(tally, text_field, text_sample_by)))


def _report_empty_sources(tally: dict[str, SourceTally]) -> None:
    """One WARNING line naming the inputs that held no record at all (an empty JSONL file, an empty text
    file read by line): nothing was skipped from them, so the skip count above does not show them."""
    empty = [src for src, t in tally.items() if t.documents == 0 and t.skipped == 0]
    if empty:
        log.warning("%d input(s) held no records at all: %s%s", len(empty), ", ".join(empty[:5]),
                    f" and {len(empty) - 5} more" if len(empty) > 5 else "")


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
                    help="files (.jsonl .json, also .gz/.zst/.bz2/.xz; .parquet .txt .arrow), folders saved with "
                         "datasets' save_to_disk, folders of these, or hub dataset names")
    ap.add_argument("--output-prefix", required=True,
                    help="writes PREFIX.bin, PREFIX.idx and PREFIX.json (a .bin/.idx ending is dropped)")
    ap.add_argument("--tokenizer", required=True, help="sentencepiece .model, tokenizer.json (or its folder) or "
                    "tiktoken BPE file (python -m data.tokenizer trains a .model)")
    ap.add_argument("--text-field", default="text", help="the column/key holding each document's text")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--split", default=None, help="split of a hub dataset or a saved DatasetDict (default: train; "
                    "an error for inputs without splits)")
    ap.add_argument("--text-sample-by", default="document", choices=["document", "line", "paragraph"],
                    help="how plain-text files are cut into documents")
    ap.add_argument("--no-progress", action="store_true", help="no throughput lines on stderr")
    ap.add_argument("--progress-every", type=float, default=30.0, metavar="SECONDS",
                    help="seconds (> 0) between throughput lines when stderr is not a terminal (a job log)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stopped = None
    with stop_signals(), one_line_errors():  # a DataError is one line on stderr and exit code 2
        try:
            prefix = dataset_prefix(a.output_prefix)
            s = preprocess(a.input, prefix, a.tokenizer, text_field=a.text_field, workers=a.workers,
                           split=a.split, text_sample_by=a.text_sample_by, progress=not a.no_progress,
                           progress_every=a.progress_every)
        except (Terminated, KeyboardInterrupt) as e:
            # Caught inside: one_line_errors imports modules to classify an exception, and a signal that
            # cut an import short (datasets is imported lazily) can leave them unimportable.
            stopped = e
    if stopped is not None:
        exit_stopped(stopped, f"{a.output_prefix} not written (an earlier dataset there is untouched, temporary "
                              "files removed)")
    print(f"wrote {prefix}.bin/.idx: {s.documents} documents, {s.tokens} tokens, {s.text_bytes / 1e6:.1f} MB of "
          f"text in {s.seconds:.1f} s ({s.documents / max(s.seconds, 1e-9):,.0f} docs/s, "
          f"{s.tokens_per_s:,.0f} tokens/s)"
          + (f"; skipped {s.skipped_empty} records with null or empty text" if s.skipped_empty else ""))


if __name__ == "__main__":
    main()
