"""Documents from local files, folders, saved `datasets` folders or hub datasets.

Supported inputs:
    JSONL / JSON files       .jsonl .json, also compressed: .gz .zst .bz2 .xz
    Parquet files            .parquet
    plain text               .txt .text (compressed too); one document per file, line or paragraph
    Arrow files              .arrow
    saved `datasets` folders written by Dataset.save_to_disk / DatasetDict.save_to_disk
    plain folders            every file above found below them (save_to_disk folders included)
    hub dataset names        `name` or `org/name` that is no local path (streamed)

Each source is opened on its own (files in streaming mode), so a corpus larger than memory is read
piece by piece and every read error names the file it came from. Only the text column is read.
"""
from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Sequence

from data.errors import DataError

log = logging.getLogger(__name__)

_COMPRESSIONS = ("", ".gz", ".zst", ".bz2", ".xz")  # `datasets` decompresses these by suffix
_TEXT_LIKE = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text"}
# File suffix -> `datasets` builder.
BUILDERS = {**{base + c: b for base, b in _TEXT_LIKE.items() for c in _COMPRESSIONS},
            ".parquet": "parquet", ".arrow": "arrow"}
SAVED = "saved"  # pseudo-builder: a folder written by save_to_disk, read with datasets.load_from_disk
HUB = "hub"
_BATCH = 1000  # rows per batch read from a source
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class SourceTally:
    """What one source gave: documents yielded and records skipped for null, missing or empty text."""

    documents: int = 0
    skipped: int = 0
    builder: str = ""  # how the source is read ("json", "text", "parquet", ...): the skip warning's wording


def builder_for(path: str) -> str | None:
    name = path.lower()
    for suffix in sorted(BUILDERS, key=len, reverse=True):
        if name.endswith(suffix):
            return BUILDERS[suffix]
    return None


def is_saved_dataset(path: str) -> bool:
    """A folder written by Dataset.save_to_disk (state.json + dataset_info.json) or
    DatasetDict.save_to_disk (dataset_dict.json)."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json")))


def _is_compressed(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in (".gz", ".zst", ".bz2", ".xz")


def _open_bytes(path: str) -> BinaryIO:
    """The file's bytes as `datasets` reads them: decompressed by suffix."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".zst":
        import zstandard

        return zstandard.open(path, "rb")
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(ext, open)
    return opener(path, "rb")


def _holds_no_bytes(path: str) -> bool:
    """An empty file, or a compressed one that decompresses to nothing (datasets cannot infer a schema
    from either, and they hold no documents)."""
    if os.path.getsize(path) == 0:
        return True
    if not _is_compressed(path):
        return False
    with _open_bytes(path) as f:
        return f.read(1) == b""


def _looks_local(item: str) -> bool:
    """A missing path is an error; only a bare `name` or `org/name` may mean a hub dataset."""
    return (builder_for(item) is not None or item.startswith(("/", ".", "~")) or not _HUB_NAME.match(item)
            or os.path.isdir(item.split("/")[0]))


def _supported() -> str:
    return (f"{' '.join(_TEXT_LIKE)} (plain or {' '.join(c for c in _COMPRESSIONS if c)}), .parquet or .arrow files, "
            "or folders saved with datasets' save_to_disk")


def _walk_folder(folder: str) -> list[tuple[str, str]]:
    """Every readable source below a plain folder, sorted by path; saved datasets count as one source.
    Hidden entries (.cache, .git, ...) are skipped; other files of unknown type are named in a warning."""
    found: list[tuple[str, str]] = []
    ignored: list[str] = []
    for d, subdirs, files in os.walk(folder):
        keep = []
        for s in sorted(subdirs):
            if s.startswith("."):
                continue
            if is_saved_dataset(os.path.join(d, s)):
                found.append((os.path.join(d, s), SAVED))
            else:
                keep.append(s)
        subdirs[:] = keep
        for f in files:
            if f.startswith("."):
                continue
            b = builder_for(f)
            if b is None:
                ignored.append(os.path.join(d, f))
            else:
                found.append((os.path.join(d, f), b))
    if not found:
        raise DataError(folder, f"folder has no {_supported()}")
    if ignored:
        ignored.sort()
        log.warning("%s: ignoring %d file(s) of unknown type: %s%s (readable: %s)", folder, len(ignored),
                    ", ".join(ignored[:5]), ", ..." if len(ignored) > 5 else "", _supported())
    return sorted(found)


def resolve_inputs(inputs: Sequence[str]) -> list[tuple[str, str]]:
    """Expand files and folders into (path or hub name, builder) pairs, in a stable order."""
    out: list[tuple[str, str]] = []
    for item in inputs:
        if os.path.isdir(item):
            out += [(item, SAVED)] if is_saved_dataset(item) else _walk_folder(item)
        elif os.path.isfile(item):
            b = builder_for(item)
            if b is None:
                raise DataError(item, f"unknown file type; expected {_supported()}")
            out.append((item, b))
        elif _looks_local(item):
            raise DataError(item, "input file or folder not found")
        else:
            out.append((item, HUB))
    return out


def _no_field(source: str, field: str, fields) -> DataError:
    return DataError(source, f"no text field {field!r}; fields are {sorted(fields)} (set --text-field)")


def _saved_batches(source: str, field: str, split: str) -> Iterator[list]:
    import datasets

    ds = datasets.load_from_disk(source)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(source, f"saved DatasetDict has no split {split!r}; splits are {sorted(ds)} (set --split)")
        ds = ds[split]
    if field not in ds.column_names:
        raise _no_field(source, field, ds.column_names)
    for batch in ds.select_columns([field]).iter(batch_size=_BATCH):
        yield batch[field]


def _streamed_batches(source: str, builder: str, field: str, split: str, text_sample_by: str) -> Iterator[list]:
    import datasets

    if builder == HUB:
        try:
            ds = datasets.load_dataset(source, split=split, streaming=True)
        except Exception as e:  # noqa: BLE001 - any hub failure becomes one line naming the source
            raise DataError(source, f"not a local file or folder, and loading it as a hub dataset failed: "
                                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    else:
        kwargs = {"sample_by": text_sample_by} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=[source], split="train", streaming=True, **kwargs)
    if ds.features is not None:  # known up front (parquet, arrow, json): check and read only the text column
        if field not in ds.features:
            raise _no_field(source, field, ds.features)
        ds = ds.select_columns([field])
    first = True
    for batch in ds.iter(batch_size=_BATCH):
        if first and field not in batch:
            raise _no_field(source, field, batch)
        first = False
        yield batch[field]


def _undecodable(line: int, offset: int, e: UnicodeDecodeError, path: str) -> str:
    of = " of the decompressed data" if _is_compressed(path) else ""
    return (f"undecodable bytes (not valid UTF-8) on line {line}, at byte offset {offset}{of}: "
            f"byte 0x{e.object[e.start]:02x}, {e.reason}")


def _whole_document_error(path: str) -> tuple[int, str] | None:
    """The file parsed as one JSON document: None when it is valid, else (line, reason)."""
    with _open_bytes(path) as f:
        data = f.read()
    try:
        json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return line, _undecodable(line, e.start, e, path)
    except ValueError as e:
        return e.lineno, _not_json(e.lineno, e)
    return None


def _not_json(line: int, e: json.JSONDecodeError) -> str:
    # Some of json's messages end in "at" ("Unterminated string starting at"): no second "at" then.
    at = "" if e.msg.endswith(" at") else " at"
    return f"line {line} is not valid JSON: {e.msg}{at} column {e.colno}"


def _json_kind(value) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def _is_text(value) -> bool:
    """What iter_documents takes or counts as skipped: a string, or null/missing."""
    return value is None or isinstance(value, str)


def _not_text(field: str, value) -> str:
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):  # bytes, a timestamp, an array from Parquet: no JSON spelling
        shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"field {field!r} holds {type(value).__name__} {shown}, not text"


def _is_jsonl(path: str) -> bool:
    name = path.lower()
    return any(name.endswith(".jsonl" + c) for c in _COMPRESSIONS)


def _first_bad_line(path: str, parse_json: bool, field: str | None = None) -> str | None:
    """Where a file that `datasets` could not read first goes wrong, found by reading it again line by
    line: the problem with its line number, or None when every line reads (the failure was something else).
    With `field`, a record whose field holds neither text nor null is a problem too (the line of a
    non-text value that iter_documents met).
    `datasets` names a JSON error by the row of an internal read block and a decoding error by the
    byte of a chunk, neither of which leads to the line to fix. Runs only after a failure."""
    offset = 0
    seen_json = False
    with _open_bytes(path) as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")  # a newline byte is never inside a UTF-8 sequence
            except UnicodeDecodeError as e:
                return _undecodable(n, offset + e.start, e, path)
            offset += len(raw)
            if not parse_json or not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                if not seen_json:
                    # A .json file may be one document over many lines ("[" alone on line 1 is no
                    # JSON): parsed whole, it is valid, or its error lies past this line.
                    whole = _whole_document_error(path)
                    if whole is None or whole[0] > n:
                        return None if whole is None else whole[1]
                return _not_json(n, e)
            if not isinstance(value, dict):
                # Valid JSON that is no record: `datasets` names it by an internal column ("Column()
                # changed from object to string in row 0"). A .json file may be one document whose
                # first line is a complete value only if the whole file is that value: not a bad line.
                if not seen_json and not _is_jsonl(path) and _whole_document_error(path) is None:
                    return None
                return (f"line {n} is a JSON {_json_kind(value)}, not an object: each line of a JSON Lines file "
                        "must be one {...} record")
            if field is not None and not _is_text(value.get(field)):
                return f"line {n}: {_not_text(field, value[field])}"
            seen_json = True
    return None


def _non_text_error(source: str, builder: str, field: str, value, record: int) -> DataError:
    """A text field holding a number, list, ...: named by its line in a local JSON file (found by reading
    the file again), else by its record number in the source (1 = the first record)."""
    where = None
    if builder == "json" and os.path.isfile(source):
        try:
            where = _first_bad_line(source, parse_json=True, field=field)
        except Exception as scan_error:  # noqa: BLE001 - the record number below still names it
            log.debug("%s: rescanning for a non-text value failed: %s", source, scan_error)
    return DataError(source, where or f"record {record}: {_not_text(field, value)}")


def _read_error(source: str, builder: str, e: Exception, field: str | None = None) -> DataError:
    where = None
    if builder in ("json", "text") and os.path.isfile(source) and (builder == "json"
                                                                  or isinstance(e, UnicodeDecodeError)):
        try:
            # the field too: a text value of another type can fail `datasets`' read of a file as a whole
            where = _first_bad_line(source, parse_json=builder == "json", field=field if builder == "json" else None)
        except Exception as scan_error:  # noqa: BLE001 - e.g. a corrupt archive: the first error stands
            log.debug("%s: rescanning after a read error failed: %s", source, scan_error)
    if where:
        return DataError(source, where)
    if isinstance(e, UnicodeDecodeError):
        return DataError(source, f"undecodable bytes (not valid UTF-8) at byte {e.start} of a chunk: {e.reason}")
    first = str(e).splitlines()[0] if str(e) else ""
    what = "a saved datasets folder" if builder == SAVED else builder
    return DataError(source, f"cannot read as {what}: {type(e).__name__}: {first}")


@contextmanager
def _datasets_quiet():
    """`datasets` logs a failed JSON read itself, twice (its own handler and the root's), before it
    raises; the one line to show is the DataError below, so its logging is off while it reads."""
    lib = logging.getLogger("datasets")
    level = lib.level
    lib.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        lib.setLevel(level)


_END = object()


def _quietly(batches: Iterator[list]) -> Iterator[list]:
    """The batches, each read with `datasets`' logging off (restored between batches, while the
    caller runs)."""
    while True:
        with _datasets_quiet():
            batch = next(batches, _END)
        if batch is _END:
            return
        yield batch


def _reads_split(source: str, builder: str) -> bool:
    return builder == HUB or (builder == SAVED and os.path.isfile(os.path.join(source, "dataset_dict.json")))


def iter_documents(inputs: Sequence[str], text_field: str = "text", split: str | None = None,
                   text_sample_by: str = "document", tally: dict[str, SourceTally] | None = None) -> Iterator[str]:
    """Yield the text of every document, in input order.

    Plain-text files are one document per file by default (text_sample_by="document"); "line" and
    "paragraph" split them further. `split` picks the split of a hub dataset or a saved DatasetDict
    (None: "train"); given for inputs none of which has splits, it is an error rather than ignored.
    Records whose text is null, missing or empty are skipped; `tally`, when given, receives per source
    (in input order) the documents yielded and the records skipped, so the caller can report them.
    """
    if text_sample_by not in ("document", "line", "paragraph"):
        raise DataError("--text-sample-by", f"{text_sample_by!r} is not one of document|line|paragraph")
    import datasets

    datasets.disable_progress_bars()
    sources = resolve_inputs(inputs)
    if split is not None and not any(_reads_split(src, b) for src, b in sources):
        raise DataError("--split", f"{split!r} is only read from hub datasets and folders saved from a DatasetDict; "
                                   f"{', '.join(src for src, _ in sources[:3])}{', ...' if len(sources) > 3 else ''}"
                                   " has no splits (drop --split)")
    split = "train" if split is None else split
    for source, builder in sources:
        counts = tally.setdefault(source, SourceTally()) if tally is not None else SourceTally()
        counts.builder = builder
        field = "text" if builder == "text" else text_field
        try:
            if builder in ("json", "text") and _holds_no_bytes(source):
                # No records (and datasets cannot infer a schema from nothing). An empty text file read one
                # document per file is one empty document: skipped and counted, as an empty record is.
                if builder == "text" and text_sample_by == "document":
                    counts.skipped += 1
                continue
            batches = (_saved_batches(source, field, split) if builder == SAVED
                       else _streamed_batches(source, builder, field, split, text_sample_by))
            for texts in _quietly(batches):
                for text in texts:
                    if text is None or text == "":
                        counts.skipped += 1
                        continue
                    if not isinstance(text, str):
                        raise _non_text_error(source, builder, field, text, counts.documents + counts.skipped + 1)
                    counts.documents += 1
                    yield text
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised as one line naming the file
            raise _read_error(source, builder, e, field) from None
