"""The tensor-parallel code path on CUDA with a world of one (the device machine lends one GPU): the
model made tensor-parallel over a 1-rank TP mesh (DTensor parameters on the GPU, loss_parallel) and run
by the AMSP engine trains the same losses as the plain model on the same GPU."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_tp_engine_on_cuda_world_of_one():
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    from amsp import control
    from amsp.engine import AMSPEngine, EngineOptions, ModelParts
    from amsp.parallel.mesh import ParallelMesh
    from amsp.parallel.tensor_parallel import parallelize_llama
    from amsp.plan import Degrees, Plan
    from models.llama import build_model, get_preset
    from models.llama.model import Llama
    from tests.distributed import free_port

    import datetime
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    control.setup(datetime.timedelta(seconds=60))
    try:
        cfg = get_preset("debug").with_overrides(fused="off")
        mesh = ParallelMesh(1, 1, tp=1)
        with torch.device("meta"):
            model = Llama(cfg)
        parallelize_llama(model, mesh.device_mesh("cuda")["tp"], sequence_parallel=True, loss_parallel=True,
                          seq_len=16)
        plan = Plan(Degrees(1, 1, 1), Degrees(1, 1, 1), name="test")
        eng = AMSPEngine(cfg, plan, mesh.dp_topology(0), 0, seed=3, device="cuda", mesh=mesh,
                         parts=ModelParts(model, loss_context=loss_parallel), options=EngineOptions(precision="fp32"))
        assert all(type(u.param(s)).__name__ == "DTensor" for u in eng.units for s in u.slots)
        ref = build_model(cfg, device="cuda", seed=3)
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
        first = eng.forward_backward(x, y, 0, 1).item()
        assert first == pytest.approx(ref(x.cuda(), y.cuda()).item(), rel=1e-5)
        eng.step(1e-3)
        assert eng.evaluate(x, y).item() < first
    finally:
        dist.destroy_process_group()
