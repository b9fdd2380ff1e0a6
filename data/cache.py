"""On-disk caches keyed by their inputs: stable keys, cross-process locks, atomic writes.

Several ranks (or several runs) may reach the same cache entry at once; the first one to take the
entry's lock builds it, the others wait and then read it. Files appear under their final names only
when complete (write to a temporary name, then os.replace).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
from typing import Any, Iterator

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def resolve_cache_dir(cache_dir: str | None) -> pathlib.Path:
    """None means the repository's .cache/; relative paths are taken from the repository root."""
    path = pathlib.Path(cache_dir) if cache_dir else REPO_ROOT / ".cache"
    if not path.is_absolute():
        path = REPO_ROOT / path
    return path


def cache_key(inputs: Any) -> str:
    """Short stable hash of a JSON-serialisable description of a cache entry's inputs."""
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def file_identity(path: str | os.PathLike) -> dict:
    """What a cache entry depends on for an input file: where it is, its size and modification time."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


@contextlib.contextmanager
def locked(path: pathlib.Path) -> Iterator[None]:
    """Exclusive advisory lock on PATH.lock for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def save_npy(path: pathlib.Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def save_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)
