"""LLaMA model shapes: the config dataclass and the published presets.

The config knows shapes only; runtime choices (kernel backends, recomputation) are plain
fields with defaults so that one object describes a model completely.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Optional


@dataclass
class RopeScaling:
    """LLaMA-3.1 style frequency scaling of rotary embeddings (zero factor = disabled)."""

    factor: float = 0.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class LlamaConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None = multi-head attention (n_kv_heads = n_heads)
    vocab_size: int = 8192
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # Kernel backends and recomputation (runtime choices, not shapes).
    attention: str = "auto"  # auto | flash_attn | te | sdpa
    norm: str = "auto"  # auto | te | torch
    activation_checkpointing: str = "none"  # none | full | selective
    # csrc/ fused CPU ops (RMSNorm, RoPE, SwiGLU, linear+cross-entropy): auto enables those that
    # won in BENCHMARKS.md, on all of them (error if the extension cannot build), off none.
    fused: str = "auto"  # auto | on | off

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        problems = []
        if self.dim % self.n_heads:
            problems.append(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            problems.append(f"head_dim={self.dim // self.n_heads} (model.dim / model.n_heads) must be even for "
                            f"rotary embeddings")
        for name, allowed in (
            ("attention", ("auto", "flash_attn", "te", "sdpa")),
            ("norm", ("auto", "te", "torch")),
            ("activation_checkpointing", ("none", "full", "selective")),
            ("fused", ("auto", "on", "off")),
        ):
            if getattr(self, name) not in allowed:
                problems.append(f"model.{name}={getattr(self, name)!r} is not one of {'|'.join(allowed)}")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # Meta's rule: 2/3 of 4*dim, optionally scaled, rounded up to multiple_of.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    # ---- parameter counts (used by presets tests, FLOPs and the planner) ----
    def block_params(self) -> int:
        hd = self.head_dim
        attn = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2
        mlp = 3 * self.dim * self.ffn_hidden_dim
        return attn + mlp + 2 * self.dim  # two RMSNorm weights

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied to the embedding)."""
        return self.dim + (0 if self.tie_embeddings else self.vocab_size * self.dim)

    def num_params(self, include_embedding: bool = True) -> int:
        n = self.n_layers * self.block_params() + self.head_params()
        if include_embedding:
            n += self.embedding_params()
        elif self.tie_embeddings:
            # The tied matrix still does the output projection's FLOPs.
            n += self.embedding_params()
        return n

    def with_overrides(self, **kw) -> "LlamaConfig":
        return replace(self, **kw)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


_L3_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)

PRESETS: dict[str, LlamaConfig] = {
    # Shapes that train in seconds on a CPU.
    "debug": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                         multiple_of=32, max_seq_len=256),
    "tiny": LlamaConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=8192,
                        multiple_of=256, max_seq_len=1024),
    # LLaMA-1 (Touvron et al. 2023a).
    "llama1_7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, norm_eps=1e-6),
    "llama1_13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, norm_eps=1e-6),
    "llama1_30b": LlamaConfig(dim=6656, n_layers=60, n_heads=52, vocab_size=32000, norm_eps=1e-6),
    "llama1_65b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, vocab_size=32000, norm_eps=1e-6),
    # LLaMA-2 (Touvron et al. 2023b): 4k context, GQA on 70B.
    "llama2_7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096),
    "llama2_13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, max_seq_len=4096),
    "llama2_70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                              multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=4096),
    # LLaMA-3: 128k vocabulary, GQA everywhere, theta 500k.
    "llama3_8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                             multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                             max_seq_len=8192),
    "llama3_70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                              multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                              max_seq_len=8192),
    # LLaMA-3.1: same shapes with rotary frequency scaling for 128k context.
    "llama3_1_8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                               multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                               rope_scaling=_L3_SCALING, max_seq_len=131072),
}


def get_preset(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name])
