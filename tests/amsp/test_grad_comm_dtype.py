"""fp32 compute with bf16 gradient traffic: bytes follow the schedule, training follows fp32 closely."""
import pytest
import torch

from amsp.engine import AMSPEngine, EngineOptions
from amsp.plan import make_plan
from amsp.schedule import Precision, step_collectives, totals
from amsp.topology import Topology
from models.llama import get_preset
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _train(rank, world, grad_comm):
    torch.manual_seed(0)
    cfg = get_preset("debug").with_overrides(fused="off")
    topo = Topology(world, 2)
    plan = make_plan("zero2", world, 2)
    eng = AMSPEngine(cfg, plan, topo, rank, seed=3, options=EngineOptions(precision="fp32", grad_comm=grad_comm))
    gen = torch.Generator().manual_seed(100 + rank)
    losses, stats = [], None
    for step in range(4):
        for micro in range(2):
            x = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
            losses.append(eng.forward_backward(x, x, micro, 2).item())
        eng.step(1e-3)
        stats = eng.comm_stats()
    grad_bytes = 2 if grad_comm == "bf16" else 4
    expect = totals(step_collectives(eng.schedule_units(), eng.degrees_of(), topo, 2, Precision(4, grad_bytes)))
    return losses, dict(stats.bytes), dict(expect), str(eng.grad_dtype)


def _both(rank, world):
    return _train(rank, world, "fp32"), _train(rank, world, "bf16")


def test_bf16_gradient_traffic_with_fp32_compute():
    for (l32, _, _, d32), (l16, stats, expect, d16) in run_distributed(_both, 4):
        assert d32 == "torch.float32" and d16 == "torch.bfloat16"
        assert max(abs(a - b) for a, b in zip(l32, l16)) < 2e-2
        assert stats == expect
