"""Conversion between this model and Hugging Face's LlamaForCausalLM layout.

Names: ours follow Meta's reference (tok_embeddings, layers.N.attention.wq, feed_forward.w1/w2/w3,
attention_norm, ffn_norm) plus the output-head unit (head.norm, head.output); HF's follow
LlamaForCausalLM (model.embed_tokens, model.layers.N.self_attn.q_proj, mlp.gate_proj/down_proj/up_proj,
input_layernorm, post_attention_layernorm, model.norm, lm_head).

Rotary convention: our apply_rope rotates interleaved pairs (x[2i], x[2i+1]) like Meta's code; HF
rotates the two halves of each head (rotate_half). Both are the same function of q and k once the
rows of wq and wk are permuted within each head: interleaved row 2i+j (j in {0,1}) becomes half-
split row j*head_dim/2 + i. That is the `permute` of transformers' convert_llama_weights_to_hf.py,
applied on export and inverted on import. Attention scores q.k are invariant under the same
permutation of q and k, so wv and wo are not touched.

Nothing here reads or writes files except the tokenizer helpers; the CLIs are export_hf/import_hf.
"""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any, Mapping

import torch

from .config import LlamaConfig, RopeScaling

# Per-layer names: ours -> HF (both without the "layers.N." / "model.layers.N." prefix).
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "head.norm.weight": "model.norm.weight",
    "head.output.weight": "lm_head.weight",
}


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute the rows of a q/k projection from Meta's interleaved rotary pairs to HF's halves."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of interleaved_to_halves."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_name(name: str) -> str:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_MAP:
        return f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def our_name(name: str) -> str:
    for ours, theirs in _TOP_MAP.items():
        if name == theirs:
            return ours
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for ours, theirs in _LAYER_MAP.items():
            if parts[3] == theirs:
                return f"layers.{parts[2]}.{ours}"
    raise KeyError(f"unsupported Hugging Face Llama tensor {name!r}")


def to_hf_state_dict(state: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our parameter dict (full tensors) -> HF LlamaForCausalLM tensors (contiguous, same dtype)."""
    out = {}
    for name, t in state.items():
        if name.endswith("attention.wq.weight"):
            t = interleaved_to_halves(t, cfg.n_heads)
        elif name.endswith("attention.wk.weight"):
            t = interleaved_to_halves(t, cfg.n_kv_heads)
        out[hf_name(name)] = t.contiguous()
    if cfg.tie_embeddings and "lm_head.weight" in out:
        raise ValueError("tied embeddings but the state has an output projection (head.output.weight)")
    return out


def from_hf_state_dict(state: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM tensors -> our parameter dict. Rotary caches are skipped (derived state);
    a tied model's lm_head, when a writer stored it anyway, must equal the embedding."""
    out = {}
    for name, t in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and cfg.tie_embeddings:
            if not torch.equal(t, state["model.embed_tokens.weight"]):
                raise ValueError("tie_word_embeddings is true but lm_head.weight differs from the embedding")
            continue
        ours = our_name(name)
        if ours.endswith("attention.wq.weight"):
            t = halves_to_interleaved(t, cfg.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = halves_to_interleaved(t, cfg.n_kv_heads)
        out[ours] = t.contiguous()
    return out


# ---- config.json ----

def to_hf_config(cfg: LlamaConfig, torch_dtype: str = "float32", bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict[str, Any]:
    s = cfg.rope_scaling
    rope_scaling = None
    if s is not None and s.factor > 0:
        rope_scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": torch_dtype,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }


def _rope_from_hf(d: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`.
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    if kind == "llama3":
        return theta, RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    raise ValueError(f"unsupported rope scaling type {kind!r}: this model implements default and llama3")


def from_hf_config(d: Mapping[str, Any]) -> LlamaConfig:
    """config.json of a LlamaForCausalLM -> LlamaConfig, refusing features this model lacks."""
    if d.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type={d.get('model_type')!r}: only Llama checkpoints are supported")
    problems = [f"{k}={d[k]!r}" for k, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
                if k in d and d[k] != ok]
    dim, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    if d.get("head_dim") not in (None, dim // heads):
        problems.append(f"head_dim={d['head_dim']} (this model needs hidden_size/num_attention_heads={dim // heads})")
    if problems:
        raise ValueError("unsupported Llama variant: " + ", ".join(problems))
    theta, scaling = _rope_from_hf(d)
    inter = int(d["intermediate_size"])
    hidden = int(2 * 4 * dim / 3)
    # Our FFN width is derived (multiple_of, ffn_dim_multiplier); pick values that reproduce it exactly.
    multiplier = None if inter >= hidden else inter / hidden
    cfg = LlamaConfig(dim=dim, n_layers=int(d["num_hidden_layers"]), n_heads=heads,
                      n_kv_heads=int(d.get("num_key_value_heads") or heads), vocab_size=int(d["vocab_size"]),
                      multiple_of=inter, ffn_dim_multiplier=multiplier, norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                      rope_theta=theta, rope_scaling=scaling,
                      max_seq_len=int(d.get("max_position_embeddings", 2048)),
                      tie_embeddings=bool(d.get("tie_word_embeddings", False)))
    if cfg.ffn_hidden_dim != inter:
        raise ValueError(f"cannot express intermediate_size={inter} with dim={dim}")
    return cfg


def llama_config_from_dict(d: Mapping[str, Any]) -> LlamaConfig:
    """A saved `model` config node (plain dict, extra keys such as `name` ignored) -> LlamaConfig."""
    d = dict(d)
    d["rope_scaling"] = RopeScaling(**(d.get("rope_scaling") or {}))
    return LlamaConfig(**{k: v for k, v in d.items() if k in LlamaConfig.field_names()})


# ---- tokenizer ----

_ADDS_TOKENS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def _without_added_tokens(processor: dict | None) -> dict | None:
    """A tokenizer.json post-processor minus the steps that add tokens (BOS/EOS templates): training
    saw documents as their ids then EOS (data/tok_base.py), so the exported tokenizer adds nothing."""
    if processor is None or processor.get("type") in _ADDS_TOKENS:
        return None
    if processor.get("type") == "Sequence":
        kept = [p for p in processor["processors"] if p.get("type") not in _ADDS_TOKENS]
        return {**processor, "processors": kept} if kept else None
    return processor


def write_tokenizer(tokenizer: str | pathlib.Path, out_dir: str | pathlib.Path, max_len: int) -> dict[str, int | None]:
    """Write the training tokenizer (any kind data/tokenizer.py loads) as tokenizer.json +
    tokenizer_config.json for transformers' AutoTokenizer, encoding text exactly as training did: no
    BOS or EOS added (add_bos_token/add_eos_token false), special-token spellings in text are ordinary
    text (split_special_tokens). A sentencepiece or tiktoken file is shipped beside it under its
    run-directory name (tokenizer.model / tokenizer.tiktoken). Returns the special ids for config.json."""
    from data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tokenizer))
    out_dir = pathlib.Path(out_dir)
    doc = json.loads(tok.hf_tokenizer().to_str())
    doc["post_processor"] = _without_added_tokens(doc.get("post_processor"))
    doc["truncation"] = doc["padding"] = None
    (out_dir / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    if tok.kind != "hf":  # the original file too, for import_hf and other tools
        shutil.copyfile(tok.model_file, out_dir / tok.copy_name)
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "unk": tok.unk_id, "pad": tok.pad_id}
    names = {k: _token_spelling(doc, i) for k, i in ids.items()}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
           "add_bos_token": False, "add_eos_token": False, "split_special_tokens": True,
           "clean_up_tokenization_spaces": False, "training_tokenizer_kind": tok.kind}
    cfg.update({f"{k}_token": name for k, name in names.items() if name is not None})
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special = {f"{k}_token": name for k, name in names.items() if name is not None}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")
    return {k: (i if i is not None and i >= 0 else None) for k, i in ids.items()}


def _token_spelling(doc: Mapping[str, Any], i: int | None) -> str | None:
    """The spelling of token id i in a tokenizer.json (added tokens or the model's vocabulary)."""
    if i is None or i < 0:
        return None
    for t in doc.get("added_tokens", []):
        if t["id"] == i:
            return t["content"]
    vocab = doc["model"].get("vocab")
    if isinstance(vocab, dict):
        return next((k for k, v in vocab.items() if v == i), None)
    return None
