"""From the `data` config to the training and validation sample sources.

Everything that can be wrong with the data (missing or corrupt files, a tokenizer that does not
fit the model or does not match the dataset) is found here, before any model state exists.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.blending import BlendedDataset, blending_index, parse_blend, reject_duplicates, size_weights
from data.builtin_corpus import prepare_builtin
from data.cache import resolve_cache_dir
from data.dataset import GPTDataset, sample_split_documents
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, bin_path, idx_path
from data.preprocess import dataset_prefix, read_metadata
from data.tokenizer import Tokenizer, check_fits_model, load_tokenizer

log = logging.getLogger(__name__)
_ENTROPY_MAX_TOKENS = 100_000_000  # per dataset; the estimate is stable long before that


@dataclass
class TrainData:
    tokenizer: Tokenizer
    padded_vocab_size: int
    train: Any  # GPTDataset | BlendedDataset: len() and [global sample index] -> int64 tokens
    valid: Any | None
    unigram_entropy: float  # nats per token over the training split (blend-weighted)
    sources: list = field(default_factory=list)  # [(weight, prefix)]: what a checkpoint records (resume_check)
    # How train/validation were drawn: {"split", "split_seed", "valid_documents": {prefix: n}}
    split: dict = field(default_factory=dict)
    # [(documents, tokens)] of each source, aligned with `sources`: a dataset preprocessed again under the
    # same prefix is other data for a checkpoint's position (resume_check)
    sizes: list = field(default_factory=list)


def _check_matches_tokenizer(ds: IndexedDataset, tok: Tokenizer) -> None:
    meta = read_metadata(ds.prefix)
    if meta is not None:
        if meta.get("tokenizer_sha256") not in (None, tok.fingerprint()):
            raise DataError(f"{ds.prefix}.json", f"dataset was tokenized with {meta.get('tokenizer')} but "
                                                 f"data.tokenizer is {tok.model_file} (different models)")
        max_id = int(meta.get("max_token_id", -1))
    else:
        # Files from other tools carry no tokenizer record: check the ids themselves once.
        max_id = int(ds.tokens().max()) if ds.num_tokens else -1
    if max_id >= tok.vocab_size:
        raise DataError(bin_path(ds.prefix), f"holds token id {max_id} but tokenizer {tok.model_file} has only "
                                             f"{tok.vocab_size} pieces (dataset made with another tokenizer?)")


def _unigram_counts(ds: GPTDataset, vocab: int) -> np.ndarray:
    tokens = ds.leading_tokens(_ENTROPY_MAX_TOKENS)
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab)[:vocab]


def unigram_entropy(datasets: list[GPTDataset], weights: list[float], vocab: int) -> float:
    """Entropy in nats of the blend-weighted unigram distribution of the training tokens."""
    p = np.zeros(vocab, dtype=np.float64)
    for ds, w in zip(datasets, weights):
        c = _unigram_counts(ds, vocab)
        p += w / sum(weights) * c / c.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


BUILTIN_MAX_VOCAB = 32000
_BUILTIN_MIN_VOCAB = 384  # 256 byte pieces + special pieces + the corpus's characters


def builtin_vocab_size(cfg: Any, model_vocab_size: int) -> int:
    """data.builtin.vocab_size, or by default the largest multiple of data.pad_vocab_multiple that
    fits the model (at most 32000), so every preset trains on the built-in corpus as it is."""
    if cfg.builtin.vocab_size:
        return int(cfg.builtin.vocab_size)
    m = max(1, cfg.pad_vocab_multiple)
    v = min(model_vocab_size, BUILTIN_MAX_VOCAB) // m * m
    if v < _BUILTIN_MIN_VOCAB:
        raise DataError("model.vocab_size", f"{model_vocab_size} is too small for a byte-fallback tokenizer on the "
                                            f"built-in corpus (needs >= {_BUILTIN_MIN_VOCAB}); use data.prefix "
                                            "with your own tokenizer")
    return v


def _sources(cfg: Any, model_vocab_size: int) -> tuple[list[tuple[float, str]], str]:
    if cfg.prefix and cfg.blend:
        raise DataError("data.prefix", "set data.prefix or data.blend, not both")
    if cfg.prefix or cfg.blend:
        if not cfg.tokenizer:
            raise DataError("data.tokenizer", "is required with data.prefix / data.blend (the tokenizer given to "
                                              "python -m data.preprocess: .model, tokenizer.json or tiktoken)")
        key = "data.blend" if cfg.blend else "data.prefix"
        specs = parse_blend(cfg.blend) if cfg.blend else [(1.0, str(cfg.prefix))]
        specs = [(w, dataset_prefix(p, key)) for w, p in specs]
        reject_duplicates([p for _, p in specs])
        if specs[0][0] is None:  # Megatron's prefixes without weights: weighted by their tokens
            prefixes = [p for _, p in specs]
            specs = list(zip(size_weights(prefixes, [IndexedDataset(p).num_tokens for p in prefixes]), prefixes))
        return specs, str(cfg.tokenizer)
    if cfg.tokenizer:
        raise DataError("data.tokenizer", "is only used with data.prefix or data.blend; the built-in corpus "
                                          "trains its own")
    b = cfg.builtin
    corpus = prepare_builtin(resolve_cache_dir(cfg.cache_dir), b.max_bytes, builtin_vocab_size(cfg, model_vocab_size),
                             b.workers)
    log.info("data: built-in corpus (%d Python stdlib files, %.1f MB)", corpus.documents, corpus.num_bytes / 1e6)
    return [(1.0, corpus.prefix)], corpus.tokenizer_model


def _build_split(parts: list[tuple[float, IndexedDataset, np.ndarray]], seq_len: int, num_samples: int,
                 seed: int, cache, name: str):
    if len(parts) == 1:
        _, ind, rng = parts[0]
        ds = GPTDataset(ind, rng, seq_len, num_samples, seed, cache, name)
        return ds, [ds]
    di, dsi = blending_index([w for w, _, _ in parts], num_samples, cache)
    counts = np.bincount(np.asarray(di, dtype=np.int64), minlength=len(parts))
    members = [GPTDataset(ind, rng, seq_len, max(1, int(c)), seed, cache, name)
               for (_, ind, rng), c in zip(parts, counts)]
    return BlendedDataset(members, di, dsi), members


def _warn_validation_off(split: list[float], too_small: list[str], held_out: str) -> None:
    """One WARNING (rank 0 only) when the validation split came out empty: validation is off. It is the
    only line about the split then (no INFO line saying "validation = ..." after it), and it names the
    documents the split still holds out of training, which nothing else uses."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if len(split) < 2 or not split[1] > 0:
        why = f"data.split={split} gives the validation split no documents (set a validation share, e.g. [98, 2])"
    else:
        why = (f"too few documents for a validation split with data.split={split}: {', '.join(too_small)} "
               "(each source needs at least 2 documents; add data or raise the validation share)")
    if held_out:
        why += f"; the documents drawn for validation are still left out of training: {held_out}"
    log.warning("validation is off: %s", why)


def _held_token_share(ind: IndexedDataset, doc_ids: np.ndarray) -> float:
    return float(ind.doc_lengths[doc_ids].sum(dtype=np.int64)) / max(1, ind.num_tokens)


def _repeats(ds: GPTDataset) -> tuple[int, int]:
    """(tokens, distinct samples) of a split: the samples that start in its first epoch; any further
    sample starts in a later epoch, over the same documents again."""
    return int(ds.doc_lengths.sum(dtype=np.int64)), int(ds.epoch_bounds[1])


def _warn_unbalanced_data(share: float, valid_tokens: dict[str, float], members: list[GPTDataset],
                          valid_members: list[GPTDataset]) -> None:
    """WARNINGs (rank 0) for splits that are not what data.split suggests: the split is by documents, so
    one long document drawn for validation can take most of a small corpus's tokens; and a split too small
    for its samples is read several times over (the samples repeat): training's, and validation's, whose
    repeated samples make a validation pass look larger than the text it measures."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for prefix, got in valid_tokens.items():
        if got > 2 * share and got > share + 0.01:
            log.warning("data: the validation documents of %s hold %.1f%% of its tokens, against the %.1f%% of "
                        "documents data.split asks for (a few long documents); training keeps %.1f%%", prefix,
                        100 * got, 100 * share, 100 * (1 - got))
    for ds in members:
        if ds.num_epochs > 1:
            log.warning("data: the training split of %s (%d tokens) is read %d times over by the run's %d samples",
                        ds.indexed.prefix, int(ds.doc_lengths.sum(dtype=np.int64)), ds.num_epochs, ds.num_samples)
    for ds in valid_members:
        if ds.num_epochs > 1:
            tokens, distinct = _repeats(ds)
            log.warning("data: the validation split of %s (%d tokens) holds %d distinct samples of %d+1 tokens "
                        "and is read %d times over by its %d samples: a validation pass of more than %d samples "
                        "repeats them (add documents, raise data.split's validation share, or lower "
                        "data.valid_samples and trainer.val_samples)", ds.indexed.prefix, tokens, distinct,
                        ds.seq_len, ds.num_epochs, ds.num_samples, distinct)


def build_data(cfg: Any, *, seq_len: int, seed: int, train_samples: int, model_vocab_size: int) -> TrainData:
    """cfg is the `data` config node; train_samples = steps x global batch."""
    specs, tok_path = _sources(cfg, model_vocab_size)
    tok = load_tokenizer(tok_path)
    padded = check_fits_model(tok, model_vocab_size, cfg.pad_vocab_multiple)
    cache = resolve_cache_dir(cfg.cache_dir)
    # The validation split is a seeded random sample of each dataset's documents (data/dataset.py
    # sample_split_documents), drawn with its own seed so that it stays the same across training seeds.
    split_seed = int(cfg.split_seed)
    train_parts, valid_parts, too_small = [], [], []
    valid_docs: dict[str, int] = {}
    sizes: list[tuple[int, int]] = []
    for w, prefix in specs:
        ind = IndexedDataset(prefix)
        if ind.num_docs == 0:
            raise DataError(idx_path(prefix), "dataset has no documents")
        _check_matches_tokenizer(ind, tok)
        parts = sample_split_documents(ind.num_docs, list(cfg.split), split_seed, idx_path(prefix))
        train_parts.append((w, ind, parts[0]))
        sizes.append((int(ind.num_docs), int(ind.num_tokens)))
        valid_docs[prefix] = len(parts[1]) if len(parts) > 1 else 0
        if valid_docs[prefix]:
            valid_parts.append((w, ind, parts[1]))
        else:
            too_small.append(f"{prefix} ({ind.num_docs} documents)")
    train, members = _build_split(train_parts, seq_len, train_samples, seed, cache, "train")
    valid_tokens = {ind.prefix: _held_token_share(ind, rng) for _, ind, rng in valid_parts}
    held = ", ".join(f"{p}: {n} documents" + (f", {valid_tokens[p]:.2%} of its tokens" if n else "")
                     for p, n in valid_docs.items())
    valid, valid_members = None, []
    if cfg.valid_samples > 0 and len(valid_parts) == len(train_parts):
        valid, valid_members = _build_split(valid_parts, seq_len, cfg.valid_samples, seed, cache, "valid")
    elif cfg.valid_samples > 0:
        _warn_validation_off(list(cfg.split), too_small,
                             ", ".join(f"{p}: {n} documents, {valid_tokens[p]:.2%} of its tokens"
                                       for p, n in valid_docs.items() if n))
        valid_tokens = {}  # their share of the tokens is in that one warning
    entropy = unigram_entropy(members, [w for w, _, _ in train_parts], tok.vocab_size)
    if not math.isfinite(entropy):
        raise DataError("data", "unigram entropy of the training tokens is not finite")
    split = {"split": [float(x) for x in cfg.split], "split_seed": split_seed, "valid_documents": valid_docs}
    share = cfg.split[1] / sum(cfg.split) if len(cfg.split) > 1 else 0.0
    if valid is not None:
        log.info("data: validation = a random %.2f%% of the documents drawn with data.split_seed=%d (%s)",
                 100 * share, split_seed, held)
    elif cfg.valid_samples <= 0 and any(valid_docs.values()):
        # No validation set was asked for, yet data.split still holds these documents out of training.
        log.info("data: no validation set (data.valid_samples=%d); data.split=%s still holds out a random %.2f%% "
                 "of the documents from training, drawn with data.split_seed=%d (%s)", cfg.valid_samples,
                 list(cfg.split), 100 * share, split_seed, held)
    # else: validation is off for lack of documents, said once by _warn_validation_off
    _warn_unbalanced_data(share, valid_tokens, members, valid_members)
    return TrainData(tok, padded, train, valid, entropy, specs, split, sizes)
