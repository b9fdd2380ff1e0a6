"""Glue between the engine's per-parameter fragments and the checkpoint files.

Checkpoint keys: `model.<param>` (fp32 master), `optim.exp_avg.<param>`, `optim.exp_avg_sq.<param>`,
each the full logical parameter, the same whatever the plan, the data-parallel size, the tensor- or
pipeline-parallel degrees: tensors of two or more dims in their full shape (format 2; format 1
flattened everything to 1-D and is still read), 1-D ones as they are; plus `rng.cpu` (and `rng.cuda`).
The rest of the training state (step, optimizer step count, data position, skipped steps, wandb run id,
plan, shapes) lives in meta.json.

A rank's fragment is a range [start, end) of its flattened (TP-local) parameter. In full-shape layout
it is at most three boxes of the local matrix (the partial first row, the whole rows, the partial last
row), moved along the TP split dim to their place in the full parameter: a handful of checkpoint
chunks per fragment whatever the tensor-parallel degree.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .checkpoint import CheckpointManager, CheckpointMismatch, Fragment
from .fragments import Fragment as EngineFragment

_KEYS = (("model", "master"), ("optim.exp_avg", "exp_avg"), ("optim.exp_avg_sq", "exp_avg_sq"))


def _flat_boxes(f: EngineFragment, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(global flat offset, piece of t) covering the fragment in the flattened full parameter."""
    if f.tp is None:
        return [(f.start, t)]
    return [(glob, t[local - f.start:local - f.start + n]) for local, glob, n in f.tp.global_runs(f.start, f.end)]


def _shaped_boxes(f: EngineFragment, t: torch.Tensor) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """((row, col) corner in the full 2-D parameter, 2-D view of t) boxes covering the fragment."""
    rows, cols = f.shape[0], math.prod(f.shape[1:])
    if len(f.shape) != 2:
        raise ValueError(f"{f.name}: full-shape checkpoint boxes are for 2-D parameters, got {tuple(f.shape)}")
    boxes, pos = [], f.start
    while pos < f.end:
        r, c = divmod(pos, cols)
        if c or f.end - pos < cols:  # a partial row
            n = min(cols - c, f.end - pos)
            boxes.append(((r, c), 1, n))
        else:  # as many whole rows as the range holds
            n = (f.end - pos) // cols * cols
            boxes.append(((r, 0), n // cols, cols))
        pos += n
    out = []
    shift = (0, 0)
    if f.tp is not None and f.tp.shard_dim is not None:
        shift = (rows * f.tp.tp_rank, 0) if f.tp.shard_dim == 0 else (0, cols * f.tp.tp_rank)
    for (r, c), nr, nc in boxes:
        lo = r * cols + c - f.start
        view = t[lo:lo + nr * nc].view(nr, nc)
        out.append(((r + shift[0], c + shift[1]), view))
    return out


def _as_checkpoint(frag: EngineFragment, tensors: dict[str, torch.Tensor],
                   stored: dict[str, tuple] | None = None) -> list[Fragment]:
    """Checkpoint fragments of one engine fragment, in full shape (saving, or a format-2 checkpoint) or
    flattened (a format-1 checkpoint's entries, by `stored`: the checkpoint's entry shapes)."""
    gshape = frag.global_shape
    out = []
    for prefix, attr in _KEYS:
        key = f"{prefix}.{frag.name}"
        flat = len(gshape) == 1 or (stored is not None and len(stored.get(key, gshape)) == 1)
        if flat:
            runs = _flat_boxes(frag, tensors[attr])
            out += [Fragment(key, math.prod(gshape), off, piece, frag.primary) for off, piece in runs]
        else:
            out += [Fragment(key, gshape, corner, piece, frag.primary)
                    for corner, piece in _shaped_boxes(frag, tensors[attr])]
    return out


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["rng.cuda"] = torch.cuda.get_rng_state()
    return out


def save_training_state(mgr: CheckpointManager, engine, step: int, meta: dict, config_yaml: str,
                        final: bool = False) -> Path | None:
    frags = []
    shapes = {}
    for f in engine.named_fragments():
        frags += _as_checkpoint(f, {attr: getattr(f, attr) for _, attr in _KEYS})
        shapes[f.name] = list(f.global_shape)
    meta = {**meta, "optimizer_steps": engine.optimizer_steps, "param_shapes": shapes}
    return mgr.save(step, frags, rng_tensors(), meta, config_yaml, final=final)


def load_training_state(mgr: CheckpointManager, path: Path, engine) -> dict:
    """Collective: fill the engine's shards from `path` (any plan, world size, tp / pp), restore RNG;
    return meta."""
    own = engine.named_fragments()
    values = {f.name: {attr: torch.empty(f.end - f.start, dtype=torch.float32) for _, attr in _KEYS} for f in own}

    def layout(stored: dict[str, tuple]) -> list[Fragment]:
        frags = [cf for f in own for cf in _as_checkpoint(f, values[f.name], stored)]
        split = sorted({f.name for f in own if len(_flat_boxes(f, values[f.name]["master"])) > 1
                        and any(len(stored.get(f"{p}.{f.name}", ())) == 1 for p, _ in _KEYS)})
        if split:  # a flattened entry read by a column-split TP shard: one chunk per row
            raise CheckpointMismatch(f"{path}: format-1 (flattened) entries {split[:3]} cannot be read by a "
                                     f"tensor-parallel shard split across columns; resume it at parallel.tp=1 "
                                     f"once (its next checkpoint is format 2), then at any tp")
        return frags

    rng = {k: torch.empty_like(v) for k, v in rng_tensors().items()}
    meta = mgr.load(path, layout, rng)
    engine.load_fragments({name: {k: v.to(engine.device) for k, v in d.items()} for name, d in values.items()},
                          int(meta["optimizer_steps"]))
    torch.set_rng_state(rng["rng.cpu"])
    if "rng.cuda" in rng:
        torch.cuda.set_rng_state(rng["rng.cuda"])
    return meta
