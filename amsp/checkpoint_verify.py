"""Verified checkpoints: a checksum per saved tensor chunk, checked when it is read back.

Saving: the planner computes an xxh3-64 digest (`digest`) of the bytes of every chunk the writer asks it for
(`resolve_data`, i.e. exactly what goes into the file); after its files are written and fsynced,
each rank writes RUN/checkpoints/step_N/checksums/__<rank>.json (chunk -> digest, file -> size),
fsyncs it, reads it back and checks it against what it wrote and the sizes on disk. The
coordinator's `finish` checks that every chunk of every rank has a checksum before DCP's .metadata
is written. A failure anywhere is raised inside DCP's own collective, so every rank sees it and
nothing is published; the manager writes the `verified` mark only after all of this returned.

Loading: the reader reads each stored chunk whole (as DCP does), checks it is all there, that
torch can decode it and that its digest matches, and only then copies the requested range out. A
problem is a CheckpointDamaged naming the file and what is wrong with it.
"""
from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import socket
import time
from torch.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed._shard._utils import narrow_tensor_by_index

from models.llama.dcp_safe import SafeFileSystemReader

from .errors import FaultError, InputError, disk_full, disk_full_message
from .pid import pid_alive

MANIFEST_DIR = "checksums"
VERIFIED = "verified"


class CheckpointDamaged(FaultError):
    """A checkpoint file is missing, truncated, unreadable or fails its checksum."""


class CheckpointMismatch(InputError, ValueError):
    """The checkpoint was written for another model or setup (no fallback: all would mismatch)."""


class NonFiniteCheckpoint(FaultError):
    """The weights to be saved hold NaN or Inf (raised for the final save only)."""


class RunDirInUse(InputError):
    """Another live run holds the run directory's lock."""


def digest_bytes(buf) -> int:
    """xxh3-64 of a bytes-like object. A checksum on every save must stay a small part of writing
    it: xxh3 hashes at ~10 GB/s here, zlib.crc32 at ~2-3.5 GB/s, which added 22% to a save to
    tmpfs (scripts/bench/bench_checkpoint.py). Any flipped bit changes it; it is no defence against
    a deliberate forgery, which is not what it is for."""
    return xxhash.xxh3_64_intdigest(buf)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a memoryview of its memory, valid while `t` lives.
    Not through Tensor.numpy(), which marks the tensor's storage non-resizable for good: the engine
    resizes its flat buffers' storages (AMSPEngine.release gives a switched-away engine's memory back),
    and a checkpoint's save or checksum would have pinned every one it touched."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_uint8 * n).from_address(t.data_ptr())).cast("B")


def digest(t: torch.Tensor) -> int:
    """digest_bytes of a CPU tensor's bytes (made contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return 0
    return digest_bytes(byte_view(t))


def chunk_key(fqn: str, offsets) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in (offsets or ()))}"


def all_finite(t: torch.Tensor) -> bool:
    """True when a float tensor holds no NaN/Inf. A plain sum is the fast screen (NaN and Inf
    propagate); only a non-finite sum (or an overflow) pays for the exact element-wise check."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if torch.isfinite(t.sum()).item():
        return True
    return bool(torch.isfinite(t).all().item())


class ChecksumMixin:
    """For a SavePlanner: record the digest of everything resolve_data hands to the writer."""

    def _checksum_resolved(self, write_item, data):
        if write_item.type == WriteItemType.BYTE_IO:
            crc = digest_bytes(data.getbuffer()) if isinstance(data, io.BytesIO) else None
        else:
            if data.device.type != "cpu":
                data = data.cpu()  # the writer would copy it anyway; it now gets this copy
            crc = digest(data)
        if crc is not None:
            self.checksums[chunk_key(write_item.index.fqn, write_item.index.offset)] = crc
        return data


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _write_json_synced(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


class VerifyingWriter(dcp.FileSystemWriter):
    """FileSystemWriter that leaves a per-rank checksum manifest next to its files, read back."""

    def __init__(self, path, planner):
        super().__init__(path)
        self.root = Path(path)
        self.planner = planner

    def write_data(self, plan, planner):
        results = super().write_data(plan, planner).wait()  # completed: the file writer is synchronous
        files: dict[str, int] = {}
        for r in results:
            info = r.storage_data
            files[info.relative_path] = max(files.get(info.relative_path, 0), info.offset + info.length)
        missing = [chunk_key(r.index.fqn, r.index.offset) for r in results
                   if chunk_key(r.index.fqn, r.index.offset) not in self.planner.checksums]
        if missing:
            raise CheckpointDamaged(f"{self.root}: no checksum was computed for {missing[:3]}")
        manifest = {"rank": _rank(), "files": files,
                    "checksums": {chunk_key(r.index.fqn, r.index.offset):
                                  self.planner.checksums[chunk_key(r.index.fqn, r.index.offset)] for r in results}}
        mdir = self.root / MANIFEST_DIR
        mdir.mkdir(exist_ok=True)
        path = mdir / f"__{_rank()}.json"
        _write_json_synced(path, manifest)
        # Read back what is on disk: the manifest itself, and every file at least as long as written.
        if json.loads(path.read_text()) != manifest:
            raise CheckpointDamaged(f"{path}: the checksum manifest read back differs from what was written")
        for name, size in files.items():
            have = os.path.getsize(self.root / name)
            if have < size:
                raise CheckpointDamaged(f"{self.root / name}: {have} bytes on disk after the write, {size} written")
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results) -> None:
        have = read_manifests(self.root)
        missing = [chunk_key(r.index.fqn, r.index.offset) for rs in results for r in rs
                   if chunk_key(r.index.fqn, r.index.offset) not in have]
        if missing:
            raise CheckpointDamaged(f"{self.root}/{MANIFEST_DIR}: no checksum for {len(missing)} chunk(s), first "
                                    f"{missing[0]}; a rank's manifest is missing")
        super().finish(metadata, results)
        fsync_path(self.root / MANIFEST_DIR)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename or a new entry is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifests(root: Path) -> dict[str, int]:
    """chunk key -> digest over every rank's manifest; a damaged manifest is CheckpointDamaged."""
    out: dict[str, int] = {}
    mdir = root / MANIFEST_DIR
    for p in sorted(mdir.glob("__*.json")) if mdir.is_dir() else []:
        try:
            out.update({k: int(v) for k, v in json.loads(p.read_text())["checksums"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointDamaged(f"{p}: unreadable checksum manifest ({type(e).__name__}: {e})") from None
    return out


class VerifyingReader(SafeFileSystemReader):
    """Reads whole stored chunks, checks length, decoding and digest, then copies the range asked for."""

    def __init__(self, path, checksums: dict[str, int] | None):
        super().__init__(path)
        self.root = Path(path)
        self.checksums = checksums  # None: a checkpoint written before checksums (not verified)

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, reqs in per_file.items():
            path = self.root / rel
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                raise CheckpointDamaged(f"{path}: file missing") from None
            except OSError as e:
                raise CheckpointDamaged(f"{path}: cannot be opened ({e.strerror})") from None
            with f:
                size = os.fstat(f.fileno()).st_size
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    where = f"{req.storage_index.fqn} (bytes {info.offset}..{info.offset + info.length})"
                    if info.offset + info.length > size:
                        raise CheckpointDamaged(f"{path}: truncated, {size} bytes on disk but {where} needs "
                                                f"{info.offset + info.length} (a torn write)")
                    f.seek(info.offset)
                    raw = f.read(info.length)
                    key = chunk_key(req.storage_index.fqn, req.storage_index.offset)
                    if req.type == LoadItemType.BYTE_IO:
                        self._check(path, where, key, digest_bytes(raw))
                        planner.load_bytes(req, io.BytesIO(raw))
                        continue
                    try:
                        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                    except Exception as e:
                        raise CheckpointDamaged(f"{path}: {where} cannot be decoded ({type(e).__name__})") from None
                    self._check(path, where, key, digest(tensor))
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise CheckpointDamaged(f"{path}: {where} has shape {tuple(tensor.size())}, expected "
                                                f"{tuple(target.size())}")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _check(self, path: Path, where: str, key: str, crc: int) -> None:
        if self.checksums is None:
            return
        want = self.checksums.get(key)
        if want is None:
            raise CheckpointDamaged(f"{path}: no checksum recorded for {where} ({self.root / MANIFEST_DIR} "
                                    f"is incomplete)")
        if want != crc:
            raise CheckpointDamaged(f"{path}: checksum mismatch in {where} (stored {want:#010x}, read {crc:#010x}): "
                                    f"the file changed after it was written")


def unwrap(exc: BaseException, kind: type) -> BaseException | None:
    """The first `kind` inside exc: itself, its cause/context chain, or a DCP CheckpointException's
    per-rank failures."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for _, wrapped in sorted(failures.items()):
                todo.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
        todo += [e.__cause__, e.__context__]
    return None


def save_failure(step: int, tmp: Path, exc: BaseException) -> BaseException:
    """The one-line error for a failed save (disk full, I/O error); None-like passthrough otherwise."""
    known = unwrap(exc, (CheckpointDamaged, NonFiniteCheckpoint))
    if known is not None:
        return FaultError(f"checkpoint step {step}: {known}")
    os_err = unwrap(exc, OSError)
    if isinstance(os_err, OSError):
        where = os_err.filename or tmp
        if disk_full(os_err):  # a quota (EDQUOT) too: both are a fault, as everywhere else (amsp/errors.py)
            return FaultError(f"checkpoint step {step}: {disk_full_message(os_err, where)}")
        if os_err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return InputError(f"checkpoint step {step}: cannot write {where}: {os_err.strerror}; make the run "
                              f"directory writable or set trainer.output_dir")
        return FaultError(f"checkpoint step {step}: {os_err.strerror or os_err} ({where})")
    return exc


# ---- one run per run directory ----
class RunDirLock:
    """RUN/checkpoints/.lock holding "pid host [slurm job id, restart count]"; a second live run is
    refused. A lock is stale and taken over when its pid is dead on this host, or when it was written
    by an earlier incarnation of this Slurm job (same SLURM_JOB_ID, another SLURM_RESTART_COUNT): a
    requeued job starts on whichever node Slurm gives it, where the old pid cannot be checked, and a
    killed run (time limit, OOM, node failure, a fault exit through os._exit) never removed its lock,
    so the requeue was refused with exit 2 and the job stopped for good."""

    TRIES = 50  # takeovers and waits for a lock being written (0.1 s each) before giving up
    UNWRITTEN_S = 2.0  # an empty lock older than this was never going to be written

    def __init__(self, root: Path):
        self.path = root / ".lock"
        self.held = False

    @staticmethod
    def _me() -> str:
        job, restart = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
        return f"{os.getpid()} {socket.gethostname()}" + (f" slurm:{job}:{restart}" if job else "")

    @staticmethod
    def _earlier_incarnation(holder_job: str) -> bool:
        """The holder is this Slurm job before a requeue."""
        job, restart = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
        parts = holder_job.split(":")
        return bool(job) and len(parts) == 3 and parts[0] == "slurm" and parts[1] == job and parts[2] != restart

    def acquire(self) -> str | None:
        """None when taken; otherwise a warning about a stale lock taken over (returned as text)."""
        me = self._me()
        note = None
        for _ in range(self.TRIES):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = self.path.read_text().strip()
                    age = time.time() - self.path.stat().st_mtime
                except FileNotFoundError:
                    continue
                pid_s, host, job = (holder.split(" ") + ["", ""])[:3]
                if holder == me:
                    self.held = True
                    return note
                if not (pid_s.isdigit() and host):  # empty or garbled: being written, or its writer died
                    if age < self.UNWRITTEN_S:  # another run's create-then-write, a moment apart
                        time.sleep(0.1)
                        continue
                    note = (f"removing unreadable lock {self.path} ({holder[:60]!r}, {age:.0f} s old): its writer "
                            f"died between creating and writing it")
                    self.path.unlink(missing_ok=True)
                    continue
                if host == socket.gethostname() and pid_s.isdigit() and not pid_alive(int(pid_s)):
                    note = f"removing stale lock {self.path} of pid {pid_s} on {host} (that process is gone)"
                    self.path.unlink(missing_ok=True)
                    continue
                if self._earlier_incarnation(job):
                    note = (f"removing stale lock {self.path} of pid {pid_s} on {host}: written by this Slurm "
                            f"job before its requeue ({job})")
                    self.path.unlink(missing_ok=True)
                    continue
                raise RunDirInUse(f"run directory {self.path.parent.parent} is in use by pid {pid_s} on host "
                                  f"{host or '?'} (lock {self.path}); wait for that run to end, use another "
                                  f"trainer.run_name, or delete the lock if that process is gone")
            except PermissionError as e:
                raise InputError(f"cannot write the run directory {self.path.parent.parent} ({e.strerror}); "
                                 f"set trainer.output_dir to a writable directory") from None
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(me + "\n")
            except OSError:
                # Left empty (a full disk), the lock would read to the next run as one whose writer died.
                self.path.unlink(missing_ok=True)
                raise
            self.held = True
            _HELD.add(self)
            return note
        raise RunDirInUse(f"could not take the lock {self.path}; another run is starting in the same directory")

    def release(self) -> None:
        if self.held:
            try:
                if self.path.read_text().strip() == self._me():
                    self.path.unlink()
            except OSError:
                pass
            self.held = False
            _HELD.discard(self)


_HELD: set = set()  # the locks this process holds, for release_held_locks


def release_held_locks() -> None:
    """Remove this process's run-directory locks: the fault exits call it before os._exit, which runs no
    cleanup (a lock left behind refuses the next launch into the run directory on any other host)."""
    for lock in list(_HELD):
        lock.release()
