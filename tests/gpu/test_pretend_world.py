"""train.py as one rank of a pretend world on the GPU (AMSP_PRETEND_WORLD, amsp/launch.py).

The data plane is torch's fake backend on CUDA ("cuda:fake": collectives return at once and, like
NCCL, refuse CPU tensors) and the control plane "cpu:fake", so every N-rank code path (plan, groups,
both planes, validation, checkpoint) runs on one device. A control value sent to the data plane as a
CPU tensor fails here as it would on a real multi-GPU run; the routing checker is on as well.
The CPU twin is tests/amsp/test_routing.py::test_pretend_world_runs_train_py_in_one_cpu_process.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.training.runs import losses, train


@pytest.mark.gpu
# world 2 leaves model.compile at auto: rank 0 times a block eager and compiled (amsp/compile_choice.py) and
# every rank takes its choice; the worlds of 8 compile as named, not to measure the same block twice more.
@pytest.mark.parametrize("world, plan, extra", [(2, "auto", ()), (8, "zero3", ("model.compile=on",)),
                                                # the update overlapped with the forward, gathered spreads
                                                (8, "zero1", ("amsp.overlap_update=true", "model.compile=on"))])
def test_pretend_world_trains_on_cuda(tmp_path, monkeypatch, world, plan, extra):
    monkeypatch.setenv("AMSP_PRETEND_WORLD", str(world))
    monkeypatch.setenv("AMSP_CHECK_ROUTING", "1")
    monkeypatch.setenv("AMSP_CACHE_DIR", str(tmp_path / "cache"))  # the fake probe caches nothing shared
    run = tmp_path / f"pretend{world}"
    # 16 samples a step and a validation pass: whole rounds of 2-sample micro-batches on 8 ranks.
    proc = train(run, "trainer.device=cuda", "trainer.max_steps=4", "trainer.val_interval=2",
                 "trainer.val_samples=16", "trainer.global_batch_size=16", f"amsp.plan={plan}", *extra, timeout=600)
    out = proc.stdout + proc.stderr
    assert "data plane cuda:fake (cuda tensors), control plane cpu:fake" in out, out[-3000:]
    assert f"rank 0 of {world} on the fake backend" in out and "routing check on" in out, out[-3000:]
    assert len(re.findall(r"\| loss ", proc.stdout)) == 4, proc.stdout[-3000:]  # one log line a step
    assert sorted(losses(run)) == [1, 2, 3, 4]
    if world == 2:  # measured on rank 0, taken by all
        assert "model.compile=auto: one block forward + backward" in out, out[-3000:]
    val = {json.loads(line)["step"] for line in (run / "validation.jsonl").read_text().splitlines()}
    assert val == {2, 4}, val
