"""Resuming only what fits: the checkpoint records what its data position means, and a resume that
changes it is refused unless the change is named in trainer.allow_resume_changes.

A checkpoint's data position is a count of consumed samples. That count means something only for
the same sample stream: the same data.seq_len (samples of seq_len + 1 tokens), the same tokenizer
(file content hash) and the same data sources (prefix or blend, weights included, and each source's
document and token counts: the same prefix preprocessed again is other data). Resuming with any
of them changed used to continue silently at a shifted position. Now:

- without an override: InputError (exit 2) naming each change, old -> new, and the override;
- with trainer.allow_resume_changes=[seq_len|tokenizer|data]: one WARNING per change, and the data
  position is handled as follows:
    seq_len   the consumed samples are converted by tokens: new = old * old_seq_len // new_seq_len,
              so the run continues after as many training tokens as it had consumed. The new
              seq_len has its own shuffled sample order, so the continuation is a fresh pass from
              that point: some documents may be seen again or skipped (unavoidable: the old samples
              do not exist at the new length).
    tokenizer the consumed sample count is kept (the token stream is different; the count keeps the
    data      run at the same fraction of its planned samples); likewise for a changed blend/prefix.
- model.vocab_size differing from the checkpoint's can never be resumed (the embedding and output
  layers have another shape), so it is refused before any tensor is read, with no override.

Checkpoints written before these meta keys existed are resumed as before (nothing to compare).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from amsp.errors import InputError
from configs.validate import RESUME_CHANGES

log = logging.getLogger(__name__)


def run_identity(seq_len: int, data: Any, model_vocab_size: int) -> dict:
    """The meta keys a checkpoint records so that a resume can tell what changed."""
    return {"seq_len": int(seq_len), "tokenizer_sha256": data.tokenizer.fingerprint(),
            "tokenizer_file": data.tokenizer.model_file, "tokenizer_vocab_size": int(data.tokenizer.vocab_size),
            "model_vocab_size": int(model_vocab_size),
            "data_sources": [[float(w), os.path.abspath(p)] for w, p in data.sources],
            "data_sizes": [[int(d), int(t)] for d, t in data.sizes],
            # Which documents are held out for validation decides the training stream too.
            "data_split": {"split": [float(x) for x in data.split.get("split", [])],
                           "split_seed": data.split.get("split_seed")}}


def _blend(sources) -> str:
    return "[" + ", ".join(f"[{w:g}, {p}]" for w, p in sources) + "]"


def changes(old: dict, now: dict) -> dict[str, str]:
    """{change name: 'what changed, old -> new'} for the keys both sides record."""
    out: dict[str, str] = {}
    if "seq_len" in old and old["seq_len"] != now["seq_len"]:
        out["seq_len"] = f"data.seq_len {old['seq_len']} -> {now['seq_len']}"
    if "tokenizer_sha256" in old and old["tokenizer_sha256"] != now["tokenizer_sha256"]:
        pieces = (f", {old.get('tokenizer_vocab_size')} -> {now['tokenizer_vocab_size']} pieces"
                  if old.get("tokenizer_vocab_size") != now["tokenizer_vocab_size"] else "")
        out["tokenizer"] = (f"tokenizer {old.get('tokenizer_file')} (sha256 {old['tokenizer_sha256'][:12]}) -> "
                            f"{now['tokenizer_file']} (sha256 {now['tokenizer_sha256'][:12]}){pieces}")
    if "data_sources" in old and [[float(w), p] for w, p in old["data_sources"]] != now["data_sources"]:
        out["data"] = f"data sources {_blend(old['data_sources'])} -> {_blend(now['data_sources'])}"
    elif "data_sources" in old:
        data = [_contents_change(old, now)] if old.get("data_sizes", now["data_sizes"]) != now["data_sizes"] else []
        if old.get("data_split") != now["data_split"]:
            # Checkpoints written before data.split_seed held out the last documents of each dataset.
            was = (f"data.split {old['data_split']['split']} with data.split_seed={old['data_split']['split_seed']}"
                   if "data_split" in old else "the last documents of each dataset held out (before data.split_seed)")
            data.append(f"validation split {was} -> data.split {now['data_split']['split']} with "
                        f"data.split_seed={now['data_split']['split_seed']}")
        if data:
            out["data"] = "; ".join(data)
    return out


def _contents_change(old: dict, now: dict) -> str:
    """The sources whose document or token count changed under the same prefix (preprocessed again)."""
    moved = [f"{p}: {od} documents, {ot} tokens -> {nd} documents, {nt} tokens"
             for (_, p), (od, ot), (nd, nt) in zip(now["data_sources"], old["data_sizes"], now["data_sizes"])
             if (od, ot) != (nd, nt)]
    return "data contents under the same prefix " + "; ".join(moved)


def check_vocab_before_load(checkpoint: Path, model_vocab_size: int) -> None:
    """Refuse, before any tensor is read, a checkpoint written for another model.vocab_size (it cannot
    load: the embedding and output layers have another shape). A meta.json that cannot be read is left
    to the checkpoint loader to report."""
    try:
        old = json.loads((Path(checkpoint) / "meta.json").read_text()).get("model_vocab_size")
    except (OSError, ValueError, AttributeError):
        return
    if old is not None and int(old) != int(model_vocab_size):
        raise InputError(f"cannot resume from {checkpoint}: model.vocab_size {old} -> {model_vocab_size}; the "
                         f"embedding and output layers were trained at {old} rows and cannot load at another size. "
                         f"Set model.vocab_size={old}, or start a new run (another trainer.run_name)")


def check_resume(old: dict, now: dict, allowed, checkpoint: Path | str, consumed_samples: int,
                 is_main: bool = True) -> int:
    """Raise InputError for changes not named in `allowed`; warn about the allowed ones. Returns the
    consumed-sample count to resume at (converted by tokens when seq_len changed)."""
    found = changes(old, now)
    refused = {k: v for k, v in found.items() if k not in allowed}
    if refused:
        names = ",".join(refused)
        raise InputError(f"cannot resume from {checkpoint}: {'; '.join(refused.values())} since it was written "
                         f"(its data position of {consumed_samples} samples means other data now). Restore the "
                         f"old value(s), or allow it with trainer.allow_resume_changes=[{names}]")
    consumed = int(consumed_samples)
    if "seq_len" in found:
        consumed = consumed * int(old["seq_len"]) // int(now["seq_len"])
    for k, what in found.items():
        how = (f"data position converted by tokens: {consumed_samples} samples of {old['seq_len']} tokens -> "
               f"{consumed} samples of {now['seq_len']}" if k == "seq_len"
               else f"data position kept at {consumed} samples of the new stream")
        if is_main:
            log.warning("resuming from %s with a change allowed by trainer.allow_resume_changes: %s (%s)",
                        checkpoint, what, how)
    return consumed


__all__ = ["RESUME_CHANGES", "changes", "check_resume", "check_vocab_before_load", "run_identity"]
