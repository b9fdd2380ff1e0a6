"""Export a training checkpoint to a Hugging Face LlamaForCausalLM folder.

    python -m models.llama.export_hf CKPT_DIR OUT_DIR [--dtype float32|bfloat16] [--tokenizer TOKENIZER]

CKPT_DIR is a torch.distributed.checkpoint directory (or a run directory / its checkpoints/ folder,
whose `latest` pointer names one) whose entries `model.<parameter name>` hold
full logical fp32 tensors flattened to 1-D, with the run's resolved config.yaml inside it or in its
parent (model node under `model`, the tokenizer path under `data.tokenizer` if any). Only the
model entries are read, in this one process, without a process group, each chunk checked against the
checkpoint's checksums as resume checks it (a damaged checkpoint is one line naming the file, exit 3);
their shapes come from a meta-device model built from the saved config. OUT_DIR receives config.json,
model.safetensors and, when the config names a tokenizer, tokenizer.json + tokenizer_config.json
(models/llama/hf.py write_tokenizer: any tokenizer kind, encoding exactly as training did). All inputs,
OUT_DIR included, are checked before the checkpoint is read, and the files reach OUT_DIR only once all
are written: a failed export leaves OUT_DIR as it was.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
from dataclasses import replace
from typing import Any

import torch

from .hf import llama_config_from_dict, to_hf_config, to_hf_state_dict, write_tokenizer
from .config import LlamaConfig
from .model import Llama

log = logging.getLogger(__name__)
MODEL_PREFIX = "model."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def find_config(ckpt_dir: pathlib.Path) -> pathlib.Path:
    for cand in (ckpt_dir / "config.yaml", ckpt_dir.parent / "config.yaml"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no config.yaml in {ckpt_dir} or its parent: the checkpoint's resolved config is needed")


def read_saved_config(ckpt_dir: pathlib.Path) -> tuple[LlamaConfig, dict[str, Any]]:
    from omegaconf import OmegaConf

    # Resolve only what can be resolved: a saved config is already resolved by the trainer.
    full = OmegaConf.to_container(OmegaConf.load(find_config(ckpt_dir)), resolve=True)
    if not isinstance(full, dict) or not isinstance(full.get("model"), dict):
        raise ValueError(f"{find_config(ckpt_dir)} has no `model` node")
    return llama_config_from_dict(full["model"]), full


def parameter_shapes(cfg: LlamaConfig) -> dict[str, torch.Size]:
    # Kernel choices do not change shapes; pin portable ones so a config saved on a GPU cluster
    # (flash_attn, te) exports on any machine.
    portable = {"attention": "sdpa", "norm": "torch", "fused": "off"}
    cfg = replace(cfg, **{k: v for k, v in portable.items() if k in LlamaConfig.field_names()})
    with torch.device("meta"):
        model = Llama(cfg)
    return {n: p.shape for n, p in model.named_parameters()}


def resolve_checkpoint_dir(path: str | pathlib.Path) -> pathlib.Path:
    """A DCP directory itself, or a run's checkpoints/ directory or run directory (its `latest`)."""
    path = pathlib.Path(path)
    if not path.exists():  # a typo: saying "not a checkpoint directory (no .metadata)" sent users looking inside
        raise FileNotFoundError(f"{path} does not exist")
    if (path / ".metadata").is_file():
        return path
    for root in (path, path / "checkpoints"):
        pointer = root / "latest"
        if pointer.is_file():
            target = root / pointer.read_text().strip()
            if not (target / ".metadata").is_file():
                raise FileNotFoundError(f"{pointer} points at {target}, which is not a complete checkpoint")
            return target
    raise FileNotFoundError(f"{path} is not a torch.distributed.checkpoint directory (no .metadata) and has "
                            "no `latest` pointer")


def load_model_state(ckpt_dir: str | pathlib.Path, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Full-shape fp32 parameters from the checkpoint's `model.*` entries (nothing else is read), each
    chunk checked as resume checks it; a damaged checkpoint is amsp's CheckpointDamaged naming the file."""
    return _load_model_state(ckpt_dir, cfg)[0]


def _load_model_state(ckpt_dir: str | pathlib.Path, cfg: LlamaConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """load_model_state's parameters and the checkpoint's meta.json (the trainer's holds the step; one written
    outside the trainer, by import_hf, has none and gets a stand-in without a step)."""
    # The trainer's checkpoint reading (amsp/checkpoint.py): imported here, not at the top, so models/
    # stays importable without amsp/ (which imports models/); only reading a checkpoint needs it.
    from amsp.checkpoint import open_verified
    from amsp.init_from import read_verified

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    meta, reader, metadata = open_verified(ckpt_dir, require_meta=False)
    entries = metadata.state_dict_metadata
    shapes = parameter_shapes(cfg)
    stored = {k[len(MODEL_PREFIX):]: v for k, v in entries.items() if k.startswith(MODEL_PREFIX)}
    missing, extra = sorted(set(shapes) - set(stored)), sorted(set(stored) - set(shapes))
    if missing or extra:
        raise ValueError(f"checkpoint does not match the saved model config: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    buffers = {}
    for name, shape in shapes.items():
        size = tuple(getattr(stored[name], "size", ()))
        if size not in ((shape.numel(),), tuple(shape)):  # format 1 flattened every entry; 2 keeps the shape
            raise ValueError(f"checkpoint entry model.{name} has size {size}, expected {tuple(shape)} (or flat "
                             f"({shape.numel()},))")
        buffers[MODEL_PREFIX + name] = torch.empty(size, dtype=torch.float32)
    read_verified(ckpt_dir, reader.checksums, buffers)  # one process reads every entry in full
    return {name: buffers[MODEL_PREFIX + name].view(shape) for name, shape in shapes.items()}, meta


def describe_checkpoint(given: str | pathlib.Path, ckpt_dir: pathlib.Path, meta: dict) -> str:
    """Which checkpoint was read, for the export's last line: a run directory resolves through its
    `latest`, so the user sees the step directory and the step it holds, not just the path they typed."""
    step = meta.get("step")
    what = f"step {step}" if isinstance(step, int) else "no step: no meta.json, not written by the trainer"
    if pathlib.Path(given).resolve() != ckpt_dir.resolve():  # found through a pointer beside the step directories
        what += f", named by {ckpt_dir.parent / 'latest'}"
    return f"checkpoint {ckpt_dir} ({what})"


# Every file an export may write: a file of a previous export that this one does not write (its tokenizer,
# when this export has none) is removed, so OUT_DIR never mixes two exports.
EXPORT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "tokenizer.tiktoken")


def prepare_out_dir(out_dir: pathlib.Path) -> pathlib.Path:
    """A new, empty staging folder for the export, made before the checkpoint is read so that an unusable
    OUT_DIR fails in seconds, not after loading every weight. An existing OUT_DIR gets it inside (only
    OUT_DIR need be writable); a new one beside it, renamed to OUT_DIR once complete. OSError otherwise."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"OUT_DIR {out_dir} exists and is not a directory")
    home = out_dir if out_dir.is_dir() else out_dir.parent
    try:
        home.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=home))
    except OSError as e:
        raise OSError(f"cannot write OUT_DIR {out_dir}: making a folder in {home} failed: "
                      f"{e.strerror or e}") from None
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would become the new OUT_DIR's mode
    return staging


def commit_out_dir(staging: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Move the complete export from `staging` into OUT_DIR (whole, by one rename, when OUT_DIR is new)."""
    if staging.parent.resolve() != out_dir.resolve():
        staging.rename(out_dir)
        return
    written = {f.name for f in staging.iterdir()}
    for name in sorted(written, key=lambda n: n == "config.json"):  # config.json last: from_pretrained reads it
        os.replace(staging / name, out_dir / name)
    for name in set(EXPORT_FILES) - written:
        (out_dir / name).unlink(missing_ok=True)
    staging.rmdir()


def export(ckpt_dir: str | pathlib.Path, out_dir: str | pathlib.Path, dtype: str = "float32",
           tokenizer: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write OUT_DIR; `tokenizer` (any kind data/tokenizer.py loads) overrides the saved data.tokenizer.
    Every input is checked, and the tokenizer converted, before the checkpoint is read; the files are
    written to a staging folder and moved into OUT_DIR only when all are written, so a failed export
    leaves OUT_DIR as it was (or absent)."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    given = ckpt_dir
    ckpt_dir, out_dir = resolve_checkpoint_dir(ckpt_dir), pathlib.Path(out_dir)
    cfg, full = read_saved_config(ckpt_dir)
    tok = tokenizer or (full.get("data") or {}).get("tokenizer")
    if tok and not pathlib.Path(tok).exists():
        raise FileNotFoundError(f"tokenizer {tok} does not exist")
    staging = prepare_out_dir(out_dir)
    try:
        special: dict[str, int | None] = {"bos": None, "eos": None}
        if tok:  # converted first: a tokenizer that cannot be exported fails before the slow checkpoint read
            special = write_tokenizer(pathlib.Path(tok), staging, cfg.max_seq_len)
        else:
            log.warning("the saved config names no tokenizer (data.tokenizer) and --tokenizer was not given: "
                        "exported without one")
        state, meta = _load_model_state(ckpt_dir, cfg)
        hf = {k: v.to(DTYPES[dtype]) for k, v in to_hf_state_dict(state, cfg).items()}
        save_file(hf, str(staging / "model.safetensors"), metadata={"format": "pt"})
        hf_cfg = to_hf_config(cfg, dtype, special["bos"], special["eos"])
        (staging / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        commit_out_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful commit
    log.info("exported %d tensors (%s) from %s to %s", len(hf), dtype, describe_checkpoint(given, ckpt_dir, meta),
             out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Export a training checkpoint to a Hugging Face Llama folder.")
    ap.add_argument("ckpt_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                    help="weights dtype (float32 keeps the export lossless)")
    ap.add_argument("--tokenizer", help="tokenizer to ship: .model, tokenizer.json or tiktoken file "
                    "(default: data.tokenizer of the saved config)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from amsp.errors import RunError

    try:
        export(args.ckpt_dir, args.out_dir, args.dtype, args.tokenizer)
    except (OSError, ValueError) as e:  # OSError: a missing input, an OUT_DIR that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2  # an input error (amsp/errors.py): the same command fails the same way
    except RunError as e:  # a damaged checkpoint: one line and amsp/errors.py's code (3), as resume gives
        print(f"{e.kind}: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
