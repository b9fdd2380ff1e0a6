"""Sharded, reshardable, atomic checkpoints on torch.distributed.checkpoint (DCP).

Layout is logical and parameter-keyed: `model.<name>`, `optim.exp_avg.<name>` and
`optim.exp_avg_sq.<name>` are the full fp32 tensors flattened to 1-D. Each rank writes only the
[offset, offset+len) fragments it owns (its OS shard, primary replica only), and on load asks DCP
for whatever ranges its *current* plan needs, so a checkpoint written under one plan and world
size loads under any other. Small replicated state (RNG) is saved as plain tensors; everything
else (step, data position, plan, wandb id, shapes) goes to meta.json: loading never unpickles
anything but DCP's own metadata, and that through an allow-list.

Atomicity: a save is written to checkpoints/.tmp-step_N, then published by renaming it to
step_N and replacing the `latest` pointer file (both atomic renames). A crash mid-save leaves
the previous checkpoint and pointer untouched; stale temporaries are removed at the next start.

Every collective here is a control value: the barriers and DCP's own object exchanges run on the
control plane (amsp.control, a CPU group), never on the data plane's NCCL group.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from models.llama.dcp_safe import SafeFileSystemReader

from . import control

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"


@dataclass
class Fragment:
    """A contiguous range of one logical tensor (flattened) held by this rank."""

    key: str
    global_numel: int
    offset: int
    tensor: torch.Tensor  # 1-D, length = number of elements held
    primary: bool = True  # only primary replicas write; every holder reads

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.tensor.numel()]))


class _FragmentSavePlanner(DefaultSavePlanner):
    def __init__(self, fragments: list[Fragment]):
        super().__init__()
        self.fragments = {f.key: f for f in fragments if f.primary and f.tensor.numel() > 0}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(f.key, torch.Size([f.offset])), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=f.chunk,
                                                       properties=TensorProperties.create_from_tensor(f.tensor),
                                                       size=torch.Size([f.global_numel])))
                 for f in self.fragments.values()]
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def resolve_data(self, write_item):
        frag = self.fragments.get(write_item.index.fqn)
        if frag is not None:
            return frag.tensor.detach()
        return super().resolve_data(write_item)


class _FragmentLoadPlanner(DefaultLoadPlanner):
    def __init__(self, fragments: list[Fragment]):
        super().__init__()
        self.fragments = {f.key: f for f in fragments if f.tensor.numel() > 0}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = list(plan.items)
        for f in self.fragments.values():
            md = self.metadata.state_dict_metadata[f.key]
            items += create_read_items_for_chunk_list(f.key, md, [f.chunk])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_tensor(self, read_item):
        frag = self.fragments.get(read_item.dest_index.fqn)
        if frag is not None:
            return frag.tensor.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])
        return super().resolve_tensor(read_item)


# ---- the manager ----
def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Save / find / load checkpoints under RUN_DIR/checkpoints with a `latest` pointer."""

    def __init__(self, run_dir: str | Path, keep_last: int = 3, async_save: bool = False):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        # DCP's collectives for a background save run on a CPU group of their own, never interleaving
        # with the main thread's control collectives (the per-step signal check among them).
        self._group = control.new_cpu_group() if async_save else None
        if _is_main():
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(TMP_PREFIX + "*"):
                log.warning("removing incomplete checkpoint %s (a save was interrupted)", stale)
                shutil.rmtree(stale, ignore_errors=True)
        control.barrier()

    # -- discovery --
    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        path = self.root / name
        if not name.startswith(STEP_PREFIX) or not (path / "meta.json").exists():
            raise FileNotFoundError(f"{pointer} points at {name!r}, which is not a complete checkpoint")
        return path

    @staticmethod
    def step_dir_name(step: int) -> str:
        return f"{STEP_PREFIX}{step:08d}"

    # -- saving --
    def save(self, step: int, fragments: list[Fragment], tensors: dict[str, torch.Tensor], meta: dict,
             config_yaml: str) -> Path | None:
        """Collective: every rank calls it. Returns the final path (published now, or when async
        completes); None in a pretend world, where nothing is written."""
        if control.pretend_world():
            # DCP's coordinator needs every rank's plan, and the fake backend brings none.
            log.warning("pretend world: step %d is not checkpointed (the other ranks' shards do not exist)", step)
            return None
        self.wait()
        name = self.step_dir_name(step)
        tmp, final = self.root / (TMP_PREFIX + name), self.root / name
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        control.barrier()
        meta = {**meta, "step": step, "format_version": FORMAT_VERSION}
        if self.async_save:
            # Snapshot now; training may change the live tensors while the thread writes.
            fragments = [dataclasses.replace(f, tensor=f.tensor.detach().clone()) for f in fragments]
            tensors = {k: v.detach().clone() for k, v in tensors.items()}
            self._pending = threading.Thread(target=self._write_and_publish, name=f"ckpt-save-{step}",
                                             args=(step, tmp, final, fragments, tensors, meta, config_yaml),
                                             daemon=False)
            self._pending.start()
        else:
            self._write_and_publish(step, tmp, final, fragments, tensors, meta, config_yaml)
        return final

    def _write_and_publish(self, step, tmp: Path, final: Path, fragments, tensors, meta, config_yaml) -> None:
        try:
            group = self._group if self._group is not None else control.group()
            dcp.save(dict(tensors), storage_writer=dcp.FileSystemWriter(tmp),
                     planner=_FragmentSavePlanner(fragments), process_group=group)
            # dcp.save returns on the coordinator only after every rank's data is written.
            if _is_main():
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
                (tmp / "config.yaml").write_text(config_yaml)
                _fsync_dir(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                pointer_tmp = self.root / ".latest.tmp"
                pointer_tmp.write_text(final.name + "\n")
                os.replace(pointer_tmp, self.root / "latest")
                _fsync_dir(self.root)
                log.info("saved checkpoint step %d to %s", step, final)
                self._prune()
        except BaseException as e:  # surfaced by wait() in the main thread
            self._pending_error = e
            if not self.async_save:
                raise

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        steps = sorted(p for p in self.root.glob(STEP_PREFIX + "*") if p.is_dir())
        for old in steps[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Block until a pending asynchronous save is published; re-raise its error."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise RuntimeError(f"asynchronous checkpoint save failed: {err}") from err

    # -- loading --
    def load(self, path: Path, fragments: list[Fragment], tensors: dict[str, torch.Tensor]) -> dict:
        """Collective. Fills every fragment and tensor in place; returns meta.json."""
        if control.pretend_world():
            raise RuntimeError(f"a pretend world (AMSP_PRETEND_WORLD) cannot load {path}: the fake backend "
                               f"cannot run DCP's exchange between ranks; use a fresh run directory or "
                               f"trainer.resume=false")
        meta_path = path / "meta.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: checkpoint format {meta.get('format_version')} is not the supported "
                             f"format {FORMAT_VERSION}")
        reader = SafeFileSystemReader(path)
        _check_compatible(path, reader.read_metadata(), fragments, tensors)
        dcp.load(tensors, storage_reader=reader, planner=_FragmentLoadPlanner(fragments),
                 process_group=control.group())
        return meta


def _check_compatible(path: Path, metadata, fragments: list[Fragment], tensors: dict[str, torch.Tensor]) -> None:
    # Checked before DCP starts, so a mismatch is one clear line rather than a wrapped traceback.
    stored = metadata.state_dict_metadata
    for f in fragments:
        if f.key not in stored:
            raise KeyError(f"{path}: checkpoint has no entry {f.key!r}; it was written for a different model")
        if tuple(stored[f.key].size) != (f.global_numel,):
            raise ValueError(f"{path}: checkpoint entry {f.key!r} has {tuple(stored[f.key].size)} elements, "
                             f"the model needs ({f.global_numel},); it was written for a different model shape")
    missing = [k for k in tensors if k not in stored]
    if missing:
        raise KeyError(f"{path}: checkpoint lacks {missing}")
