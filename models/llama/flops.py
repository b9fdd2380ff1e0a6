"""Training FLOPs per token, the convention used for MFU.

6 * N' + 12 * L * H * d * s, with N' = parameters excluding the input embedding (the output
projection counts), L layers, H heads of size d, sequence length s. Attention is counted as full
(no causal halving), as in the PaLM appendix and Megatron's reporting.
"""
from __future__ import annotations

from .config import LlamaConfig


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    n_prime = cfg.num_params(include_embedding=False)
    return 6.0 * n_prime + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
