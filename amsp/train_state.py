"""Glue between the engine's per-parameter fragments and the checkpoint files.

Checkpoint keys: `model.<param>` (fp32 master), `optim.exp_avg.<param>`, `optim.exp_avg_sq.<param>`,
all flattened to 1-D; plus `rng.cpu` (and `rng.cuda`). The rest of the training state (step,
optimizer step count, data position, skipped steps, wandb run id, plan, shapes) lives in meta.json.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointManager, Fragment
from .fragments import Fragment as EngineFragment

_KEYS = (("model", "master"), ("optim.exp_avg", "exp_avg"), ("optim.exp_avg_sq", "exp_avg_sq"))


def _as_checkpoint(frag: EngineFragment, tensors: dict[str, torch.Tensor]) -> list[Fragment]:
    return [Fragment(f"{prefix}.{frag.name}", frag.numel, frag.start, tensors[attr], frag.primary)
            for prefix, attr in _KEYS]


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
        shapes[f.name] = list(f.shape)
    meta = {**meta, "optimizer_steps": engine.optimizer_steps, "param_shapes": shapes}
    return mgr.save(step, frags, rng_tensors(), meta, config_yaml, final=final)


def load_training_state(mgr: CheckpointManager, path: Path, engine) -> dict:
    """Collective: fill the engine's shards from `path` (any plan / world size), restore RNG; return meta."""
    own = engine.named_fragments()
    values = {f.name: {attr: torch.empty(f.end - f.start, dtype=torch.float32) for _, attr in _KEYS} for f in own}
    frags = [cf for f in own for cf in _as_checkpoint(f, values[f.name])]
    rng = {k: torch.empty_like(v) for k, v in rng_tensors().items()}
    meta = mgr.load(path, frags, rng)
    engine.load_fragments({name: {k: v.to(engine.device) for k, v in d.items()} for name, d in values.items()},
                          int(meta["optimizer_steps"]))
    torch.set_rng_state(rng["rng.cpu"])
    if "rng.cuda" in rng:
        torch.cuda.set_rng_state(rng["rng.cuda"])
    return meta
