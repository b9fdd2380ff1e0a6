"""models/llama/init.py: any slice of a parameter's init equals that range of the whole-parameter
init, across chunk boundaries, however the range is cut, for every parameter kind."""
from __future__ import annotations

import math

import pytest
import torch

from models.llama import Llama, build_model, get_preset
from models.llama.init import CHUNK, chunk_seed, init_slice, init_std

SEED = 5
# Small dim, large vocabulary: the embedding spans 2.5 chunks, so slices cross chunk boundaries.
CFG = get_preset("debug").with_overrides(vocab_size=40960)
NAMES = ["tok_embeddings.weight", "layers.1.attention.wq.weight", "layers.0.attention.wo.weight",
         "layers.1.feed_forward.w2.weight", "layers.0.attention_norm.weight", "head.output.weight"]


def param_shape(name: str) -> torch.Size:
    with torch.device("meta"):
        return Llama(CFG).get_parameter(name).shape


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=SEED)


def test_embedding_spans_several_chunks(model):
    assert model.tok_embeddings.weight.numel() > 2 * CHUNK


@pytest.mark.parametrize("name", NAMES)
def test_slice_equals_range_of_whole_parameter(model, name):
    p = model.get_parameter(name)
    whole = p.detach().reshape(-1)
    n = whole.numel()
    cuts = [(0, n), (0, 1), (n - 1, n), (n // 3, 2 * n // 3), (7, 7)]
    if n > CHUNK:  # straddling one and two chunk boundaries, and ending exactly on one
        cuts += [(CHUNK - 5, CHUNK + 5), (CHUNK - 1, 2 * CHUNK + 1), (CHUNK // 2, CHUNK), (CHUNK, n)]
    for lo, hi in cuts:
        got = init_slice(CFG, name, p.shape, lo, hi, SEED, "cpu")
        assert got.shape == (hi - lo,) and torch.equal(got, whole[lo:hi]), (name, lo, hi)


@pytest.mark.parametrize("name", ["tok_embeddings.weight", "layers.0.feed_forward.w2.weight"])
def test_values_do_not_depend_on_how_the_range_is_cut(name):
    shape = param_shape(name)
    n = math.prod(shape)
    whole = init_slice(CFG, name, shape, 0, n, SEED, "cpu")
    g = torch.Generator().manual_seed(0)
    for pieces in (2, 3, 7, 16):
        bounds = sorted({0, n, *torch.randint(1, n, (pieces - 1,), generator=g).tolist()})
        parts = [init_slice(CFG, name, shape, a, b, SEED, "cpu") for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(parts), whole), (name, bounds)


def test_std_per_parameter_kind(model):
    out_std = 0.02 / math.sqrt(2 * CFG.n_layers)
    assert init_std(CFG, "layers.0.ffn_norm.weight") is None and init_std(CFG, "head.norm.weight") is None
    assert init_std(CFG, "layers.1.attention.wo.weight") == out_std
    assert init_std(CFG, "layers.1.feed_forward.w2.weight") == out_std
    assert init_std(CFG, "layers.1.feed_forward.w1.weight") == 0.02
    assert torch.equal(model.get_parameter("head.norm.weight"), torch.ones(CFG.dim))
    emb = model.tok_embeddings.weight
    assert abs(emb.std().item() - 0.02) < 1e-3 and abs(emb.mean().item()) < 1e-3
    wo = model.get_parameter("layers.0.attention.wo.weight")
    assert abs(wo.std().item() - out_std) / out_std < 0.05


def test_values_depend_on_seed_name_and_chunk_and_dtype_is_a_rounding():
    name, shape = "tok_embeddings.weight", param_shape("tok_embeddings.weight")
    a = init_slice(CFG, name, shape, 0, 3 * CHUNK // 2, SEED, "cpu")
    assert not torch.equal(a[:100], init_slice(CFG, name, shape, 0, 100, SEED + 1, "cpu"))
    assert not torch.equal(a[:100], init_slice(CFG, "head.output.weight", shape, 0, 100, SEED, "cpu"))
    assert not torch.equal(a[:100], a[CHUNK:CHUNK + 100])  # chunks are independent streams
    bf = init_slice(CFG, name, shape, 10, CHUNK + 10, SEED, "cpu", torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, a[10:CHUNK + 10].to(torch.bfloat16))


def test_a_chunk_is_one_generator_stream_keyed_by_seed_name_and_chunk_index():
    name, shape = "tok_embeddings.weight", param_shape("tok_embeddings.weight")
    n = math.prod(shape)
    for c in (1, n // CHUNK):  # a full chunk and the short last one
        lo, hi = c * CHUNK, min(n, (c + 1) * CHUNK)
        gen = torch.Generator().manual_seed(chunk_seed(SEED, name, c))
        want = torch.randn(hi - lo, generator=gen).mul_(0.02)
        assert torch.equal(init_slice(CFG, name, shape, lo, hi, SEED, "cpu"), want), c


def test_bad_ranges_are_named():
    shape = (4, 8)
    with pytest.raises(ValueError, match=r"range \[30, 40\) outside \[0, 32\)"):
        init_slice(CFG, "layers.0.attention.wq.weight", shape, 30, 40, SEED, "cpu")
    with pytest.raises(ValueError, match="outside"):
        init_slice(CFG, "layers.0.attention.wq.weight", shape, 5, 3, SEED, "cpu")


@pytest.mark.gpu
def test_cuda_slices_equal_cuda_whole_parameter():
    name, shape = "tok_embeddings.weight", param_shape("tok_embeddings.weight")
    n = math.prod(shape)
    whole = init_slice(CFG, name, shape, 0, n, SEED, "cuda")
    for lo, hi in [(0, n), (CHUNK - 5, 2 * CHUNK + 3), (n - 9, n)]:
        got = init_slice(CFG, name, shape, lo, hi, SEED, "cuda")
        assert got.device.type == "cuda" and torch.equal(got, whole[lo:hi]), (lo, hi)
    model = build_model(CFG, device="cuda", seed=SEED)
    assert torch.equal(model.tok_embeddings.weight.reshape(-1), whole)
