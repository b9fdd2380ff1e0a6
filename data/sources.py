"""Documents from local files, folders or hub datasets, read through the `datasets` library.

Each local file is opened on its own in streaming mode, so a corpus larger than memory is read
piece by piece and every read error names the file it came from.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Iterator, Sequence

from data.errors import DataError

log = logging.getLogger(__name__)

# File suffix -> `datasets` builder.
BUILDERS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
            ".txt": "text", ".text": "text", ".arrow": "arrow"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def builder_for(path: str) -> str | None:
    name = path.lower()
    for suffix in sorted(BUILDERS, key=len, reverse=True):
        if name.endswith(suffix):
            return BUILDERS[suffix]
    return None


def _looks_local(item: str) -> bool:
    """A missing path is an error; only a bare `name` or `org/name` may mean a hub dataset."""
    return (builder_for(item) is not None or item.startswith(("/", ".", "~")) or not _HUB_NAME.match(item)
            or os.path.isdir(item.split("/")[0]))


def resolve_inputs(inputs: Sequence[str]) -> list[tuple[str, str]]:
    """Expand files and folders into (path or hub name, builder) pairs, in a stable order."""
    out: list[tuple[str, str]] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs if builder_for(f))
            if not found:
                raise DataError(item, f"folder has no {'/'.join(sorted(BUILDERS))} files")
            out += [(f, builder_for(f)) for f in found]
        elif os.path.isfile(item):
            b = builder_for(item)
            if b is None:
                raise DataError(item, f"unknown file type; expected one of {', '.join(sorted(BUILDERS))}")
            out.append((item, b))
        elif _looks_local(item):
            raise DataError(item, "input file or folder not found")
        else:
            out.append((item, "hub"))
    return out


def _open(source: str, builder: str, split: str, text_sample_by: str):
    import datasets

    datasets.disable_progress_bars()
    if builder == "hub":
        try:
            return datasets.load_dataset(source, split=split, streaming=True)
        except Exception as e:  # noqa: BLE001 - any hub failure becomes one line naming the source
            raise DataError(source, f"not a local file or folder, and loading it as a hub dataset failed: "
                                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    kwargs = {"sample_by": text_sample_by} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=[source], split="train", streaming=True, **kwargs)


def _read_error(source: str, builder: str, e: Exception) -> DataError:
    if isinstance(e, UnicodeDecodeError):
        return DataError(source, f"undecodable bytes (not valid UTF-8) at byte {e.start} of a chunk: {e.reason}")
    first = str(e).splitlines()[0] if str(e) else ""
    return DataError(source, f"cannot read as {builder}: {type(e).__name__}: {first}")


def iter_documents(inputs: Sequence[str], text_field: str = "text", split: str = "train",
                   text_sample_by: str = "document", skipped: dict[str, int] | None = None) -> Iterator[str]:
    """Yield the text of every document, in input order.

    Plain-text files are one document per file by default (text_sample_by="document"); "line" and
    "paragraph" split them further. Documents whose text is empty or missing (None) are skipped;
`skipped`, when given, counts them per source (preprocess() reports the count).
    """
    if text_sample_by not in ("document", "line", "paragraph"):
        raise DataError("--text-sample-by", f"{text_sample_by!r} is not one of document|line|paragraph")
    for source, builder in resolve_inputs(inputs):
        field = "text" if builder == "text" else text_field
        if builder != "hub" and os.path.getsize(source) == 0:
            continue  # an empty file holds no documents (datasets cannot infer its schema)
        try:
            ds = _open(source, builder, split, text_sample_by)
            it = iter(ds)
            first = True
            while True:
                try:
                    row = next(it)
                except StopIteration:
                    break
                if first and field not in row:
                    raise DataError(source, f"no text field {field!r}; fields are {sorted(row)} (set --text-field)")
                first = False
                text = row.get(field)
                if text is not None and not isinstance(text, str):
                    raise DataError(source, f"field {field!r} holds {type(text).__name__}, not text")
                if text:
                    yield text
                elif skipped is not None:
                    skipped[source] = skipped.get(source, 0) + 1
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised as one line naming the file
            raise _read_error(source, builder, e) from None
