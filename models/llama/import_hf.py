"""Import a local Hugging Face LlamaForCausalLM folder as a training checkpoint.

    python -m models.llama.import_hf HF_DIR OUT_DIR

Reads config.json and the weights (model.safetensors, pytorch_model.bin, or shards listed in their
index; .bin files through torch's weights-only unpickler) from a local folder only, and writes
OUT_DIR as a torch.distributed.checkpoint directory with entries `model.<parameter name>` (full fp32
tensors flattened to 1-D) plus config.yaml (model node under `model`; `data.tokenizer` pointing at
the copy of HF_DIR's tokenizer.model, else tokenizer.tiktoken, else tokenizer.json, when it has
one), the format export_hf reads.
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
from typing import Any

import torch

from .config import LlamaConfig
from .hf import from_hf_config, from_hf_state_dict

log = logging.getLogger(__name__)
MODEL_PREFIX = "model."


class HFWeightFiles:
    """The tensors of a Hugging Face folder, read one at a time: model.safetensors, shards listed in
    model.safetensors.index.json, or pytorch_model*.bin (with its index). Safetensors files are
    opened lazily; .bin files are memory-mapped through torch's weights-only unpickler, which
    loads tensors and plain containers only (no arbitrary code)."""

    def __init__(self, hf_dir: str | pathlib.Path):
        self.dir = pathlib.Path(hf_dir)
        self.files = self._weight_files()
        self._open: dict[str, Any] = {}
        self.location: dict[str, str] = {}  # HF tensor name -> file
        for f in self.files:
            for name in self._handle(f).keys():
                self.location[name] = f

    def _weight_files(self) -> list[str]:
        for index, single in (("model.safetensors.index.json", "model.safetensors"),
                              ("pytorch_model.bin.index.json", "pytorch_model.bin")):
            if (self.dir / index).is_file():
                return sorted(set(json.loads((self.dir / index).read_text())["weight_map"].values()))
            if (self.dir / single).is_file():
                return [single]
        raise FileNotFoundError(f"no model.safetensors, pytorch_model.bin or their sharded index in {self.dir}")

    def _handle(self, f: str):
        if f not in self._open:
            path = self.dir / f
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in the index of {self.dir} but does not exist")
            if f.endswith(".safetensors"):
                from safetensors import safe_open
                self._open[f] = safe_open(str(path), framework="pt", device="cpu")
            else:
                try:
                    self._open[f] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except Exception as e:  # not a torch zip file, or objects the weights-only unpickler refuses
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise ValueError(f"{path}: cannot read these pickled .bin weights with torch's weights-only "
                                     f"loader ({first}); convert them to safetensors") from None
        return self._open[f]

    def names(self) -> list[str]:
        return list(self.location)

    def get(self, name: str) -> torch.Tensor:
        h = self._handle(self.location[name])
        return h.get_tensor(name) if hasattr(h, "get_tensor") else h[name]


def read_hf_weights(hf_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    files = HFWeightFiles(hf_dir)
    return {name: files.get(name) for name in files.names()}


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
    # The original first: a folder with tokenizer.model or tokenizer.tiktoken (LLaMA-1/2/3, our own
    # exports) made its tokenizer.json from it.
    for name in ("tokenizer.model", "tokenizer.tiktoken", "tokenizer.json"):
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)
            tokenizer = str((out_dir / name).resolve())
            break
    else:
        log.warning("%s has no tokenizer.model, tokenizer.tiktoken or tokenizer.json: imported without a "
                    "tokenizer", hf_dir)
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
        return 2  # an input error (amsp/errors.py): the same command fails the same way
    return 0


if __name__ == "__main__":
    sys.exit(main())
