"""Which fused kernels run where (models/llama/fused.py kernel_runs, ops_running) and the fused
cross-entropy's backward without host reads of device values; CPU-only (the CUDA twins are in
tests/gpu/test_fused_cuda_syncs.py)."""
import pytest
import torch
import torch.nn.functional as F

from csrc import loader
from models.llama import fused
from models.llama.config import LlamaConfig
from models.llama.fused_ops import ALL_OPS, AUTO_OPS, CUDA_COMPILED_REFERENCE_OPS
from models.llama.model import IGNORE_INDEX, lm_loss, rope_tables

BLOCK_OPS = {"rms_norm", "rope", "swiglu"}  # the ops inside a transformer block


def _cuda_kernels(monkeypatch, built: bool) -> None:
    ext = loader.NativeExtension("amsp_cuda_choice_test", [])
    if built:
        ext.lib = "/nonexistent/amsp_csrc_cuda.so"  # only its presence is asked
    else:
        ext.error = "simulated: no CUDA build"
    monkeypatch.setattr(loader, "CUDA_EXTENSION", ext)


def test_compiled_reference_ops_are_the_block_ops():
    # The fused head loss is outside the compiled blocks and must keep its kernel there (memory).
    assert set(CUDA_COMPILED_REFERENCE_OPS) == BLOCK_OPS
    assert set(CUDA_COMPILED_REFERENCE_OPS) <= set(ALL_OPS)


@pytest.mark.parametrize("compiling", [False, True])
def test_cpu_runs_every_kernel_compiled_or_not(compiling):
    for op in ALL_OPS:
        assert fused.kernel_runs(op, "cpu", compiling) and fused.kernel_runs(op, "meta", compiling)


def test_cuda_kernels_outside_compiled_code_and_for_the_loss(monkeypatch):
    _cuda_kernels(monkeypatch, built=True)
    for op in ALL_OPS:
        assert fused.kernel_runs(op, "cuda", compiling=False), op
        assert fused.kernel_runs(op, "cuda", compiling=True) == (op not in BLOCK_OPS), op
    assert not fused.kernel_runs("rms_norm", "mps", compiling=False)  # no kernel for other devices


def test_cuda_without_the_build_runs_no_kernel(monkeypatch):
    _cuda_kernels(monkeypatch, built=False)
    for op in ALL_OPS:
        assert not fused.kernel_runs(op, "cuda", compiling=False)


def test_ops_running_follows_the_choice_and_the_cuda_build(native_ext, monkeypatch):
    # The planner's memory model asks this (amsp/planner/startup.py kernels_for_model).
    assert fused.ops_running("auto", "cpu") == frozenset(AUTO_OPS)
    assert fused.ops_running("on", "cpu") == frozenset(ALL_OPS)
    assert fused.ops_running("off", "cpu") == frozenset()
    _cuda_kernels(monkeypatch, built=True)
    assert fused.ops_running("auto", "cuda") == frozenset(AUTO_OPS)
    assert fused.ops_running("on", torch.device("cuda", 0)) == frozenset(ALL_OPS)
    assert fused.ops_running("off", "cuda") == frozenset()
    _cuda_kernels(monkeypatch, built=False)
    assert fused.ops_running("auto", "cuda") == frozenset()


def _traced_targets(fn, *args) -> list[str]:
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


def test_compiled_code_on_cpu_still_calls_the_kernels(native_ext):
    # The compiled-region rule is CUDA's only: a CPU run with model.compile=on keeps the kernels it had.
    torch._dynamo.reset()
    x, w = torch.randn(4, 32), torch.rand(32) + 0.5
    cos, sin = rope_tables(LlamaConfig(dim=32, n_heads=2), 3)
    q = torch.randn(1, 3, 2, 16)

    def block_like(x, w, q):
        return fused.rms_norm(x, w, 1e-5), fused.swiglu(x, x), fused.apply_rope(q, cos, sin)

    targets = _traced_targets(block_like, x, w, q)
    for op in ("amsp_fused.rms_norm_fwd", "amsp_fused.swiglu_fwd", "amsp_fused.rope_fwd"):
        assert op in targets, targets


# ---------------------------------------------------------------- the fused loss's backward
def _loss_and_ref(seed=0):
    g = torch.Generator().manual_seed(seed)
    h0, w0 = torch.randn(12, 16, generator=g), torch.randn(40, 16, generator=g) * 0.1
    t = torch.randint(0, 40, (12,), generator=g)
    t[:3] = IGNORE_INDEX
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    hr, wr = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    return fused.linear_cross_entropy(h, w, t, chunk=5), (h, w), lm_loss(F.linear(hr, wr)[None], t[None]), (hr, wr)


def test_loss_backward_reads_no_device_value_on_the_host(native_ext, monkeypatch):
    """Reading a tensor's value on the host (bool(), .item(), float(), int()) is a sync on CUDA; the backward
    used to ask bool(dloss == 1) once per micro-batch. Any such read now fails this test."""
    loss, (h, w), loss_ref, (hr, wr) = _loss_and_ref()

    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor value was read on the host inside the fused loss's backward")

    with monkeypatch.context() as m:
        for name in ("__bool__", "item", "__float__", "__int__", "tolist"):
            m.setattr(torch.Tensor, name, refuse)
        (loss * 0.25).backward()
    (loss_ref * 0.25).backward()
    torch.testing.assert_close(h.grad, hr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_loss_backward_through_a_retained_graph(native_ext):
    # Unit upstream gradients leave the saved gradients as they are (x 1), so the graph can be
    # differentiated again, at any scale; after a non-unit one it cannot (they were scaled in place).
    loss, (h, w), loss_ref, (hr, wr) = _loss_and_ref(1)
    g1 = torch.autograd.grad(loss, (h, w), retain_graph=True)
    g2 = torch.autograd.grad(loss, (h, w), retain_graph=True)
    want = torch.autograd.grad(loss_ref, (hr, wr), retain_graph=True)
    for a, b, c in zip(g1, g2, want):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)
    g3 = torch.autograd.grad(loss * 3, (h, w), retain_graph=True)
    for a, c in zip(g3, want):
        torch.testing.assert_close(a, 3 * c)
    with pytest.raises(RuntimeError, match="non-unit upstream gradient"):
        torch.autograd.grad(loss, (h, w))
