"""Import a local Hugging Face LlamaForCausalLM folder as a training checkpoint.

    python -m models.llama.import_hf HF_DIR OUT_DIR

Reads config.json and safetensors weights (model.safetensors, or shards listed in
model.safetensors.index.json; pickled .bin files are refused) from a local folder only, and writes
OUT_DIR as a torch.distributed.checkpoint directory with entries `model.<parameter name>` (full fp32
tensors flattened to 1-D) plus config.yaml (model node under `model`; `data.tokenizer` pointing at
OUT_DIR/tokenizer.model when HF_DIR has a sentencepiece tokenizer), the format export_hf reads.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shutil
import sys
import warnings
from dataclasses import asdict

import torch

from .config import LlamaConfig
from .hf import from_hf_config, from_hf_state_dict

log = logging.getLogger(__name__)
MODEL_PREFIX = "model."


def read_hf_weights(hf_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif any(hf_dir.glob("*.bin")):
        raise ValueError(f"{hf_dir} holds only pickled .bin weights; convert them to safetensors first "
                         "(loading pickles can run arbitrary code)")
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(hf_dir / f)))
    return state


def write_checkpoint(state: dict[str, torch.Tensor], cfg: LlamaConfig, out_dir: pathlib.Path,
                     name: str, tokenizer: str | None) -> None:
    """The checkpoint format export_hf and the trainer read: DCP `model.*` 1-D fp32 + config.yaml."""
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    flat = {MODEL_PREFIX + k: v.detach().to(torch.float32).reshape(-1).contiguous() for k, v in state.items()}
    with warnings.catch_warnings():  # single-process on purpose; the warning only says so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(flat, checkpoint_id=str(out_dir), no_dist=True)
    node = {"model": {"name": name, **asdict(cfg)}}
    if tokenizer:
        node["data"] = {"tokenizer": tokenizer}
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(node)))


def import_hf(hf_dir: str | pathlib.Path, out_dir: str | pathlib.Path) -> pathlib.Path:
    from .export_hf import parameter_shapes

    hf_dir, out_dir = pathlib.Path(hf_dir), pathlib.Path(out_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir} (a local Hugging Face model folder is needed)")
    cfg = from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    state = from_hf_state_dict(read_hf_weights(hf_dir), cfg)
    shapes = parameter_shapes(cfg)
    missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or extra:
        raise ValueError(f"{hf_dir} does not match its config.json: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, shape in shapes.items():
        if state[k].shape != shape:
            raise ValueError(f"{k}: shape {tuple(state[k].shape)} in {hf_dir}, config.json implies {tuple(shape)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if (hf_dir / "tokenizer.model").is_file():
        shutil.copyfile(hf_dir / "tokenizer.model", out_dir / "tokenizer.model")
        tokenizer = str((out_dir / "tokenizer.model").resolve())
    else:
        log.warning("%s has no sentencepiece tokenizer.model: imported without a tokenizer", hf_dir)
    write_checkpoint(state, cfg, out_dir, f"hf_{hf_dir.resolve().name}", tokenizer)
    log.info("imported %d tensors from %s into %s", len(state), hf_dir, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Import a local Hugging Face Llama folder as a training checkpoint.")
    ap.add_argument("hf_dir")
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        import_hf(args.hf_dir, args.out_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
