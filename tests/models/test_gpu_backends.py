"""GPU kernel backends against reference paths. GPU tests are marked `gpu` (skipped without CUDA);
one CPU test checks that the CUDA attention path traces under torch.compile without graph breaks."""
import logging

import pytest
import torch

from models.llama import get_preset
from models.llama import backends
from models.llama.backends import flash_attn_available, repeat_kv, sdpa_attention, te_available
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED = {"cudnn_attention", "flash_attention"}
TOL = dict(rtol=2e-2, atol=2e-2)  # bf16 outputs against an fp32 reference


def _qkv(dtype=torch.bfloat16, h=8, hkv=2, s=256, d=64, requires_grad=False):
    torch.manual_seed(0)
    mk = lambda n: torch.randn(2, s, n, d, device="cuda", dtype=dtype, requires_grad=requires_grad)  # noqa: E731
    return mk(h), mk(hkv), mk(hkv)


def _math_reference(q, k, v):
    """fp32 causal attention through the math kernel, GQA by explicit repetition: shares no code
    path with the fused kernels or with enable_gqa."""
    n_rep = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            qf.transpose(1, 2), repeat_kv(kf, n_rep).transpose(1, 2), repeat_kv(vf, n_rep).transpose(1, 2),
            is_causal=True).transpose(1, 2)
    return out, (qf, kf, vf)


def _compare_with_math(fn, q, k, v, tol):
    out = fn(q, k, v)
    ref, ref_inputs = _math_reference(q, k, v)
    torch.testing.assert_close(out.float(), ref, **tol)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, ref_inputs, g)
    for got, want, name in zip(grads, ref_grads, "qkv"):
        scale = max(want.abs().max().item(), 1.0)  # gradients' magnitude grows with the sequence
        torch.testing.assert_close(got.float() / scale, want / scale, **tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_cuda_sdpa_uses_a_fused_kernel_and_matches_math(heads):
    q, k, v = _qkv(h=heads[0], hkv=heads[1], requires_grad=True)
    order = backends.cuda_sdpa_backends(torch.bfloat16)
    assert order and {backends._SDPA_NAMES[int(b)] for b in order} <= FUSED, order
    with sdpa_kernel(order, set_priority=True):
        chosen = backends.sdpa_kernel_choice(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), heads[1] != 8)
    assert chosen in FUSED, f"SDPA would dispatch to {chosen} under {order}"
    _compare_with_math(sdpa_attention, q, k, v, TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], ids=["cudnn", "flash"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_each_fused_kernel_alone_matches_math(backend, heads):
    """Each kernel of the allowed list on its own, GQA through enable_gqa: whichever the dispatcher
    picks on a given torch/cuDNN, its numbers are right."""
    q, k, v = _qkv(h=heads[0], hkv=heads[1], requires_grad=True)
    with sdpa_kernel([backend]):
        chosen = backends.sdpa_kernel_choice(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), heads[1] != 8)
    if chosen == "error":
        if backend in backends.cuda_half_sdpa_order()[:1]:
            pytest.fail(f"{backend.name} is first in the attention order but rejects {heads} heads here")
        pytest.skip(f"{backend.name} does not take {heads} heads on this torch/cuDNN (not first in the order)")
    _compare_with_math(lambda q, k, v: backends.cuda_sdpa_attention(q, k, v, [backend]), q, k, v, TOL)


@pytest.mark.gpu
def test_cuda_sdpa_fp32_uses_efficient_kernel_not_math():
    q, k, v = _qkv(dtype=torch.float32, requires_grad=True)
    assert backends.cuda_sdpa_backends(torch.float32) == [SDPBackend.EFFICIENT_ATTENTION]
    k4, v4 = repeat_kv(k, 4), repeat_kv(v, 4)  # fp32 GQA goes to the kernel repeated (backends.py)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert backends.sdpa_kernel_choice(q.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), False) \
            == "efficient_attention"
    # fp32 kernels on the same inputs differ by summation order (and TF32, if a test enabled it)
    _compare_with_math(sdpa_attention, q, k, v, dict(rtol=2e-3, atol=2e-3))


@pytest.mark.gpu
def test_cuda_sdpa_restriction_is_local_and_logged_once(caplog):
    q, k, v = _qkv()
    backends.cuda_half_sdpa_order()  # installs PyTorch's lazy default priority before we read it
    before = (torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
              torch._C._get_sdp_priority_order())
    with caplog.at_level(logging.INFO, logger="models.llama.backends"):
        backends._logged.discard(("attention SDPA kernel", "bfloat16 GQA head_dim 64"))
        for _ in range(3):
            sdpa_attention(q, k, v)
    lines = [r.getMessage() for r in caplog.records
             if "attention SDPA kernel on CUDA for bfloat16 GQA" in r.getMessage()]
    assert len(lines) == 1 and any(n in lines[0] for n in FUSED), lines
    after = (torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
             torch._C._get_sdp_priority_order())
    assert before == after, "the kernel restriction leaked out of the attention call"


@pytest.mark.gpu
def test_cuda_sdpa_under_torch_compile_matches_eager():
    q, k, v = _qkv(requires_grad=True)
    backends.cuda_half_sdpa_order()  # decided eagerly, as model construction does (resolve_attention)
    compiled = torch.compile(sdpa_attention, fullgraph=True)  # fullgraph: a graph break is an error
    out, ref = compiled(q, k, v), sdpa_attention(q, k, v)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_whole_model_bf16_sdpa_matches_fp32(checkpointing):
    """The tiny preset (head_dim 64, GQA) in bf16 through the restricted SDPA against the same
    weights in fp32 (efficient kernel): losses and gradients agree to bf16 precision, with every
    recomputation mode (selective keeps the fused attention's output, models/llama/model.py)."""
    from models.llama import build_model

    cfg = get_preset("tiny").with_overrides(attention="sdpa", norm="torch", fused="off", n_layers=2,
                                            activation_checkpointing=checkpointing)
    ref = build_model(cfg, device="cuda", dtype=torch.float32, seed=3)
    fast = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=3)
    with torch.no_grad():
        for p, pr in zip(fast.parameters(), ref.parameters()):
            p.copy_(pr)  # the same (bf16-rounded) weights in both
            pr.copy_(p)
    x = torch.randint(0, cfg.vocab_size, (2, 513), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loss, loss_ref = fast(x[:, :-1], x[:, 1:]), ref(x[:, :-1], x[:, 1:])
    torch.testing.assert_close(loss.float(), loss_ref, rtol=1e-2, atol=1e-2)
    loss.backward()
    loss_ref.backward()
    for (name, p), pr in zip(fast.named_parameters(), ref.parameters()):
        scale = max(pr.grad.abs().max().item(), 1e-3)
        torch.testing.assert_close(p.grad.float() / scale, pr.grad / scale, rtol=5e-2, atol=5e-2,
                                   msg=lambda m: f"{name}: {m}")


def test_half_precision_kernel_order_follows_pytorchs_cudnn_preference():
    cudnn, flash = SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION
    assert backends.half_sdpa_order_rule(91501, (9, 0))[0] == [cudnn, flash]  # H100/H200, fixed cuDNN
    assert backends.half_sdpa_order_rule(91900, (10, 0))[0] == [cudnn, flash]  # B200
    assert backends.half_sdpa_order_rule(91500, (9, 0))[0] == [flash, cudnn]  # cuDNN with pytorch#169849
    assert backends.half_sdpa_order_rule(91900, (8, 0))[0] == [flash, cudnn]  # A100: flash first
    assert backends.half_sdpa_order_rule(None, (9, 0))[0] == [flash]
    assert all(SDPBackend.MATH not in backends.half_sdpa_order_rule(v, c)[0]
               for v in (None, 90100, 91900) for c in ((8, 0), (9, 0)))


def test_cuda_attention_path_traces_without_graph_breaks():
    """CPU stand-in for the compiled GPU path: the sdpa_kernel(set_priority=True) block and the
    log-once guard trace as one graph (on CUDA the list holds cuDNN/flash; math is the kernel CPU has)."""
    import torch._dynamo

    torch._dynamo.reset()
    q, k, v = torch.randn(2, 32, 4, 16), torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    allowed = [SDPBackend.MATH]
    fn = torch.compile(lambda q, k, v: backends.cuda_sdpa_attention(q, k, v, allowed), backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), sdpa_attention(q, k, v))
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled(), \
        "leaving the compiled block must restore the process-wide kernel switches"


# ---- optional kernel libraries (flash-attn, Transformer Engine) against SDPA ----


@pytest.mark.gpu
def test_flash_attn_matches_sdpa():
    if not flash_attn_available():
        pytest.skip("flash_attn not installed")
    from models.llama.backends import flash_attention
    q, k, v = _qkv()
    torch.testing.assert_close(flash_attention(q, k, v), sdpa_attention(q, k, v), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_te_attention_matches_sdpa():
    if not te_available():
        pytest.skip("transformer_engine not installed")
    from models.llama.backends import TEAttention
    q, k, v = _qkv()
    te_attn = TEAttention(8, 2, 64).cuda()
    torch.testing.assert_close(te_attn(q, k, v), sdpa_attention(q, k, v), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
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


@pytest.mark.gpu
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


def test_an_installed_library_that_does_not_import_is_passed_over_and_said(tmp_path, monkeypatch, caplog):
    """A flash-attn build left behind by a torch upgrade is found on the path but fails at import; auto used to
    pick it (find_spec only) and the run failed at its first attention. CPU: CUDA is pretended for the check."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c104cuda9SetDevice')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "_logged", set())
    backends.import_problem.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="models.llama.backends"):
            assert not flash_attn_available() and not flash_attn_available()
        assert caplog.text.count("does not import") == 1, caplog.text
        assert "undefined symbol" in caplog.text and "rebuild it" in caplog.text
        with pytest.raises(RuntimeError, match="model.attention=flash_attn needs .*does not import"):
            backends.resolve_attention("flash_attn")
    finally:
        backends.import_problem.cache_clear()
