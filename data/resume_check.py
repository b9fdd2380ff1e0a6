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

The sample order's seed (data.seed, else trainer.seed) is part of the data: another seed is the same
position in another shuffle, refused unless `data` is allowed.

Two other changes would train on silently with other meaning, so they are refused the same way:

- model: the checkpoint's config.yaml is compared with the run's model before any tensor is read, as
  trainer.init_from compares (amsp/init_from.py). A field that defines the weights' meaning (dim,
  n_layers, n_heads, n_kv_heads, ...) is refused with no override even where the tensors keep their shapes
  (8 heads of 8 read the weights of 4 heads of 16): training on would relabel the weights, and an HF
  export would then mislabel them. rope_theta, norm_eps and rope_scaling change the function, not the
  shapes: refused unless `model` is allowed (one WARNING). Kernel and recomputation choices (attention,
  norm, fused, compile, activation_checkpointing) compute the same function and are never compared.
- schedule: the learning-rate schedule (optim.lr, the floor, optim.warmup_steps and the decay horizon:
  optim.decay_steps, else trainer.max_steps) is rebuilt from the run's config; a longer trainer.max_steps
  used to move the horizon and make the lr jump back up. Refused unless `schedule` is allowed, with one
  WARNING giving the lr at the resume step under the old and the new schedule. To extend a run without a
  jump, keep the old horizon: optim.decay_steps=<old horizon> (the lr stays at its floor past it).

Checkpoints written before a meta key existed are resumed as before for what it records (nothing to
compare; one INFO line says what was not checked).
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from amsp.errors import InputError
from configs.validate import RESUME_CHANGES

log = logging.getLogger(__name__)


def schedule_record(schedule: Any) -> dict:
    """The learning-rate schedule's parameters (amsp.optim.WarmupCosine) as a checkpoint records them."""
    return {"lr": float(schedule.lr), "min_lr": float(schedule.min_lr), "warmup_steps": int(schedule.warmup_steps),
            "decay_steps": int(schedule.decay_steps)}


def run_identity(seq_len: int, data: Any, model_vocab_size: int, data_seed: int | None = None,
                 schedule: Any = None) -> dict:
    """The meta keys a checkpoint records so that a resume can tell what changed."""
    extra = {} if data_seed is None else {"data_seed": int(data_seed)}  # the shuffle of the sample order
    if schedule is not None:
        extra["lr_schedule"] = schedule_record(schedule)
    return {**extra, "seq_len": int(seq_len), "tokenizer_sha256": data.tokenizer.fingerprint(),
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
    if "data_seed" in old and "data_seed" in now and int(old["data_seed"]) != now["data_seed"]:
        seed = f"sample order seed (data.seed, else trainer.seed) {old['data_seed']} -> {now['data_seed']}"
        out["data"] = f"{out['data']}; {seed}" if "data" in out else seed
    return out


_SCHEDULE_NAMES = {"lr": "optim.lr", "min_lr": "the lr floor (optim.min_lr, else optim.lr x optim.min_lr_ratio)",
                   "warmup_steps": "optim.warmup_steps",
                   "decay_steps": "the decay horizon (optim.decay_steps, else trainer.max_steps)"}


def schedule_change(old: dict, now: dict, step: int) -> str | None:
    """'what changed in the lr schedule, old -> new; the lr at `step`, old -> new', or None."""
    was, new = old.get("lr_schedule"), now.get("lr_schedule")
    if not was or not new or was == new:
        return None
    from amsp.optim import WarmupCosine

    what = ", ".join(f"{_SCHEDULE_NAMES[k]} {was.get(k)} -> {new[k]}" for k in new if was.get(k) != new[k])
    lr_old, lr_new = WarmupCosine(**was)(step), WarmupCosine(**new)(step)
    hint = (f"; to extend the run on the old schedule set optim.decay_steps={was['decay_steps']}"
            if was.get("decay_steps") != new["decay_steps"] else "")
    # schedule(step) is the lr of the first resumed step, which the log numbers step + 1
    return (f"learning-rate schedule: {what}; the lr of step {step + 1} (the first resumed) goes from {lr_old:.3g} "
            f"(old schedule) to {lr_new:.3g} (new){hint}")


def schedule_jumps(old: dict, now: dict, step: int) -> bool:
    """Whether the lr of the first resumed step differs between the recorded schedule and the run's. A change
    that does not move it (max_steps extended while the warmup still runs, as a short run's is) bends the
    curve only from here on: said, not refused."""
    was, new = old.get("lr_schedule"), now.get("lr_schedule")
    if not was or not new or was == new:
        return False
    from amsp.optim import WarmupCosine

    return not math.isclose(WarmupCosine(**was)(step), WarmupCosine(**new)(step), rel_tol=1e-9, abs_tol=1e-15)


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


def check_model_before_load(checkpoint: Path | str, run: Any, allowed, is_main: bool = True) -> None:
    """Compare the model of the checkpoint's config.yaml with the run's (`run`: a LlamaConfig) before any
    tensor is read: a field that defines the weights is refused (even where the tensor shapes agree), a
    numeric one unless `model` is allowed (then one WARNING). No readable config.yaml: not compared (INFO)."""
    from amsp.init_from import _override, describe_change, model_differences
    from models.llama.export_hf import read_saved_config

    try:
        saved, _ = read_saved_config(Path(checkpoint))
    except (OSError, ValueError, TypeError, KeyError) as e:
        if is_main:
            log.info("resuming from %s: the model config was not compared with the checkpoint's (%s)", checkpoint, e)
        return
    shapes, numeric = model_differences(saved, run)
    if shapes:
        what = ", ".join(describe_change(f, saved, run) for f in shapes)
        restore = " ".join(_override(f, saved) for f in shapes)
        raise InputError(f"cannot resume from {checkpoint}: {what} since it was written (its weights were trained for "
                         f"its model: training on would give them another meaning, even where the tensor shapes "
                         f"agree). Set {restore}, or start a new run (another trainer.run_name)")
    said = "; ".join(describe_change(f, saved, run) for f in numeric)
    if numeric and "model" not in allowed:
        raise InputError(f"cannot resume from {checkpoint}: {said} since it was written (same shapes, but the "
                         f"trained weights compute another function). Restore it with "
                         f"{' '.join(_override(f, saved) for f in numeric)}, or allow it with "
                         f"trainer.allow_resume_changes=[model]")
    if numeric and is_main:
        log.warning("resuming from %s with a change allowed by trainer.allow_resume_changes: %s", checkpoint, said)


def check_resume(old: dict, now: dict, allowed, checkpoint: Path | str, consumed_samples: int,
                 is_main: bool = True, step: int | None = None) -> int:
    """Raise InputError for changes not named in `allowed`; warn about the allowed ones. Returns the
    consumed-sample count to resume at (converted by tokens when seq_len changed). `step`: the
    checkpoint's step, where the lr schedule is compared (None: the schedule is not compared)."""
    found = changes(old, now)
    refused = {k: v for k, v in found.items() if k not in allowed}
    schedule = schedule_change(old, now, step) if step is not None else None
    if schedule and not schedule_jumps(old, now, step):  # the same lr at the resumed step: no jump to refuse
        if is_main:
            log.info("resuming from %s: %s; no jump at the resumed step, the new schedule applies from here",
                     checkpoint, schedule)
        schedule = None
    if refused or (schedule and "schedule" not in allowed):
        said = ([f"{'; '.join(refused.values())} since it was written (its data position of {consumed_samples} "
                 f"samples means other data now)"] if refused else [])
        names = list(refused)
        if schedule and "schedule" not in allowed:
            said.append(schedule)
            names.append("schedule")
        raise InputError(f"cannot resume from {checkpoint}: {'; '.join(said)}. Restore the old value(s), or allow "
                         f"it with trainer.allow_resume_changes=[{','.join(names)}]")
    if schedule and is_main:
        log.warning("resuming from %s with a change allowed by trainer.allow_resume_changes: %s", checkpoint, schedule)
    if is_main:  # older checkpoints: what they do not record is not compared, and the log says so
        missing = [what for key, what in (("data_seed", "the sample order seed"),
                                          ("lr_schedule", "the learning-rate schedule")) if key not in old]
        if missing and step is not None:
            log.info("resuming from %s: %s not checked (recorded only by checkpoints written since)", checkpoint,
                     " and ".join(missing))
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


__all__ = ["RESUME_CHANGES", "changes", "check_model_before_load", "check_resume", "check_vocab_before_load",
           "run_identity", "schedule_change", "schedule_jumps", "schedule_record"]
