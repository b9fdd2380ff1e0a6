"""The pure LLaMA model: RMSNorm, RoPE, grouped-query attention, SwiGLU, LM head and loss.

No parallelism lives here: data-parallel sharding (amsp/) wraps this model from outside with
module hooks, so the blocks stay plain nn.Modules. Build it under `torch.device("meta")`,
materialise with `to_empty`, then call `init_weights(seed)`.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import fused
from .backends import make_attention, resolve_attention, resolve_norm, rms_norm_reference
from .config import LlamaConfig, RopeScaling
from .init import init_slice_into

IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused  # csrc kernel (models/llama/fused.py) instead of the reference
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused.rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)


def make_rms_norm(choice: str, dim: int, eps: float, fused: bool = False) -> nn.Module:
    if choice == "te":
        import transformer_engine.pytorch as te

        # TE's RMSNorm also names its gain `weight`, so state-dict keys match the torch path.
        return te.RMSNorm(dim, eps=eps)
    return RMSNorm(dim, eps, fused)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None and scaling.factor > 0:
        freqs = _llama3_scale(freqs, scaling)
    return freqs


def _llama3_scale(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # LLaMA-3.1: keep high frequencies, divide low ones by `factor`, blend smoothly between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * freqs / s.factor + smooth * freqs
    out = torch.where(wavelen > low_wavelen, freqs / s.factor, blended)
    return torch.where(wavelen < high_wavelen, freqs, out)


def rope_tables(cfg: LlamaConfig, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) by position * freq_i (Meta's interleaved layout).

    x: (B, S, H, D); cos/sin: (S, D/2).
    """
    if torch.compiler.is_compiling():
        # Inside torch.compile the pairs are rotated in real arithmetic: inductor generates no code for
        # complex tensors (it warns and runs the complex ops as separate ATen kernels), while this form
        # fuses, forward and backward, with the code around it. Same products and sums per element.
        pairs = x.float().unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).type_as(x)
    # Eagerly as a complex product: the select/stack formulation's backward zero-fills full-size gradient
    # buffers and was measured 2.5-20x slower (BENCHMARKS.md, model throughput profile).
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    rot = torch.complex(cos, sin)[None, :, None, :]
    return torch.view_as_real(xc * rot).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: str, fused_rope: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope = fused.apply_rope if fused_rope else apply_rope
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.kernel = make_attention(backend, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the projections' widths (-1), so a wrapper that gives this module a
        # slice of the heads (tensor parallelism, applied from outside) needs no change here.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        out = self.kernel(q, k, v)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, fused_swiglu: bool = False):
        super().__init__()
        self.fused_swiglu = fused_swiglu
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_swiglu:
            return self.w2(fused.swiglu(self.w1(x), self.w3(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# Selective recomputation keeps the outputs of matmuls and attention (expensive to redo) and
# recomputes the cheap elementwise ops (norms, rotary, SiLU), as torchtitan's op-level policy does.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,  # SDPA's first choice on H100 (backends.py)
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, attention: str, norm: str,
                 fused_ops: frozenset[str] = frozenset()):
        super().__init__()
        self.layer_id = layer_id
        fused_norm = "rms_norm" in fused_ops
        self.attention_norm = make_rms_norm(norm, cfg.dim, cfg.norm_eps, fused_norm)
        self.attention = Attention(cfg, attention, "rope" in fused_ops)
        self.ffn_norm = make_rms_norm(norm, cfg.dim, cfg.norm_eps, fused_norm)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim, "swiglu" in fused_ops)
        self.checkpointing = cfg.activation_checkpointing

    def _block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Recomputation happens inside the block's own forward, so hooks registered on the block
        # by a data-parallel wrapper fire once per forward and once per backward, recompute or not.
        if self.checkpointing == "full" and torch.is_grad_enabled():
            return checkpoint(self._block, x, cos, sin, use_reentrant=False)
        if self.checkpointing == "selective" and torch.is_grad_enabled():
            return checkpoint(self._block, x, cos, sin, use_reentrant=False,
                              context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))
        return self._block(x, cos, sin)


class OutputHead(nn.Module):
    """Final RMSNorm and the vocabulary projection: one unit for data-parallel sharding."""

    def __init__(self, cfg: LlamaConfig, norm: str, fused_ops: frozenset[str] = frozenset()):
        super().__init__()
        self.norm = make_rms_norm(norm, cfg.dim, cfg.norm_eps, "rms_norm" in fused_ops)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.fused_loss = "linear_cross_entropy" in fused_ops

    def forward(self, h: torch.Tensor, tied_weight: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean LM loss when targets are given (computed inside this unit so that the
        fused linear + cross-entropy never materialises the logits)."""
        h = self.norm(h)
        if targets is not None and self.fused_loss:
            weight = tied_weight if self.output is None else self.output.weight
            return fused.linear_cross_entropy(h, weight, targets, IGNORE_INDEX)
        if targets is not None:
            return lm_loss(self._project(h, tied_weight), targets)
        return self._project(h, tied_weight)

    def _project(self, h: torch.Tensor, tied_weight: torch.Tensor | None) -> torch.Tensor:
        if self.output is None:
            return F.linear(h, tied_weight)
        return self.output(h)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.attention_backend = resolve_attention(cfg.attention)
        self.norm_backend = resolve_norm(cfg.norm)
        self.fused_ops = fused.resolve_fused(cfg.fused)  # logged once; builds csrc/ on first use
        if self.norm_backend == "te" and "rms_norm" in self.fused_ops:
            # the norms are TE's (make_rms_norm): the log named the fused RMSNorm, which never ran
            self.fused_ops = self.fused_ops - {"rms_norm"}
            fused._log_once("fused ops: rms_norm not used: the norms are Transformer Engine's (model.norm=te)")
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, i, self.attention_backend, self.norm_backend, self.fused_ops)
            for i in range(cfg.n_layers))
        self.head = OutputHead(cfg, self.norm_backend, self.fused_ops)
        # Rotary tables are derived state: recomputed on materialisation, never checkpointed.
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)

    # ---- initialisation ----
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic for a seed: every element's value depends only on (seed, parameter name,
        index) and the config (models/llama/init.py), so a data-parallel wrapper that initialises
        only its slices gets the same values. CPU and CUDA generators give different values."""
        self.init_rope()
        for name, p in self.named_parameters():
            init_slice_into(self.cfg, name, p.shape, 0, p.numel(), seed, p.view(-1))

    @torch.no_grad()
    def init_rope(self) -> None:
        cos, sin = rope_tables(self.cfg, self.cfg.max_seq_len, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    # ---- forward ----
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, S) -> logits (B, S, V), or the mean causal-LM loss when targets are given."""
        s = tokens.shape[1]
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        tied = self.tok_embeddings.weight if self.cfg.tie_embeddings else None
        if targets is not None and self.head.fused_loss:
            return self.head(h, tied, targets)
        logits = self.head(h, tied)
        if targets is None:
            return logits
        return lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose target is not IGNORE_INDEX."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def build_model(cfg: LlamaConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> Llama:
    """Build on the meta device, materialise on `device`, initialise deterministically."""
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device=device)
    model.to(dtype)
    model.rope_cos.data = model.rope_cos.data.float()
    model.rope_sin.data = model.rope_sin.data.float()
    model.init_weights(seed)
    return model
