"""The model with model.fused=on equals model.fused=off: loss, logits, gradients, state-dict keys."""
import pytest
import torch

from models.llama.config import get_preset
from models.llama.model import IGNORE_INDEX, build_model


def _pair(**overrides):
    cfg = get_preset("debug")
    on = build_model(cfg.with_overrides(fused="on", **overrides), seed=3)
    off = build_model(cfg.with_overrides(fused="off", **overrides), seed=3)
    return on, off


def _batch(vocab, b=2, s=32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (b, s), generator=gen)
    y = torch.randint(0, vocab, (b, s), generator=gen)
    y[0, :5] = IGNORE_INDEX
    return x, y


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True}, {"activation_checkpointing": "selective"}])
def test_fused_model_matches_eager(native_ext, overrides):
    on, off = _pair(**overrides)
    assert list(on.state_dict()) == list(off.state_dict())  # parameter names unchanged
    assert on.head.fused_loss and not off.head.fused_loss
    x, y = _batch(on.cfg.vocab_size)
    loss_on, loss_off = on(x, y), off(x, y)
    torch.testing.assert_close(loss_on, loss_off, atol=1e-5, rtol=1e-5)
    loss_on.backward()
    loss_off.backward()
    grads_off = dict(off.named_parameters())
    for name, p in on.named_parameters():
        torch.testing.assert_close(p.grad, grads_off[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # logits are still returned without targets
        torch.testing.assert_close(on(x), off(x), atol=1e-5, rtol=1e-5)


def test_fused_model_with_weights_in_a_flat_buffer(native_ext):
    # The data-parallel engine replaces each .weight by a view of one flat buffer; fused ops must
    # read whatever tensor the module holds at call time.
    on, off = _pair()
    params = list(on.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for mod in on.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            n = p.numel()
            delattr(mod, name)
            setattr(mod, name, flat[offset:offset + n].view_as(p))
            offset += n
    x, y = _batch(on.cfg.vocab_size)
    torch.testing.assert_close(on(x, y), off(x, y), atol=1e-5, rtol=1e-5)
    flat.mul_(0.5)  # the model follows the buffer's new contents
    assert not torch.allclose(on(x, y), off(x, y))
