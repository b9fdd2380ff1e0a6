"""Blending several datasets by weight.

data.blend takes the pairs [[0.7, PREFIX1], [0.3, PREFIX2]], or Megatron-LM's --data-path form: the
flat list [0.7, PREFIX1, 0.3, PREFIX2] or the string "0.7 PREFIX1 0.3 PREFIX2". Weights are
relative (normalised to sum 1). As in Megatron, prefixes alone ("PREFIX1 PREFIX2", or one prefix)
are weighted by their number of tokens (size_weights, once the datasets are open). A prefix may
appear once: twice, both members would draw the same samples in the same order.

Global sample i comes from dataset dataset_index[i], as that dataset's sample
dataset_sample_index[i]; the greedy assignment (build_blending_index) keeps every prefix of the
order within one sample of the requested proportions.
"""
from __future__ import annotations

import logging
import os
import pathlib
from typing import Any, Sequence

import numpy as np

from data import index_builders
from data.cache import cache_key, locked, save_json, save_npy
from data.errors import DataError

log = logging.getLogger(__name__)
_BLEND_VERSION = 1


def _is_number(x: Any) -> bool:
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def _pairs(blend: Any) -> tuple[list, bool]:
    """Megatron's flat forms ("w1 p1 w2 p2" or [w1, p1, w2, p2]) as [[w1, p1], [w2, p2]]; pairs as they
    are. True with the prefixes alone ("p1 p2": no item is a number), to be weighted by size."""
    items = blend.split() if isinstance(blend, str) else (list(blend) if blend is not None else [])
    if not items or not all(isinstance(x, (str, int, float)) for x in items):
        return items, False
    if not any(map(_is_number, items)):
        return items, True
    bad = next((k for k in range(0, len(items), 2) if not _is_number(items[k])), None)
    if bad is not None or len(items) % 2:
        what = f"item {bad + 1} ({items[bad]!r}) stands where a weight belongs" if bad is not None else \
            f"{len(items)} items"
        raise DataError("data.blend", f"{what} in the flat form; give a weight before every prefix "
                                      "\"w1 prefix1 w2 prefix2 ...\" or none \"prefix1 prefix2 ...\" "
                                      "(weighted by their tokens)")
    return [items[k:k + 2] for k in range(0, len(items), 2)], False


def parse_blend(blend: Any) -> list[tuple[float | None, str]]:
    """[[weight, prefix], ...], [w, prefix, w, prefix, ...] or "w prefix w prefix ..." -> [(weight, prefix)],
    with one-line errors naming data.blend. Prefixes alone ("prefix prefix ...") come back with weight
    None: the caller opens the datasets and weights them by tokens (size_weights)."""
    items, by_size = _pairs(blend)
    if by_size:
        return [(None, str(p)) for p in items]
    out = []
    for k, item in enumerate(items):
        if isinstance(item, str) or not hasattr(item, "__len__") or len(item) != 2:
            raise DataError("data.blend", f"entry {k} is {item!r}; expected [weight, prefix]")
        w, prefix = item[0], item[1]
        try:
            w = float(w)
        except (TypeError, ValueError):
            raise DataError("data.blend", f"entry {k}: weight {w!r} is not a number") from None
        if not np.isfinite(w) or w <= 0:
            raise DataError("data.blend", f"entry {k}: weight {w} must be positive")
        out.append((w, str(prefix)))
    if not out:
        raise DataError("data.blend", "is empty; give [[weight, prefix], ...] or \"w1 prefix1 w2 prefix2\"")
    return out


def reject_duplicates(prefixes: Sequence[str]) -> None:
    """A dataset listed twice would be two members drawing the same samples in the same order (same
    data, same seed), not more of it: refuse, naming the prefix (paths compared resolved)."""
    seen: dict[str, str] = {}
    for p in prefixes:
        real = os.path.realpath(p)
        if real in seen:
            same = f" (same as {seen[real]})" if seen[real] != p else ""
            raise DataError("data.blend", f"prefix {p}{same} is listed twice; list it once with the weights "
                                          "added up")
        seen[real] = p


def size_weights(prefixes: Sequence[str], tokens: Sequence[int]) -> list[float]:
    """Megatron's weights for prefixes given without any: each dataset's share of all tokens. Logged,
    since the config does not show them."""
    for p, n in zip(prefixes, tokens):
        if n <= 0:
            raise DataError(f"{p}.idx", "dataset has no tokens, so it cannot be weighted by size")
    total = sum(tokens)
    weights = [n / total for n in tokens]
    log.info("data: data.blend gives no weights; weighted by tokens: %s", ", ".join(
        f"{w:.4f} {p} ({n:,} tokens)" for w, p, n in zip(weights, prefixes, tokens)))
    return weights


def blending_index(weights: Sequence[float], size: int, cache_dir: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for `size` samples, cached on disk."""
    inputs = {"v": _BLEND_VERSION, "weights": [float(w) for w in weights], "size": int(size)}
    d = cache_dir / "blend" / cache_key(inputs)
    with locked(d):
        if not (d / "done.json").exists():
            d.mkdir(parents=True, exist_ok=True)
            di, dsi = index_builders.build_blending_index(np.asarray(weights, dtype=np.float64), size)
            save_npy(d / "dataset_index.npy", di)
            save_npy(d / "dataset_sample_index.npy", dsi)
            save_json(d / "done.json", inputs)
    return np.load(d / "dataset_index.npy", mmap_mode="r"), np.load(d / "dataset_sample_index.npy", mmap_mode="r")


class BlendedDataset:
    def __init__(self, datasets: Sequence, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        self.datasets, self.dataset_index, self.dataset_sample_index = list(datasets), dataset_index, dataset_sample_index
        for d, ds in enumerate(self.datasets):
            need = int(np.count_nonzero(np.asarray(dataset_index) == d))
            if len(ds) < need:
                raise ValueError(f"blended dataset {d} has {len(ds)} samples, the blend needs {need}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self.dataset_index):
            raise IndexError(f"blended sample {i} out of range [0, {len(self.dataset_index)})")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
