"""Read back an offline wandb run: its config, history rows and logged tables, without a server.

    python -m amsp.metrics.wandb_offline RUN_DIR     # chosen plan, tables, last logged metrics

An offline run is RUN_DIR/wandb/offline-run-*/: tables are JSON files under files/, everything
else (config, history, summary) is in run-ID.wandb, a LevelDB-style log of wandb's protobuf
`Record` messages: a 7-byte header (":W&B", 0xBEE1, version 0), then 32 KiB blocks of chunks, each
with a 7-byte header (CRC, length, type FULL/FIRST/MIDDLE/LAST). wandb 0.31 has no public reader
for it (`wandb sync --view` needs a server). Checksums are not verified: this is for looking at a
run and for tests, and a torn tail (a killed run) ends the read at the last whole record.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")  # crc32c, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_records(path: str | pathlib.Path) -> Iterator[Any]:
    """The wandb_internal_pb2.Record messages of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = pathlib.Path(path).read_bytes()
    if not data.startswith(_HEADER):
        raise ValueError(f"{path}: not a wandb run file (header {data[:7]!r}, expected {_HEADER!r})")
    pos, parts = len(_HEADER), []
    while pos + _CHUNK.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = _CHUNK.unpack_from(data, pos)
        pos += _CHUNK.size
        if pos + length > len(data) or kind not in (_FULL, _FIRST, _MIDDLE, _LAST):
            return  # torn tail or padding: nothing whole follows
        parts.append(data[pos:pos + length])
        pos += length
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _set(target: dict, item: Any) -> None:
    keys = list(item.nested_key) or [item.key]
    for k in keys[:-1]:
        target = target.setdefault(k, {})
    target[keys[-1]] = json.loads(item.value_json)


@dataclass
class OfflineRun:
    directory: pathlib.Path
    run_id: str
    config: dict = field(default_factory=dict)
    history: list = field(default_factory=list)  # one dict per logged step
    tables: dict = field(default_factory=dict)  # name -> {"columns": [...], "data": [[...], ...]}
    # define_metric's x axes: metric name or glob ("train/*") -> its step metric ("train/step")
    step_metrics: dict = field(default_factory=dict)
    finished: bool = False  # the exit record is there: wandb wrote everything

    def table(self, name: str) -> dict:
        if name not in self.tables:
            raise KeyError(f"{self.directory}: no table {name!r} was logged (tables: {sorted(self.tables) or 'none'})")
        return self.tables[name]


def offline_run_dir(path: str | pathlib.Path) -> pathlib.Path:
    """An offline-run-* directory itself, or the newest one under RUN_DIR/wandb or a wandb dir."""
    path = pathlib.Path(path)
    if path.name.startswith("offline-run-"):
        return path
    for base in (path / "wandb", path):
        found = sorted(base.glob("offline-run-*")) if base.is_dir() else []
        if found:
            return found[-1]  # names start with the start time, so the last is the newest
    raise FileNotFoundError(f"no offline wandb run under {path} (expected {path}/wandb/offline-run-*; was "
                            f"logging.wandb.mode=offline?)")


def read_offline_run(path: str | pathlib.Path, wait_finished_s: float = 0.0) -> OfflineRun:
    """The newest offline run under `path`. wandb's service process writes the file after the
    training process hands records over, and may still be writing just after run.finish() returns:
    wait_finished_s re-reads until the exit record is there (a killed run never gets one)."""
    deadline = time.monotonic() + wait_finished_s
    while True:
        run = _read_once(offline_run_dir(path))
        if run.finished or time.monotonic() >= deadline:
            return run
        time.sleep(0.2)


def _read_once(directory: pathlib.Path) -> OfflineRun:
    files = sorted(directory.glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"{directory}: expected one run-*.wandb file, found {len(files)}")
    run = OfflineRun(directory, files[0].stem.removeprefix("run-"))
    for record in iter_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            for item in record.run.config.update:
                _set(run.config, item)
        elif kind == "config":
            for item in record.config.update:
                _set(run.config, item)
            for item in record.config.remove:
                keys = list(item.nested_key) or [item.key]
                parent = run.config
                for k in keys[:-1]:
                    parent = parent.get(k, {})
                parent.pop(keys[-1], None)
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                _set(row, item)
            run.history.append(row)
        elif kind == "metric" and record.metric.step_metric:
            run.step_metrics[record.metric.name or record.metric.glob_name] = record.metric.step_metric
        elif kind == "exit":
            run.finished = True
    for row in run.history:
        for name, value in row.items():
            if isinstance(value, dict) and value.get("_type") == "table-file":
                table_file = directory / "files" / value["path"]
                if table_file.exists() or run.finished:  # an unfinished run may not have written it yet
                    run.tables[name] = json.loads(table_file.read_text())
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="run directory, its wandb/ directory, or an offline-run-* directory")
    args = ap.parse_args(argv)
    try:
        run = read_offline_run(args.path)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"offline run {run.run_id} in {run.directory}"
          + ("" if run.finished else " (no exit record: still running, or killed; read up to its last whole record)"))
    print("chosen_plan:", json.dumps(run.config.get("chosen_plan"), indent=1))
    for name, t in run.tables.items():
        print(f"table {name}: {len(t['data'])} rows x {len(t['columns'])} columns ({', '.join(t['columns'])})")
    metrics = [r for r in run.history if any(k.startswith("train/") for k in r)]
    if metrics:
        print("last logged metrics:", json.dumps({k: v for k, v in metrics[-1].items() if not k.startswith("_")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
