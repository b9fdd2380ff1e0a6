"""Kernel backends for attention and RMSNorm.

`auto` picks flash-attn, then Transformer Engine, on CUDA when they import, and PyTorch's
scaled_dot_product_attention everywhere else. The choice is made once per model and logged
once per process, so a run's log always says which kernels it used.

PyTorch SDPA on CUDA is restricted to its fused kernels (cuDNN and flash for bf16/fp16, in the
order `cuda_half_sdpa_order` picks; the memory-efficient kernel for fp32), so a shape they reject
is an error, not a silent switch to the O(S^2)-memory math kernel. The allowed list and the kernel
the dispatcher takes are logged once. On CPU SDPA keeps PyTorch's own dispatch.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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


@functools.cache
def import_problem(module: str) -> str | None:
    """None when `module` imports, else why not. Installed is not enough: flash-attn and Transformer Engine
    compile against one torch, and a build left behind by a torch upgrade is found by find_spec but fails
    at import (an undefined symbol); `auto` would pick it and the run would fail at its first attention."""
    if not _importable(module.split(".")[0]):
        return "not installed"
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, OSError (a missing .so), RuntimeError from its init
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"installed but does not import ({type(e).__name__}: {first}); built for another torch? rebuild " \
               f"it (README, GPU clusters)"
    return None


def _usable(module: str, kind: str) -> bool:
    """CUDA and `module` importing; an installed package that fails to import is said once (auto then takes
    the next backend), so a stale build is not silently passed over either."""
    if not torch.cuda.is_available():
        return False
    why = import_problem(module)
    if why not in (None, "not installed") and (kind, module) not in _logged:
        _logged.add((kind, module))
        log.warning("%s backend: %s %s", kind, module, why)
    return why is None


def flash_attn_available() -> bool:
    return _usable("flash_attn", "attention")


def te_available() -> bool:
    return _usable("transformer_engine.pytorch", "transformer_engine")


def _unusable_reason(module: str) -> str:
    return "no CUDA device" if not torch.cuda.is_available() else import_problem(module) or ""


def resolve_attention(requested: str) -> str:
    if requested == "auto":
        if flash_attn_available():
            choice, why = "flash_attn", "auto: CUDA and flash_attn importable"
        elif te_available():
            choice, why = "te", "auto: CUDA and transformer_engine importable"
        elif not torch.cuda.is_available():
            choice, why = "sdpa", "auto: no CUDA kernel library available"
        else:
            choice, why = "sdpa", "auto: neither flash_attn nor transformer_engine importable; PyTorch SDPA " \
                                  "restricted to its fused CUDA kernels"
    else:
        choice, why = requested, "requested"
        if choice == "flash_attn" and not flash_attn_available():
            raise RuntimeError(f"model.attention=flash_attn needs CUDA and the flash_attn package "
                               f"(pip install -e '.[gpu]' --no-build-isolation): {_unusable_reason('flash_attn')}; "
                               f"model.attention=sdpa runs without it")
        if choice == "te" and not te_available():
            raise RuntimeError(f"model.attention=te needs CUDA and transformer_engine "
                               f"(pip install -e '.[gpu]' --no-build-isolation): "
                               f"{_unusable_reason('transformer_engine.pytorch')}; model.attention=sdpa runs without it")
    _log_once("attention", choice, why)
    if choice == "sdpa" and torch.cuda.is_available():
        cuda_half_sdpa_order()  # decided (and logged) here, eagerly, not inside a compiled region
    return choice


def resolve_norm(requested: str) -> str:
    if requested == "auto":
        choice, why = ("te", "auto: CUDA and transformer_engine importable") if te_available() \
            else ("torch", "auto: transformer_engine not usable here")
    else:
        choice, why = requested, "requested"
        if choice == "te" and not te_available():
            raise RuntimeError(f"model.norm=te needs CUDA and transformer_engine: "
                               f"{_unusable_reason('transformer_engine.pytorch')}; model.norm=torch runs without it")
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
    if q.is_cuda:
        return cuda_sdpa_attention(q, k, v, cuda_sdpa_backends(q.dtype))
    n_rep = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True)
    return out.transpose(1, 2)


# cuDNN's fused attention has Hopper/Blackwell kernels (wgmma + TMA, FlashAttention-3 style); PyTorch's
# built-in flash backend is FlashAttention-2, written for sm80. PyTorch's own default priority puts cuDNN
# first on sm90/sm10x only for cuDNN > 9.15.0 (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
# check_prefer_cudnn_attention): older cuDNN SDPA had out-of-bounds accesses for sequence lengths not
# divisible by 128 (pytorch/pytorch#169849). The same rule decides here; flash stays second because it
# takes every causal bf16/fp16 shape this model produces (head_dim <= 256) and is deterministic.
_CUDNN_PREFERRED_AFTER = 91500
_cuda_half_order: list[SDPBackend] = []  # filled once per process by cuda_half_sdpa_order()


def half_sdpa_order_rule(cudnn_version: int | None, capability: tuple[int, int]) -> tuple[list[SDPBackend], str]:
    """The bf16/fp16 kernel order for a cuDNN runtime version (None: no cuDNN) and an SM capability,
    with the reason in words."""
    major, minor = capability
    if cudnn_version is None:
        return [SDPBackend.FLASH_ATTENTION], "cuDNN not available in this torch build"
    if cudnn_version > _CUDNN_PREFERRED_AFTER and major in (9, 10):
        return ([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
                f"cuDNN {cudnn_version} > {_CUDNN_PREFERRED_AFTER} on sm_{major}{minor}: cuDNN's Hopper/Blackwell "
                f"kernels first")
    return ([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION],
            f"cuDNN {cudnn_version} on sm_{major}{minor}: PyTorch prefers cuDNN only on sm_90/sm_10x with cuDNN > "
            f"{_CUDNN_PREFERRED_AFTER}, so flash first")


def cuda_half_sdpa_order() -> list[SDPBackend]:
    """SDPA kernels allowed for bf16/fp16 on CUDA, in priority order; decided and logged once."""
    if not _cuda_half_order:
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        order, why = half_sdpa_order_rule(version, torch.cuda.get_device_capability())
        _prime_default_sdpa_priority()
        _cuda_half_order.extend(order)
        log.info("attention SDPA kernels on CUDA for bf16/fp16: %s, in that order; math and efficient disabled "
                 "(%s)", _names(order), why)
    return _cuda_half_order


def _prime_default_sdpa_priority() -> None:
    # PyTorch installs its default kernel priority (cuDNN first where it prefers cuDNN) lazily, at
    # the first SDPA dispatch. If that first dispatch ran inside our sdpa_kernel(set_priority=True)
    # block, leaving the block would restore the pre-initialisation order (flash first) for every
    # other SDPA caller in the process. One dispatch decision outside any block (no kernel runs)
    # installs PyTorch's default first, so our restriction stays local to this model's attention.
    t = torch.zeros(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    try:
        torch._fused_sdp_choice(t, t, t, is_causal=True)
    except (RuntimeError, TypeError, AttributeError) as e:
        log.warning("could not initialise PyTorch's default SDPA priority (%s: %s); other SDPA callers in this "
                    "process may see flash before cuDNN", type(e).__name__, e)


def cuda_sdpa_backends(dtype: torch.dtype) -> list[SDPBackend]:
    """The SDPA kernels attention may use on CUDA for inputs of `dtype`, in priority order."""
    if dtype in (torch.bfloat16, torch.float16):
        return cuda_half_sdpa_order()
    # cuDNN and flash take only bf16/fp16. fp32 runs (correctness checks, not speed) get the
    # memory-efficient kernel, named in the log; float64 only the math kernel has.
    if dtype == torch.float32:
        return [SDPBackend.EFFICIENT_ATTENTION]
    return [SDPBackend.MATH]


_SDPA_NAMES = {int(b): b.name.lower() for b in SDPBackend.__members__.values()}


def _names(backends: list[SDPBackend]) -> str:
    return " > ".join(_SDPA_NAMES[int(b)] for b in backends)


def _log_sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool,
                     backends: list[SDPBackend]) -> None:
    # Which kernel the dispatcher takes for these inputs under the active restriction: the same
    # selection F.scaled_dot_product_attention makes (torch._fused_sdp_choice is its entry point).
    what = f"{str(q.dtype).removeprefix('torch.')} {'GQA' if gqa else 'MHA'} head_dim {q.shape[-1]}"
    if ("attention SDPA kernel", what) in _logged:
        return
    _logged.add(("attention SDPA kernel", what))
    try:
        chosen = sdpa_kernel_choice(q, k, v, gqa)
    except (RuntimeError, TypeError, AttributeError) as e:  # private API: report, never fail a run over a log line
        chosen = f"not reported by this torch ({type(e).__name__}: {e})"
    log.info("attention SDPA kernel on CUDA for %s: %s (allowed: %s)", what, chosen, _names(backends))


def sdpa_kernel_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> str:
    """Name of the kernel causal SDPA dispatches to for (B,H,S,D) inputs under the active
    sdpa_kernel restriction ("error" when none of the allowed kernels takes them)."""
    return _SDPA_NAMES.get(int(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=gqa)), "unknown")


def cuda_sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        backends: list[SDPBackend]) -> torch.Tensor:
    """Causal SDPA on CUDA through `backends` only (priority order). q (B,S,H,D), k/v (B,S,Hkv,D).

    Grouped-query heads: in bf16/fp16 they go to the kernel as they are (enable_gqa; cuDNN and flash
    read each KV head for its n_rep query heads, no repeated K/V copies). The fp32/fp64 kernels get
    repeated K/V (repeat_kv), which every torch version's efficient and math kernels take. The
    (B,S,H,D) -> (B,H,S,D) transposes are views: the strides are cuDNN's preferred "BSHD" layout,
    and flash takes any layout with a unit last stride.
    """
    gqa = q.shape[2] != k.shape[2]
    if gqa and q.dtype not in (torch.bfloat16, torch.float16):
        n_rep = q.shape[2] // k.shape[2]
        k, v, gqa = repeat_kv(k, n_rep), repeat_kv(v, n_rep), False
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # The restriction covers the forward only; autograd runs the matching backward kernel. Dynamo
    # traces sdpa_kernel (torch >= 2.9 also with set_priority), so this works under torch.compile.
    with sdpa_kernel(backends, set_priority=True):
        if not torch.compiler.is_compiling():
            _log_sdpa_choice(qt, kt, vt, gqa, backends)
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
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
