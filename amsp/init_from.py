"""trainer.init_from: start a fresh run from pretrained weights (logical weights -> this rank's shards).

PATH is a Hugging Face LlamaForCausalLM folder (config.json + safetensors or pytorch_model*.bin,
sharded or not) or a checkpoint of this project (a step_N directory, a `python -m
models.llama.import_hf` output, or a run directory: its newest verified checkpoint). Only the
weights are taken: the optimizer state stays fresh, the run starts at step 0 in its own run
directory. A run directory that already holds a checkpoint resumes from it instead (train.py
decides before calling here), so a preempted and requeued run continues rather than restarting.

Every rank reads the files itself, one parameter at a time, and only the parameters overlapping
its shards (the engine's FlatUnit.fill_shards says which slices): no rank holds more than one unit's
full parameters beyond its own shards, and the values do not depend on the plan or the world size.
A checkpoint's chunks are checked against its checksums as resume checks them; a damaged one is a
fault naming the file (exit 3), never replaced by an older checkpoint here (see _damage_named).
"""
from __future__ import annotations

import json
import logging
import pathlib
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from models.llama.config import LlamaConfig, RopeScaling

from .checkpoint_verify import CheckpointDamaged
from .errors import InputError

log = logging.getLogger(__name__)
MODEL_PREFIX = "model."

# Fields whose difference changes parameter shapes (cannot load) -> the override that sets them.
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_embeddings")
# Fields that change the function but not the shapes: allowed (e.g. a longer context), but said.
NUMERIC_FIELDS = ("norm_eps", "rope_theta", "rope_scaling")


@dataclass
class WeightSource:
    kind: str  # "HF folder" | "checkpoint"
    path: pathlib.Path
    config: LlamaConfig
    names: list[str]  # our parameter names
    read: Callable[[str], torch.Tensor]  # our name -> full tensor in our layout (any float dtype)


# ---- finding what PATH is ----

def _newest_verified_step(path: pathlib.Path) -> pathlib.Path | None:
    from .checkpoint import verified_checkpoints

    for root in (path / "checkpoints", path):
        steps = [p for p in verified_checkpoints(root) if (p / ".metadata").is_file()]
        if steps:
            return steps[0]
    return None


def resolve_source(path: str | pathlib.Path) -> tuple[str, pathlib.Path]:
    """(kind, directory to read) for PATH; InputError saying what PATH is not."""
    path = pathlib.Path(path)
    if not path.exists():
        raise InputError(f"trainer.init_from={str(path)!r} does not exist")
    if not path.is_dir():
        raise InputError(f"trainer.init_from={str(path)!r} is a file: give a Hugging Face model folder or a "
                         f"checkpoint directory (step_N or a run directory)")
    if (path / "config.json").is_file():
        return "HF folder", path
    if (path / ".metadata").is_file():
        return "checkpoint", path
    step = _newest_verified_step(path)
    if step is not None:
        return "checkpoint", step
    raise InputError(f"trainer.init_from={str(path)!r} is neither a Hugging Face model folder (no config.json) nor "
                     f"a checkpoint of this project (no .metadata, no verified checkpoints/step_N)")


def source_problem(path: str) -> str | None:
    """One line saying why PATH cannot be an init_from source, or None (for configs/validate.py)."""
    try:
        resolve_source(path)
    except InputError as e:
        return str(e)
    return None


# ---- reading the logical weights ----

def _hf_source(path: pathlib.Path) -> WeightSource:
    from models.llama.hf import from_hf_config, from_hf_state_dict, hf_name
    from models.llama.import_hf import HFWeightFiles

    try:
        cfg = from_hf_config(json.loads((path / "config.json").read_text()))
        files = HFWeightFiles(path)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise InputError(f"trainer.init_from={str(path)!r}: {e}") from None
    names = list(_parameter_shapes(cfg))
    missing = sorted(hf_name(n) for n in names if hf_name(n) not in files.location)
    if missing:
        raise InputError(f"trainer.init_from={str(path)!r} lacks tensors its config.json implies: {missing[:5]}")

    def read(name: str) -> torch.Tensor:
        theirs = hf_name(name)
        return from_hf_state_dict({theirs: files.get(theirs)}, cfg)[name]  # undoes the rotary permutation

    return WeightSource("HF folder", path, cfg, names, read)


def read_verified(path: pathlib.Path, checksums: dict[str, int] | None, buffers: dict[str, torch.Tensor]) -> None:
    """Fill `buffers` (full entries) from the checkpoint at `path` in this one process, every chunk read
    checked against `checksums` (open_verified's); a damaged file is CheckpointDamaged naming it."""
    import torch.distributed.checkpoint as dcp

    from .checkpoint import damage_as_fault
    from .checkpoint_verify import VerifyingReader

    with warnings.catch_warnings(), damage_as_fault(path):  # no process group on purpose: see the callers
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(buffers, storage_reader=VerifyingReader(str(path), checksums), no_dist=True)


@contextmanager
def _damage_named(path: pathlib.Path):
    # Damage is a fault (exit 3), as on resume; there is no fallback here: ranks read different
    # parts, so one could meet the damage and another not, and they would start from different weights.
    try:
        yield
    except CheckpointDamaged as e:
        raise CheckpointDamaged(f"trainer.init_from={str(path)!r}: {e}; give an intact checkpoint (an older "
                                f"RUN/checkpoints/step_N)") from None


def _checkpoint_source(path: pathlib.Path) -> WeightSource:
    from models.llama.export_hf import read_saved_config

    from .checkpoint import open_verified

    try:
        cfg, _ = read_saved_config(path)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise InputError(f"trainer.init_from={str(path)!r}: {e}") from None
    shapes = _parameter_shapes(cfg)
    # Verified as resume verifies (every chunk read against the manifests; a trainer checkpoint whose
    # meta.json says it was checksummed has them), import_hf's output against its own when it has any.
    with _damage_named(path):
        _, reader, metadata = open_verified(path, require_meta=False)
    stored = metadata.state_dict_metadata
    sizes = {}
    for name, shape in shapes.items():
        size = tuple(getattr(stored.get(MODEL_PREFIX + name), "size", ()))
        if size not in ((shape.numel(),), tuple(shape)):  # format 1 flattened every entry; 2 keeps the shape
            raise InputError(f"trainer.init_from={str(path)!r}: entry {MODEL_PREFIX}{name} has size {size or 'none'}, "
                             f"its config.yaml implies {tuple(shape)}")
        sizes[name] = size

    def read(name: str) -> torch.Tensor:
        buf = {MODEL_PREFIX + name: torch.empty(sizes[name], dtype=torch.float32)}
        with _damage_named(path):  # every rank reads what it needs, without a process group
            read_verified(path, reader.checksums, buf)
        return buf[MODEL_PREFIX + name].view(shapes[name])

    return WeightSource("checkpoint", path, cfg, list(shapes), read)


def _parameter_shapes(cfg: LlamaConfig) -> dict[str, torch.Size]:
    from models.llama.export_hf import parameter_shapes

    return parameter_shapes(cfg)


def open_source(path: str | pathlib.Path) -> WeightSource:
    kind, where = resolve_source(path)
    return _hf_source(where) if kind == "HF folder" else _checkpoint_source(where)


# ---- the model config must match ----

def _override(name: str, src: LlamaConfig) -> str:
    if name == "ffn_hidden_dim":  # derived from these two (an HF source's reproduce intermediate_size exactly)
        mult = "null" if src.ffn_dim_multiplier is None else repr(src.ffn_dim_multiplier)
        return f"model.multiple_of={src.multiple_of} model.ffn_dim_multiplier={mult}"
    value = getattr(src, name)
    if isinstance(value, RopeScaling):  # a dataclass repr is no override: one per sub-field
        return " ".join(f"model.rope_scaling.{k}={v}" for k, v in asdict(value).items())
    return f"model.{name}={str(value).lower() if isinstance(value, bool) else value}"


def model_differences(old: LlamaConfig, new: LlamaConfig) -> tuple[list[str], list[str]]:
    """(SHAPE_FIELDS, NUMERIC_FIELDS) in which `new` differs from `old`; the kernel and recomputation
    choices (attention, norm, fused, activation_checkpointing) compute the same function and are ignored.
    Shared by init_from and resume (data/resume_check.py), so both judge a model change alike."""
    return ([f for f in SHAPE_FIELDS if getattr(old, f) != getattr(new, f)],
            [f for f in NUMERIC_FIELDS if getattr(old, f) != getattr(new, f)])


def describe_change(name: str, old: LlamaConfig, new: LlamaConfig) -> str:
    """'model.NAME old -> new' (rope_scaling: only the sub-fields that differ)."""
    a, b = getattr(old, name), getattr(new, name)
    if isinstance(a, RopeScaling) and isinstance(b, RopeScaling):
        da, db = asdict(a), asdict(b)
        return ", ".join(f"model.rope_scaling.{k} {da[k]} -> {db[k]}" for k in da if da[k] != db[k])
    return f"model.{name} {a} -> {b}"


def check_matches(src: WeightSource, run: LlamaConfig) -> None:
    """Shapes must match (InputError naming each field and its override); other differences are logged."""
    diff = model_differences(src.config, run)[0]
    if diff:
        have = ", ".join(f"{f}={getattr(run, f)} (source {getattr(src.config, f)})" for f in diff)
        raise InputError(f"trainer.init_from={str(src.path)!r}: the run's model differs from the {src.kind}'s in "
                         f"{have}; set {' '.join(_override(f, src.config) for f in diff)} (model= overrides must "
                         f"match the source's shapes)")
    for f in NUMERIC_FIELDS:
        if getattr(src.config, f) != getattr(run, f):
            log.warning("trainer.init_from: model.%s=%s differs from the %s's %s (shapes match: continuing)",
                        f, getattr(run, f), src.kind, getattr(src.config, f))


# ---- filling this rank's shards ----

@torch.no_grad()
def load_into_engine(engine, src: WeightSource) -> int:
    """Overwrite the engine's freshly initialised shards (P shards and separate fp32 masters) with the
    source's weights; returns how many parameters were read by this rank. Optimizer state is untouched
    (zero: nothing has stepped)."""
    if engine.optimizer_steps:
        raise RuntimeError("init_from must run before the first optimizer step")
    cached: dict[str, torch.Tensor] = {}  # this unit's parameters read so far (bf16: P shard, then master)
    reads = 0

    def fill(slot, lo: int, hi: int, out: torch.Tensor) -> None:
        nonlocal reads
        shape = slot.shape if slot.tp is None else slot.tp.global_shape  # a TP shard reads the full tensor
        if slot.name not in cached:
            full = src.read(slot.name)
            if tuple(full.shape) != tuple(shape):
                raise InputError(f"trainer.init_from={str(src.path)!r}: {slot.name} has shape {tuple(full.shape)}, "
                                 f"the model needs {tuple(shape)}")
            cached[slot.name] = full.reshape(-1)
            reads += 1
        if slot.tp is None:
            out.copy_(cached[slot.name][lo:hi])  # rounds to the shard's dtype element by element
            return
        for local, glob, n in slot.tp.global_runs(lo, hi):  # the local shard's elements in the full tensor
            out[local - lo:local - lo + n].copy_(cached[slot.name][glob:glob + n])

    for u in engine.units:
        u.fill_shards(fill)  # p > 1: nothing is gathered before the first forward, so no stale copy remains
        cached.clear()
    return reads


def init_weights_from(engine, path: str | None, run_cfg: LlamaConfig, resumed_from: pathlib.Path | None,
                      rank: int) -> None:
    """train.py's hook, called after the resume decision: nothing without PATH, a log line when the
    run resumes (its checkpoint wins), otherwise the weights of PATH in place of the random init."""
    if not path:
        return
    if resumed_from is not None:
        if rank == 0:
            log.info("trainer.init_from=%s is ignored because the run resumes from %s", path, resumed_from)
        return
    src = open_source(path)
    check_matches(src, run_cfg)
    n = load_into_engine(engine, src)
    if rank == 0:
        log.info("initialised weights from %s %s (%d tensors; rank 0 read %d)", src.kind, src.path, len(src.names), n)
