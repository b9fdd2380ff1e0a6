"""The startup measurements' cache files (collective probe, compute profile, TP unit timings): rank 0
reads one field of a JSON file and every rank receives it, so all ranks agree on measuring again or not;
rank 0 writes the file atomically (a concurrent run never reads half of it)."""
from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

from amsp import control

log = logging.getLogger(__name__)


def read_shared(path: pathlib.Path, field: str, use_cache: bool, rank: int, distributed: bool,
                what: str) -> Any | None:
    """`field` of the cached file on every rank, or None (no file, caching off, or unreadable: logged, and
    the caller measures again). Collective when distributed."""
    value = None
    if rank == 0 and use_cache and path.exists():
        try:
            value = json.loads(path.read_text())[field]
        except (OSError, ValueError, KeyError) as e:
            log.warning("%s cache %s unreadable (%s); measuring again", what, path, e)
    return control.broadcast_object(value, src=0) if distributed else value


def write_atomic(path: pathlib.Path, payload: dict) -> None:
    """Rank 0's write of a measurement: a temporary file renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


# A refit scale this far from 1 (either way) at the recheck means the cached measurement does not describe
# the machine as it runs now (typically taken while other jobs shared it): every later startup on the same
# key would plan from it.
STALE_FACTOR = 1.5


def forget_if_stale(path: str | pathlib.Path | None, scale: float) -> str | None:
    """Remove the cache file `path` when the recheck's refit `scale` is STALE_FACTOR or more off, so the
    next startup measures afresh. Returns the removed path, or None (kept, or nothing to remove)."""
    if path is None or 1 / STALE_FACTOR < scale < STALE_FACTOR:
        return None
    try:
        pathlib.Path(path).unlink()
    except FileNotFoundError:
        return None
    return str(path)
