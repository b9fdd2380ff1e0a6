"""GPU kernel backends against the SDPA / torch path. Skipped without CUDA."""
import pytest
import torch

from models.llama import get_preset
from models.llama.backends import flash_attn_available, sdpa_attention, te_available

pytestmark = pytest.mark.gpu


def _qkv(dtype=torch.bfloat16):
    torch.manual_seed(0)
    b, s, h, hkv, d = 2, 256, 8, 2, 64
    mk = lambda n: torch.randn(b, s, n, d, device="cuda", dtype=dtype)
    return mk(h), mk(hkv), mk(hkv)


def test_flash_attn_matches_sdpa():
    if not flash_attn_available():
        pytest.skip("flash_attn not installed")
    from models.llama.backends import flash_attention
    q, k, v = _qkv()
    torch.testing.assert_close(flash_attention(q, k, v), sdpa_attention(q, k, v), rtol=2e-2, atol=2e-2)


def test_te_attention_matches_sdpa():
    if not te_available():
        pytest.skip("transformer_engine not installed")
    from models.llama.backends import TEAttention
    q, k, v = _qkv()
    te_attn = TEAttention(8, 2, 64).cuda()
    torch.testing.assert_close(te_attn(q, k, v), sdpa_attention(q, k, v), rtol=2e-2, atol=2e-2)


def test_te_rmsnorm_matches_torch():
    if not te_available():
        pytest.skip("transformer_engine not installed")
    from models.llama.model import RMSNorm, make_rms_norm
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    te_norm, ref = make_rms_norm("te", 256, 1e-5).cuda(), RMSNorm(256, 1e-5).cuda()
    with torch.no_grad():
        w = torch.randn(256, device="cuda")
        te_norm.weight.copy_(w)
        ref.weight.copy_(w)
    torch.testing.assert_close(te_norm(x), ref(x.float()).to(x.dtype).float().to(x.dtype), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("attention,norm", [("flash_attn", "torch"), ("te", "te")])
def test_whole_model_backends_match_sdpa(attention, norm):
    if attention == "flash_attn" and not flash_attn_available() or attention == "te" and not te_available():
        pytest.skip(f"{attention} not installed")
    from models.llama import build_model
    cfg = get_preset("debug")
    ref = build_model(cfg.with_overrides(attention="sdpa", norm="torch"), device="cuda", dtype=torch.bfloat16)
    fast = build_model(cfg.with_overrides(attention=attention, norm=norm), device="cuda", dtype=torch.bfloat16)
    x = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    torch.testing.assert_close(fast(x, x), ref(x, x), rtol=2e-2, atol=2e-2)
