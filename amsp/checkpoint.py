"""Sharded, reshardable, atomic checkpoints on torch.distributed.checkpoint (DCP).

Layout is logical and parameter-keyed: `model.<name>`, `optim.exp_avg.<name>` and
`optim.exp_avg_sq.<name>` are the full fp32 tensors, matrices in their full shape (format 2; format 1
flattened every tensor to 1-D and still loads). Each rank writes only the
[offset, offset+len) fragments it owns (its OS shard, primary replica only), and on load asks DCP
for whatever ranges its *current* plan needs, so a checkpoint written under one plan and world
size loads under any other. Small replicated state (RNG) is saved as plain tensors; everything
else (step, data position, plan, wandb id, shapes) goes to meta.json: loading never unpickles
anything but DCP's own metadata, and that through an allow-list.

Atomicity: a save is written to checkpoints/.tmp-step_N, then published by renaming it to
step_N and replacing the `latest` pointer file (both atomic renames). A crash mid-save leaves
the previous checkpoint and pointer untouched; stale temporaries are removed at the next start.

Verification (amsp/checkpoint_verify.py): every saved chunk carries an xxh3-64 digest in a per-rank
manifest (checksums/__<rank>.json), written, fsynced and read back inside DCP's save, so every rank
agrees before anything is published; rank 0 then writes meta.json, config.yaml and the `verified`
mark (all fsynced) and only then renames. Loading checks every chunk it reads; a damaged checkpoint
(checksum mismatch, truncated or missing file, unreadable metadata) is one line naming the file,
and `load_latest` falls back to the newest verified older checkpoint. Weights holding NaN/Inf are
never written. Pruning keeps the newest verified checkpoint and the one taken before the latest
run of skipped (non-finite) steps. train.py takes a lock (checkpoints/.lock: pid and host) so a
second run in the same directory is refused.

Every collective here is a control value: the barriers and DCP's own object exchanges run on the
control plane (amsp.control, a CPU group), never on the data plane's NCCL group.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from models.llama.dcp_safe import SafeFileSystemReader

from . import control
from .checkpoint_verify import (MANIFEST_DIR, VERIFIED, ChecksumMixin, CheckpointDamaged, CheckpointMismatch,
                                InputError, NonFiniteCheckpoint, RunDirLock, VerifyingReader, VerifyingWriter,
                                all_finite, byte_view, read_manifests, fsync_path, save_failure, unwrap)
from .errors import EXIT_FAULT, FaultError, RunError, disk_full, disk_full_message

log = logging.getLogger(__name__)
# 2: tensors of two or more dims are stored in their full shape (format 1 flattened every tensor to 1-D;
# still read: loaders lay their boxes out as the stored entry is).
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
# The Slurm job that last started this directory's run afresh (SLURM_JOB_ID): its requeue resumes that run.
JOB_RECORD = ".slurm_job"


@dataclass
class Fragment:
    """A box of one logical tensor held by this rank: a contiguous range of a 1-D tensor (global_numel and
    offset ints, tensor 1-D), or of an N-D one (global_numel the full shape, offset the box's corner,
    tensor shaped like the box). A rank may hold several boxes of one tensor (tensor parallelism)."""

    key: str
    global_numel: int | tuple[int, ...]
    offset: int | tuple[int, ...]
    tensor: torch.Tensor
    primary: bool = True  # only primary replicas write; every holder reads

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.global_numel) if isinstance(self.global_numel, (tuple, list)) else (self.global_numel,)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(self.offset) if isinstance(self.offset, (tuple, list)) else (self.offset,)

    @property
    def ident(self) -> tuple[str, tuple[int, ...]]:
        return self.key, self.offsets

    @property
    def chunk(self) -> ChunkStorageMetadata:
        sizes = self.tensor.shape if len(self.shape) > 1 else torch.Size([self.tensor.numel()])
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=sizes)


class _FragmentSavePlanner(ChecksumMixin, DefaultSavePlanner):
    def __init__(self, fragments: list[Fragment], checksums: bool = True):
        super().__init__()
        self.fragments = {f.ident: f for f in fragments if f.primary and f.tensor.numel() > 0}
        self.checksums: dict[str, int] = {}
        self.checksum = checksums

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(f.key, torch.Size(f.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=f.chunk,
                                                       properties=TensorProperties.create_from_tensor(f.tensor),
                                                       size=torch.Size(f.shape)))
                 for f in self.fragments.values()]
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def resolve_data(self, write_item):
        frag = self.fragments.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        data = _own_storage_alias(frag.tensor.detach()) if frag is not None else super().resolve_data(write_item)
        return self._checksum_resolved(write_item, data) if self.checksum else data


def _host_snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory: pinned and copied without blocking for a CUDA tensor (the caller
    synchronises once for all of them), a plain clone for a CPU one."""
    t = t.detach()
    if t.device.type != "cuda":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _own_storage_alias(t: torch.Tensor) -> torch.Tensor:
    """A fragment is a view into an engine's flat buffer. DCP's file writer clones every tensor whose
    storage is larger than itself (so that torch.save writes the view, not the buffer) and keeps each
    written tensor until the rank's file is closed: a save held a second copy of everything the rank
    writes (+859 MiB on a 99M-parameter 1/1/1 rank 0). A CPU view aliased through a buffer of exactly
    its own bytes needs no clone; other tensors (non-contiguous, or off the CPU) are left to DCP."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 \
            or t.untyped_storage().nbytes() == t.nbytes:
        return t
    # The bytes aliased without Tensor.numpy() (checkpoint_verify.byte_view says why); the alias keeps
    # the fragment alive, whose memory it reads.
    alias = torch.frombuffer(byte_view(t), dtype=torch.uint8).view(t.dtype).reshape(t.shape)
    alias._amsp_source = t
    return alias


class _FragmentLoadPlanner(DefaultLoadPlanner):
    def __init__(self, fragments: list[Fragment]):
        super().__init__()
        self.fragments = {f.ident: f for f in fragments if f.tensor.numel() > 0}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = list(plan.items)
        for f in self.fragments.values():
            md = self.metadata.state_dict_metadata[f.key]
            items += create_read_items_for_chunk_list(f.key, md, [f.chunk])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_tensor(self, read_item):
        frag = self.fragments.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ())))
        if frag is not None:
            t = frag.tensor
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(dim, start, length)
            return t
        return super().resolve_tensor(read_item)


# ---- the manager ----
def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# What DCP warns on every save and load made while torch.distributed is not initialised.
_NO_PROCESS_GROUP_WARNING = (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is "
                             r"to (save|load) in a single process")


def _quiet_single_process_dcp() -> None:
    """Before a dcp.save / dcp.load: a single process (train.py initialises torch.distributed only for
    several ranks, amsp/launch.py) saves and loads without a process group on purpose, so DCP's warning
    that it assumes so asks nothing of the user, yet it printed on every checkpoint of every one-process
    run. Only that message is silenced. A filter added for good, not a catch_warnings block: an
    asynchronous save calls DCP from its writer thread, and catch_warnings swaps the process-wide filter
    list, so its exit would drop whatever the main thread had added meanwhile. filterwarnings replaces an
    equal filter, so calling it on every save adds one entry in all."""
    if not dist.is_initialized():  # DCP warns only without a process group
        warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP_WARNING, category=UserWarning)


def verified_checkpoints(root: Path) -> list[Path]:
    """The verified step directories under `root` (a run's checkpoints/), newest first."""
    return sorted((p for p in root.glob(STEP_PREFIX + "*") if (p / VERIFIED).is_file()), reverse=True)


class CheckpointManager:
    """Save / find / load checkpoints under RUN_DIR/checkpoints with a `latest` pointer."""

    def __init__(self, run_dir: str | Path, keep_last: int = 3, async_save: bool = False, lock: bool = False,
                 checksums: bool = True):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.async_save = async_save
        self.checksums = checksums  # False only for measuring their cost (scripts/bench/bench_checkpoint.py)
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._fallback: tuple[list[str], Path] | None = None  # load_latest's deferred set-aside
        self._lock = RunDirLock(self.root) if lock and not control.pretend_world() else None
        # DCP's collectives for a background save run on a CPU group of their own, never interleaving
        # with the main thread's control collectives (the per-step signal check among them).
        self._group = control.new_cpu_group() if async_save else None
        error = None
        if _is_main():
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if self._lock is not None:  # before touching anything a live run may be writing
                    note = self._lock.acquire()
                    if note:
                        log.warning(note)
                    atexit.register(self._lock.release)
                for stale in self.root.glob(TMP_PREFIX + "*"):
                    log.warning("removing incomplete checkpoint %s (a save was interrupted)", stale)
                    shutil.rmtree(stale, ignore_errors=True)
            except OSError as e:  # no permission, a read-only file system, a file where a folder should be
                # A full disk is a fault (free space, requeue), not a command to change.
                error = FaultError(f"cannot write the run directory {self.root.parent}: "
                                   f"{disk_full_message(e, e.filename or self.root)}") if disk_full(e) else \
                    InputError(f"cannot write the run directory {self.root.parent} ({e.strerror or e}): set "
                               f"trainer.output_dir / trainer.run_name to a writable place")
            except RunError as e:
                error = e
        # Every rank leaves with the same outcome and exit code (rank 0's message, one line each).
        failed = control.all_reduce_max_int(error.exit_code if error is not None else 0)
        if error is not None:
            raise error
        if failed:
            raise (FaultError if failed == EXIT_FAULT else InputError)(
                f"rank 0 cannot write the run directory {self.root.parent}")

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()

    # -- discovery --
    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        path = self.root / name
        if not name.startswith(STEP_PREFIX) or not (path / "meta.json").exists():
            raise CheckpointDamaged(f"{pointer} points at {name!r}, which is not a complete checkpoint")
        return path

    def verified(self) -> list[Path]:
        """Verified checkpoints, newest first."""
        return verified_checkpoints(self.root)

    @staticmethod
    def step_dir_name(step: int) -> str:
        return f"{STEP_PREFIX}{step:08d}"

    # -- saving --
    def save(self, step: int, fragments: list[Fragment], tensors: dict[str, torch.Tensor], meta: dict,
             config_yaml: str, final: bool = False) -> Path | None:
        """Collective: every rank calls it. Returns the final path (published now, or when async
        completes); None in a pretend world, where nothing is written, or when the weights hold
        NaN/Inf (a WARNING; for the final save, `final=True`, a NonFiniteCheckpoint)."""
        if control.pretend_world():
            # DCP's coordinator needs every rank's plan, and the fake backend brings none.
            log.warning("pretend world: step %d is not checkpointed (the other ranks' shards do not exist)", step)
            return None
        self.wait()
        bad = next((f.key for f in fragments if f.primary and not all_finite(f.tensor)), None)
        if control.all_reduce_max_int(1 if bad is not None else 0):
            keep = self.latest_name()
            what = f"{bad} holds NaN/Inf" if bad else "a tensor on another rank holds NaN/Inf"
            if final:
                raise NonFiniteCheckpoint(f"checkpoint step {step} not written: {what}; the last checkpoint "
                                          f"{keep or '(none)'} in {self.root} is kept")
            if bad is not None or _is_main():
                log.warning("checkpoint step %d not written: %s; keeping %s", step, what, keep or "(none)")
            return None
        name = self.step_dir_name(step)
        tmp, final_dir = self.root / (TMP_PREFIX + name), self.root / name
        error = None
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                error = save_failure(step, tmp, e)
        if control.all_reduce_max_int(1 if error is not None else 0):
            raise error if error is not None else FaultError(f"checkpoint step {step}: rank 0 could not create {tmp}")
        meta = {**meta, "step": step, "format_version": FORMAT_VERSION, "checksums": self.checksums}
        if self.async_save:
            # Snapshot now; training may change the live tensors while the thread writes. Into host memory
            # (pinned, so a GPU copies at full speed): a copy on the GPU would hold 12 bytes per optimizer-
            # shard parameter there until the write ends, memory the planner does not count.
            on_cuda = any(f.tensor.device.type == "cuda" for f in fragments) or \
                any(v.device.type == "cuda" for v in tensors.values())
            fragments = [dataclasses.replace(f, tensor=_host_snapshot(f.tensor)) for f in fragments]
            tensors = {k: _host_snapshot(v) for k, v in tensors.items()}
            if on_cuda:
                torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
            self._pending = threading.Thread(target=self._write_and_publish, name=f"ckpt-save-{step}",
                                             args=(step, tmp, final_dir, fragments, tensors, meta, config_yaml),
                                             daemon=False)
            self._pending.start()
        else:
            self._write_and_publish(step, tmp, final_dir, fragments, tensors, meta, config_yaml)
            # Every rank leaves a synchronous save with the same outcome (rank 0 alone publishes).
            if control.all_reduce_max_int(1 if self._pending_error is not None else 0):
                err, self._pending_error = self._pending_error, None
                raise err if err is not None else FaultError(
                    f"checkpoint step {step}: rank 0 could not publish {final_dir} (see its message)")
        return final_dir

    def latest_name(self) -> str | None:
        try:
            return (self.root / "latest").read_text().strip() or None
        except OSError:
            return None

    def _write_and_publish(self, step, tmp: Path, final: Path, fragments, tensors, meta, config_yaml) -> None:
        try:
            group = self._group if self._group is not None else control.group()
            planner = _FragmentSavePlanner(fragments, checksums=self.checksums)
            writer = VerifyingWriter(tmp, planner) if self.checksums else dcp.FileSystemWriter(tmp)
            _quiet_single_process_dcp()
            dcp.save(dict(tensors), storage_writer=writer, planner=planner, process_group=group)
            # dcp.save returns on every rank only after every rank's data and manifest are written,
            # synced and read back, and the coordinator found a checksum for every chunk.
            if _is_main():
                for name, text in (("meta.json", json.dumps(meta, indent=1, sort_keys=True)),
                                   ("config.yaml", config_yaml),
                                   (VERIFIED, json.dumps({"step": step, "checksums": self.checksums}) + "\n")):
                    with open(tmp / name, "w") as f:  # `verified` last: it vouches for the rest
                        f.write(text)
                        f.flush()
                        os.fsync(f.fileno())
                fsync_path(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                self._point_latest_at(final.name)
                log.info("saved checkpoint step %d to %s", step, final)
                self._prune()
        except BaseException as e:  # surfaced by wait() in the main thread (or below, synchronously)
            self._pending_error = save_failure(step, tmp, e)
            if _is_main():
                shutil.rmtree(tmp, ignore_errors=True)  # frees the space; `latest` was never touched
            if not self.async_save and self._pending_error is e:
                raise  # not a known failure: keep its traceback

    def _prune(self) -> None:
        """Keep the last `keep_last` checkpoints, plus the newest verified one and the one taken
        before the latest run of skipped (non-finite) steps (meta "skipped_steps" grew after it)."""
        if self.keep_last <= 0:
            return
        steps = sorted(p for p in self.root.glob(STEP_PREFIX + "*") if p.is_dir())
        protected = set(self.verified()[:1])
        latest = self.latest_name()
        if latest:  # what `latest` names is what a resume loads, whatever its step number says
            protected.add(self.root / latest)

        def skips(p: Path):  # (total skipped steps, consecutive skipped steps) when it was saved
            try:
                m = json.loads((p / "meta.json").read_text())
                return int(m.get("skipped_steps", 0)), int(m.get("consecutive_skips", 0))
            except (OSError, ValueError, TypeError, AttributeError):
                return None

        counts = [skips(p) for p in steps]
        # The newest checkpoint saved outside a run of skips (consecutive 0) after which skips happened.
        for i in range(len(steps) - 2, -1, -1):
            if counts[i] is not None and counts[i + 1] is not None and counts[i][1] == 0 \
                    and counts[i + 1][0] > counts[i][0]:
                protected.add(steps[i])
                break
        for old in steps[:-self.keep_last]:
            if old in protected:
                log.info("keeping %s past keep_last_checkpoints=%d (%s)", old.name, self.keep_last,
                         "the newest verified checkpoint" if old in self.verified()[:1]
                         else "the last one before a run of skipped steps")
                continue
            shutil.rmtree(old, ignore_errors=True)

    def set_aside_all(self, why: str) -> Path | None:
        """Move every checkpoint and the `latest` pointer into checkpoints/superseded-<UTC time>/ (kept, not
        deleted): a run that starts over in a directory holding another run's checkpoints (trainer.resume=
        false) must not mix with them (pruning by step number deleted the new run's checkpoints as the
        oldest, and a fallback could load the old run's). Collective; returns the folder (rank 0) or None."""
        import time as _time

        dest = None
        if _is_main():
            old = [p for p in self.root.glob(STEP_PREFIX + "*") if p.is_dir()]
            pointer = self.root / "latest"
            if old or pointer.exists():
                stamp, k = f"superseded-{_time.strftime('%Y%m%dT%H%M%SZ', _time.gmtime())}", 1
                dest = self.root / stamp
                while dest.exists():  # two fresh starts within a second
                    k += 1
                    dest = self.root / f"{stamp}.{k}"
                dest.mkdir(parents=True)
                for p in old + ([pointer] if pointer.exists() else []):
                    os.replace(p, dest / p.name)
                fsync_path(self.root)
                log.warning("%s: moved the run directory's %d checkpoint(s) to %s (kept; delete them when no "
                            "longer needed)", why, len(old), dest)
        control.barrier()
        return dest

    def requeue_of_recorded_job(self) -> bool:
        """Collective. True when this process is a Slurm requeue (SLURM_RESTART_COUNT > 0) of the job that
        last started this directory's run afresh (record_job): that job's command, trainer.resume=false
        included, is run again on every requeue, and starting over each time threw its own progress away."""
        found = 0
        job, restart = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
        if _is_main() and job and restart.isdigit() and int(restart) > 0:
            try:
                found = int((self.root / JOB_RECORD).read_text().strip() == job)
            except OSError:  # no record (a run before this file existed, or never under Slurm): start over
                found = 0
            if found:
                log.info("trainer.resume=false, but this is requeue %s of Slurm job %s, which started the run in "
                         "%s: resuming it instead of starting over", restart, job, self.root.parent)
        return bool(control.all_reduce_max_int(found))

    def record_job(self) -> None:
        """Rank 0, at a fresh start: note the Slurm job (if any) that starts this run (requeue_of_recorded_job)."""
        job = os.environ.get("SLURM_JOB_ID")
        if not _is_main():
            return
        path = self.root / JOB_RECORD
        if not job:
            path.unlink(missing_ok=True)  # a run outside Slurm: no job's requeue may claim it
            return
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(job + "\n")
        os.replace(tmp, path)

    def wait(self) -> None:
        """Block until a pending asynchronous save is published; re-raise its error."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            if isinstance(err, RunError):
                raise err
            raise RuntimeError(f"asynchronous checkpoint save failed: {err}") from err

    # -- loading --
    def load(self, path: Path, fragments, tensors: dict[str, torch.Tensor]) -> dict:
        """Collective. Fills every fragment and tensor in place; returns meta.json. A damaged
        checkpoint is a CheckpointDamaged naming the file (on every rank). `fragments`: a list, or a
        function of the stored entries' shapes ({key: shape}) returning it, for callers whose boxes
        depend on how the checkpoint laid a tensor out (flattened by format 1, full shape since 2)."""
        if control.pretend_world():
            raise RuntimeError(f"a pretend world (AMSP_PRETEND_WORLD) cannot load {path}: the fake backend "
                               f"cannot run DCP's exchange between ranks; use a fresh run directory or "
                               f"trainer.resume=false")
        error, meta, reader = None, None, None
        try:
            meta, reader, metadata = open_verified(path)
            if callable(fragments):
                fragments = fragments({k: tuple(getattr(v, "size", ()))
                                       for k, v in metadata.state_dict_metadata.items()})
            _check_compatible(path, metadata, fragments, tensors)
        except RunError as e:
            error = e
        # Agree before DCP starts: a rank that stopped here would leave the others in its exchange.
        if control.all_reduce_max_int(1 if error is not None else 0):
            raise error if error is not None else CheckpointDamaged(f"{path}: another rank could not read it")
        _check_nothing_left_out(path, metadata, fragments)
        _quiet_single_process_dcp()
        with damage_as_fault(path):
            dcp.load(tensors, storage_reader=reader, planner=_FragmentLoadPlanner(fragments),
                     process_group=control.group())
        return meta

    def _point_latest_at(self, name: str) -> None:
        """Replace `latest` atomically, its content on disk before the rename (unsynced, a crash could
        leave the renamed pointer empty or garbled) and the rename on disk after."""
        pointer_tmp = self.root / ".latest.tmp"
        with open(pointer_tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer_tmp, self.root / "latest")
        fsync_path(self.root)

    def load_latest(self, load_fn, defer_set_aside: bool = False) -> tuple[Path, dict] | None:
        """Collective. Load the checkpoint `latest` names with load_fn(path) -> meta; when it is
        damaged or missing, fall back to the newest verified older one (a WARNING naming both). None
        when there is no checkpoint; FaultError when none is usable. defer_set_aside: the damaged ones are
        renamed and `latest` moved only by finish_fallback(), once the caller's checks accept the resume
        (a refused resume leaves the run directory as it was)."""
        pointer = self.root / "latest"
        name, verified = self.latest_name(), self.verified()
        if name is None:
            if not verified:
                return None  # a fresh run directory
            queue, reason = verified, f"{pointer} is missing"
        elif not (name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit()):
            # garbled (a crash between writing the pointer and its rename reaching the disk): no step to
            # compare with, so every verified checkpoint is a candidate, newest first
            queue, reason = verified, f"{pointer} holds {name[:40]!r}, not a checkpoint name"
        else:
            first, older = self.root / name, [p for p in verified if p.name < name]
            if first.is_dir():
                queue, reason = [first] + older, None
            else:
                queue, reason = older, f"{pointer} names {name}, which does not exist"
        tried: list[str] = []
        for path in queue:
            if reason is not None:
                log.warning("%s; falling back to the newest verified checkpoint %s", reason, path.name)
            try:
                meta = load_fn(path)
            except CheckpointDamaged as e:
                reason = f"checkpoint {path.name} is damaged: {e}"
                tried.append(path.name)
                continue
            if path.name != name:
                self._fallback = (tried, path)
                if not defer_set_aside:
                    self.finish_fallback()
            return path, meta
        raise FaultError(f"no usable checkpoint in {self.root}: {reason}; no older verified checkpoint to fall "
                         f"back to (start afresh with trainer.resume=false or another trainer.run_name)")

    def finish_fallback(self) -> None:
        """Collective: the renames and the `latest` move of a fallback that load_latest deferred (none: nothing)."""
        fallback, self._fallback = self._fallback, None
        if fallback is not None:
            self._set_aside(*fallback)

    def _set_aside(self, damaged: list[str], good: Path) -> None:
        """Rename damaged checkpoints out of the way (kept for inspection, never pruned into the
        good ones' place) and point `latest` at the one loaded."""
        if _is_main():
            for n in damaged:
                src = self.root / n
                if src.exists():
                    dst, k = self.root / f"damaged-{n}", 1
                    while dst.exists():  # the same step damaged again after a rewrite: keep both for inspection
                        k += 1
                        dst = self.root / f"damaged-{n}.{k}"
                    os.replace(src, dst)
                    log.warning("moved damaged checkpoint %s to %s", src, dst)
            self._point_latest_at(good.name)
        control.barrier()


def open_verified(path: Path, require_meta: bool = True) -> tuple[dict, VerifyingReader, Metadata]:
    """(meta.json, a reader that checks every chunk it reads, DCP's metadata) of the checkpoint at `path`;
    CheckpointDamaged naming the file that is missing or unreadable. require_meta=False also opens a
    checkpoint written outside the trainer (import_hf's: no meta.json, no `verified` mark), checked
    against checksums/ when it has one (trainer.init_from and export_hf read either kind)."""
    if require_meta or (path / "meta.json").exists() or (path / VERIFIED).exists():
        meta = _read_meta(path)
    else:
        meta = {"checksums": (path / MANIFEST_DIR).exists()}
    checksums = read_manifests(path) if meta.get("checksums") else None
    if checksums is not None and not checksums:
        raise CheckpointDamaged(f"{path}/{MANIFEST_DIR}: missing (meta.json says the save was checksummed)")
    reader = VerifyingReader(path, checksums)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path}/.metadata: file missing") from None
    except Exception as e:
        raise CheckpointDamaged(f"{path}/.metadata: unreadable ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return meta, reader, metadata


@contextmanager
def damage_as_fault(path: Path):
    """Around a dcp.load from `path`: a damaged chunk (on any rank) or a file that cannot be read is
    a CheckpointDamaged naming it, not DCP's wrapped traceback; anything else propagates."""
    try:
        yield
    except BaseException as e:  # noqa: B902 - DCP wraps every rank's failure in a BaseException
        damaged = unwrap(e, CheckpointDamaged)
        if damaged is not None:
            raise CheckpointDamaged(str(damaged)) from None
        os_err = unwrap(e, OSError)
        if isinstance(os_err, OSError):
            raise CheckpointDamaged(f"{os_err.filename or path}: {os_err.strerror or os_err}") from None
        raise


def _read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if not path.is_dir():
        raise CheckpointDamaged(f"{path}: checkpoint directory missing")
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise CheckpointDamaged(f"{meta_path}: file missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"{meta_path}: unreadable ({type(e).__name__}: {e})") from None
    version = meta.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version not in READABLE_FORMATS:
        # Written by another version of this code, not damaged: no fallback to an older checkpoint (which
        # would throw away the newer one's steps and set it aside as damaged).
        which = "a newer" if version > max(READABLE_FORMATS) else "an older"
        raise CheckpointMismatch(f"{meta_path}: checkpoint format {version} is not one this code reads "
                                 f"{READABLE_FORMATS}; it was written by {which} version of this code: run that one")
    if version not in READABLE_FORMATS:
        raise CheckpointDamaged(f"{meta_path}: checkpoint format {version!r} is not one of the supported formats "
                                f"{READABLE_FORMATS}")
    return meta


def _check_compatible(path: Path, metadata, fragments: list[Fragment], tensors: dict[str, torch.Tensor]) -> None:
    # Checked before DCP starts, so a mismatch is one clear line rather than a wrapped traceback.
    stored = metadata.state_dict_metadata
    for f in fragments:
        if f.key not in stored:
            raise CheckpointMismatch(f"{path}: checkpoint has no entry {f.key!r}; it was written for a different "
                                     f"model")
        if tuple(stored[f.key].size) != f.shape:
            raise CheckpointMismatch(f"{path}: checkpoint entry {f.key!r} has shape {tuple(stored[f.key].size)}, "
                                     f"the model needs {f.shape}; it was written for a different model shape")
    missing = [k for k in tensors if k not in stored]
    if missing:
        raise CheckpointMismatch(f"{path}: checkpoint lacks {missing}; it was written by a different setup")


def _check_nothing_left_out(path: Path, metadata, fragments: list[Fragment]) -> None:
    """Collective. The checkpoint's model entries no rank's model takes: with fewer layers (model.n_layers=1
    on a 2-layer checkpoint) the run would load the first ones, drop the rest and go on as if resumed.
    Under pipeline parallelism each rank holds its stage's parameters only, so the model is the union."""
    taken = set().union(*control.all_gather_object(sorted({f.key for f in fragments})))
    extra = sorted(k for k in metadata.state_dict_metadata if k.startswith("model.") and k not in taken)
    if extra:  # model.* only: rng.cuda, say, is in a GPU run's checkpoint and a CPU resume may skip it
        raise CheckpointMismatch(f"{path}: checkpoint has {len(extra)} entries the model lacks ({extra[0]!r}"
                                 f"{', ...' if len(extra) > 1 else ''}); it was written for a different model")
