"""The model.* values, checked with the rest of the config (configs/validate.py) before any state exists.

A shape that cannot build (model.n_heads=3 with dim 64), a zero that divides (model.n_kv_heads=0,
model.multiple_of=0), a negative size, or a rope_theta / norm_eps that makes every step NaN would
otherwise end as a traceback from the model build or, worse, as a run that "finishes" with random
weights. Ranges are checked here; the shape rules (divisibility, even head_dim, the allowed backends)
are the model's own (models/llama/config.py LlamaConfig.__post_init__), called, not copied.
Torch-free: the planner's CLI imports configs/validate.py.
"""
from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

SIZES = ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _range_problems(m: dict) -> list[str]:
    out = [f"model.{k}={m[k]} is not allowed: expected an integer >= 1" for k in SIZES
           if k in m and not (_int(m[k]) and m[k] >= 1)]
    kv = m.get("n_kv_heads")
    if kv is not None and not (_int(kv) and kv >= 1):
        out.append(f"model.n_kv_heads={kv} is not allowed: expected an integer >= 1 (or null: n_heads)")
    for k in ("rope_theta", "norm_eps"):  # 0 or less: NaN from the first step (inf frequencies, 1/sqrt(0))
        if k in m and not _positive(m[k]):
            out.append(f"model.{k}={m[k]} is not allowed: expected a finite number > 0")
    mult = m.get("ffn_dim_multiplier")
    if mult is not None and not _positive(mult):
        out.append(f"model.ffn_dim_multiplier={mult} is not allowed: expected a finite number > 0 (or null)")
    return out


def _shape_problem(model_node) -> str | None:
    """The model's own rules (LlamaConfig.__post_init__); only called once every size is >= 1, since its
    divisibility checks would divide by a zero."""
    from configs.schema import to_llama_config

    try:
        to_llama_config(model_node)
    except (TypeError, ValueError) as e:
        return " ".join(str(e).split())
    return None


def model_problems(cfg: DictConfig) -> list[str]:
    """Every problem with cfg.model, one string each naming the key (empty: it builds)."""
    node = OmegaConf.select(cfg, "model")
    if node is None:
        return []
    m = OmegaConf.to_container(node, resolve=True)
    out = _range_problems(m)
    if not out:
        problem = _shape_problem(node)
        if problem:
            out.append(problem)
    return out
