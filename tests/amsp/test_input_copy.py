"""The engine copies each micro-batch's tokens and targets to its device without blocking the host
(amsp/engine.py to_device): on CUDA a blocking copy waits for the stream twice per micro-batch. On CPU
the copy is a no-op, so what is checked here is the request; tests/gpu/test_input_copy_cuda.py checks that
the copy of a loader's pinned batch does not synchronise."""
import torch

from amsp import engine as engine_mod
from amsp.engine import AMSPEngine, EngineOptions
from amsp.plan import Degrees, Plan
from amsp.topology import Topology
from models.llama import get_preset


def test_micro_batches_and_validation_batches_are_copied_non_blocking(monkeypatch):
    cfg = get_preset("debug").with_overrides(fused="off")
    eng = AMSPEngine(cfg, Plan(Degrees(1, 1, 1), Degrees(1, 1, 1)), Topology(1, 1), 0, seed=0,
                     options=EngineOptions(precision="fp32"))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
    calls = []
    original = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        if self.dtype == torch.int64:  # the batch tensors (the model moves nothing else of that type)
            calls.append((self.data_ptr(), kwargs.get("non_blocking", False)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    eng.forward_backward(x, y, 0, 1)
    eng.step(1e-3)
    eng.evaluate(x, y)
    batch_calls = [nb for ptr, nb in calls if ptr in (x.data_ptr(), y.data_ptr())]
    assert batch_calls == [True] * 4, calls  # tokens and targets, training and validation


def test_to_device_leaves_a_cpu_batch_in_place():
    t = torch.arange(6).view(2, 3)
    assert engine_mod.to_device(t, torch.device("cpu")) is t
