"""Kernel backends for attention and RMSNorm.

`auto` picks flash-attn, then Transformer Engine, on CUDA when importable, and PyTorch's
scaled_dot_product_attention everywhere else. The choice is made once per model and logged
once per process, so a run's log always says which kernels it used.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def _log_once(kind: str, choice: str, why: str) -> None:
    if (kind, choice) not in _logged:
        _logged.add((kind, choice))
        log.info("%s backend: %s (%s)", kind, choice, why)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and _importable("flash_attn")


def te_available() -> bool:
    return torch.cuda.is_available() and _importable("transformer_engine")


def resolve_attention(requested: str) -> str:
    if requested == "auto":
        if flash_attn_available():
            choice, why = "flash_attn", "auto: CUDA and flash_attn importable"
        elif te_available():
            choice, why = "te", "auto: CUDA and transformer_engine importable"
        else:
            choice, why = "sdpa", "auto: no CUDA kernel library available" if not torch.cuda.is_available() \
                else "auto: neither flash_attn nor transformer_engine importable"
    else:
        choice, why = requested, "requested"
        if choice == "flash_attn" and not flash_attn_available():
            raise RuntimeError("model.attention=flash_attn needs CUDA and the flash_attn package "
                               "(pip install -e '.[gpu]'); use model.attention=sdpa on CPU")
        if choice == "te" and not te_available():
            raise RuntimeError("model.attention=te needs CUDA and transformer_engine "
                               "(pip install -e '.[gpu]'); use model.attention=sdpa on CPU")
    _log_once("attention", choice, why)
    return choice


def resolve_norm(requested: str) -> str:
    if requested == "auto":
        choice, why = ("te", "auto: CUDA and transformer_engine importable") if te_available() \
            else ("torch", "auto: transformer_engine not usable here")
    else:
        choice, why = requested, "requested"
        if choice == "te" and not te_available():
            raise RuntimeError("model.norm=te needs CUDA and transformer_engine; use model.norm=torch")
    _log_once("rmsnorm", choice, why)
    return choice


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, S, Hkv * n_rep, D): each KV head serves n_rep consecutive query heads."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


# An attention kernel maps q (B,S,H,D), k/v (B,S,Hkv,D) to (B,S,H,D), causal.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n_rep = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True)
    return out.transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # flash_attn_func takes (batch, seqlen, nheads, headdim) and handles GQA natively when
    # nheads_k divides nheads; it needs fp16/bf16 inputs.
    from flash_attn import flash_attn_func

    dtype = q.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    return flash_attn_func(q, k, v, dropout_p=0.0, causal=True).to(dtype)


class TEAttention(torch.nn.Module):
    """Transformer Engine's DotProductAttention in bshd layout with grouped-query heads."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        import transformer_engine.pytorch as te

        self.inner = te.DotProductAttention(
            num_attention_heads=n_heads, kv_channels=head_dim, num_gqa_groups=n_kv_heads,
            attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, h, d = q.shape
        return self.inner(q, k, v).view(b, s, h, d)


def make_attention(choice: str, n_heads: int, n_kv_heads: int, head_dim: int) -> Callable:
    if choice == "sdpa":
        return sdpa_attention
    if choice == "flash_attn":
        return flash_attention
    if choice == "te":
        return TEAttention(n_heads, n_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {choice!r}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 as Meta's reference does, then cast back before the gain.
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.type_as(x) * weight
