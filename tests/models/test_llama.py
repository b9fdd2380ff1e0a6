"""Model pieces against naive reference math, presets, FLOPs, init determinism."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from models.llama import PRESETS, LlamaConfig, build_model, flops_per_token, get_preset
from models.llama.backends import repeat_kv, rms_norm_reference, sdpa_attention
from models.llama.model import IGNORE_INDEX, apply_rope, rope_frequencies, rope_tables
from models.llama.config import RopeScaling

# Published parameter counts (Meta's papers / released checkpoints).
PUBLISHED = {
    "llama1_7b": 6.74e9, "llama1_13b": 13.0e9, "llama1_30b": 32.5e9, "llama1_65b": 65.2e9,
    "llama2_7b": 6.74e9, "llama2_13b": 13.0e9, "llama2_70b": 69.0e9,
    "llama3_8b": 8.03e9, "llama3_70b": 70.6e9, "llama3_1_8b": 8.03e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    n = get_preset(name).num_params()
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.01, f"{name}: {n / 1e9:.3f}B"


def test_preset_counts_match_instantiated_model():
    for name in ("debug", "tiny"):
        cfg = get_preset(name)
        with torch.device("meta"):
            from models.llama.model import Llama
            m = Llama(cfg)
        assert sum(p.numel() for p in m.parameters()) == cfg.num_params()


def test_llama3_70b_shapes():
    cfg = get_preset("llama3_70b")
    assert cfg.ffn_hidden_dim == 28672 and cfg.n_kv_heads == 8 and cfg.vocab_size == 128256
    assert cfg.rope_theta == 500000.0


def test_invalid_config_names_the_problem():
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(dim=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="model.attention"):
        LlamaConfig(attention="xformers")


def test_rope_rotates_consecutive_pairs_by_position_times_frequency():
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=32)
    s, d = 5, cfg.head_dim
    x = torch.randn(1, s, 2, d, dtype=torch.float64)
    cos, sin = rope_tables(cfg, s)
    out = apply_rope(x.float(), cos, sin).double()
    freqs = rope_frequencies(d, cfg.rope_theta, None)
    for pos in range(s):
        for i in range(d // 2):
            a = pos * freqs[i]
            rot = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64)
            expect = x[0, pos, :, 2 * i: 2 * i + 2] @ rot.T
            torch.testing.assert_close(out[0, pos, :, 2 * i: 2 * i + 2], expect, rtol=1e-5, atol=1e-5)


def test_rope_preserves_norm_and_relative_positions():
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=2, vocab_size=32)
    cos, sin = rope_tables(cfg, 12)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    def at(t, pos):
        return apply_rope(t.expand(1, 12, 1, 16).contiguous(), cos, sin)[0, pos, 0]
    torch.testing.assert_close(at(q, 3).norm(), q.norm(), rtol=1e-5, atol=1e-5)
    # <R(m)q, R(n)k> depends only on m - n.
    torch.testing.assert_close(at(q, 5) @ at(k, 2), at(q, 9) @ at(k, 6), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_under_torch_compile_is_real_arithmetic_with_the_same_values(dtype):
    """Inside torch.compile apply_rope rotates the pairs in real arithmetic: inductor generates no code for
    complex tensors (a warning, then separate ATen kernels), which the eager complex product would give it
    (seen in a compiled block's startup measurement on an H200). Values and gradients as eager."""
    import warnings

    torch._dynamo.reset()
    cos, sin = rope_tables(LlamaConfig(dim=256, n_heads=2), 32)
    x = torch.randn(2, 32, 2, 128, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    g = torch.randn(2, 32, 2, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    compiled = torch.compile(lambda t: apply_rope(t, cos, sin))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = compiled(x)
        (dx,) = torch.autograd.grad(y, x, g)
    assert not [w for w in caught if "complex" in str(w.message)]
    y_ref = apply_rope(x, cos, sin)
    (dx_ref,) = torch.autograd.grad(y_ref, x, g)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)


def test_llama3_frequency_scaling():
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    base = rope_frequencies(128, 500000.0, None)
    scaled = rope_frequencies(128, 500000.0, s)
    wavelen = 2 * math.pi / base
    hi = wavelen < 8192 / 4
    lo = wavelen > 8192 / 1
    torch.testing.assert_close(scaled[hi], base[hi])
    torch.testing.assert_close(scaled[lo], base[lo] / 8)
    mid = ~hi & ~lo
    assert mid.any() and torch.all(scaled[mid] <= base[mid]) and torch.all(scaled[mid] >= base[mid] / 8)


def test_gqa_head_repetition():
    k = torch.randn(2, 3, 2, 4)
    r = repeat_kv(k, 3)
    assert r.shape == (2, 3, 6, 4)
    for h in range(6):
        torch.testing.assert_close(r[:, :, h], k[:, :, h // 3])


def test_sdpa_attention_matches_naive_causal_gqa():
    torch.manual_seed(0)
    b, s, h, hkv, d = 2, 7, 4, 2, 8
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    out = sdpa_attention(q, k, v)
    ref = torch.empty_like(out)
    for head in range(h):
        kv = head // (h // hkv)
        scores = q[:, :, head] @ k[:, :, kv].transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
        ref[:, :, head] = scores.softmax(-1) @ v[:, :, kv]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_reference_math():
    x, w = torch.randn(3, 10), torch.randn(10)
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-5), expect)


def test_init_is_deterministic_and_seed_dependent():
    cfg = get_preset("debug")
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n


def test_model_is_built_on_meta_then_materialised():
    cfg = get_preset("debug")
    m = build_model(cfg)
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in m.parameters())
    assert torch.isfinite(m.rope_cos).all()


def test_loss_ignores_ignore_index_and_tied_head_works():
    cfg = get_preset("debug").with_overrides(tie_embeddings=True)
    m = build_model(cfg)
    assert m.head.output is None
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    y = x.clone()
    y[:, :4] = IGNORE_INDEX
    logits = m(x)
    expect = F.cross_entropy(logits[:, 4:].reshape(-1, cfg.vocab_size), y[:, 4:].reshape(-1))
    torch.testing.assert_close(m(x, y), expect)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_same_gradients(mode):
    cfg = get_preset("debug")
    ref = build_model(cfg, seed=3)
    ckpt = build_model(cfg.with_overrides(activation_checkpointing=mode), seed=3)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    for m in (ref, ckpt):
        m(x, x).backward()
    for (n, a), b in zip(ref.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_flops_per_token_matches_flop_counter():
    cfg = get_preset("tiny")
    m = build_model(cfg)
    b, s = 1, 128
    x = torch.randint(0, cfg.vocab_size, (b, s))
    # The math SDPA kernel decomposes into counted bmm's (the fused CPU kernel has no flop formula).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        m(x, x).backward()
    measured = fc.get_total_flops() / (b * s)
    predicted = flops_per_token(cfg, s)
    assert abs(measured - predicted) / predicted < 0.02, (measured, predicted)


def test_every_preset_builds_on_meta():
    for name, cfg in PRESETS.items():
        if cfg.num_params() > 2e10:
            continue
        with torch.device("meta"):
            from models.llama.model import Llama
            Llama(cfg.with_overrides(max_seq_len=64))


def test_te_norms_take_rms_norm_out_of_the_fused_ops(monkeypatch, caplog):
    """With model.norm=te the norms are TE's whatever model.fused says; the fused-ops line named rms_norm anyway.
    CPU: TE's RMSNorm is stood in by the torch one (only the bookkeeping is under test)."""
    import logging

    from models.llama import fused, model as model_mod

    if fused.load_ops() is None:
        pytest.skip("the native extension is unavailable: no fused op to take out")
    monkeypatch.setattr(model_mod, "resolve_norm", lambda requested: "te")
    monkeypatch.setattr(model_mod, "make_rms_norm", lambda choice, dim, eps, fused=False:
                        model_mod.RMSNorm(dim, eps, fused))
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=128, max_seq_len=32, fused="on")
    with caplog.at_level(logging.INFO, logger=fused.__name__):
        m = model_mod.Llama(cfg)
    assert "rms_norm" not in m.fused_ops and "swiglu" in m.fused_ops, m.fused_ops
    assert "fused ops: rms_norm not used: the norms are Transformer Engine's (model.norm=te)" in fused._logged
