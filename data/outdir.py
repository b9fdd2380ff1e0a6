"""The output directory of a CLI that writes PREFIX.* files (data.preprocess, data.tokenizer).

Both create a missing directory, as a user expects of an output path; what a run created is removed
again when the run fails and leaves it empty, so a mistyped path does not leave directories behind.
"""
from __future__ import annotations

import os

from data.errors import DataError


def make_parent(prefix: str, key: str) -> list[str]:
    """Create the directory of PREFIX (and missing parents); returns those created, outermost first.
    A path component that is a file is one line naming `key` (the option that gave the prefix)."""
    parent = os.path.dirname(os.path.abspath(prefix))
    missing = []
    d = parent
    while not os.path.isdir(d):
        if os.path.exists(d):
            raise DataError(key, f"{prefix!r}: {d} is a file, not a directory")
        missing.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise DataError(key, f"cannot create the output directory {parent} ({e.strerror})") from None
    return missing[::-1]


def remove_if_empty(created: list[str]) -> None:
    """Undo make_parent after a failed run: the directories it created that are still empty, innermost
    first (one that now holds anything, e.g. another run's files, stays)."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (or gone): its parents are not empty either
