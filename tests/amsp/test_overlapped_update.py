"""The optimizer update deferred to the next forward (EngineOptions.overlap_update): the same numbers
as the update in step(), bit for bit, through evaluation, checkpoint reads, a skipped step and release.
On CPU there is no side stream, so this holds the ordering; the overlap itself is measured on a GPU
(scripts/bench/bench_gpu_vs_hf.py)."""
from __future__ import annotations

import pytest
import torch

import amsp_cases as C
from amsp.engine import AMSPEngine, EngineOptions
from amsp.plan import Degrees, Plan
from amsp.topology import Topology


def _engine(precision: str, overlap_update: bool) -> AMSPEngine:
    deg = Degrees(1, 1, 1)
    opts = EngineOptions(precision=precision, overlap_update=overlap_update, optim=C.SETTINGS)
    return AMSPEngine(C.model_cfg(), Plan(deg, deg, name="test"), Topology(1, 1), 0, seed=C.SEED, options=opts)


def _micro_batches(eng: AMSPEngine, step: int) -> list[float]:
    return [eng.forward_backward(*C.micro_batch(step, m, 0), m, C.MICRO).item() for m in range(C.MICRO)]


def _state(eng: AMSPEngine) -> dict:
    out = {f"{f.name}.{k}": getattr(f, k).clone() for f in eng.named_fragments() for k in f.STATE_KEYS}
    out.update({f"{u.name}.p_shard": u.p_shard.clone() for u in eng.units})
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deferred_update_equals_the_update_in_step(precision):
    now, later = _engine(precision, False), _engine(precision, True)
    assert "deferred unit by unit" in later._updates.describe()
    val = C.micro_batch(99, 0, 0)
    for step in range(6):
        losses = [_micro_batches(e, step) for e in (now, later)]
        assert losses[0] == losses[1], f"step {step}: losses {losses}"
        if step == 3:  # a non-finite gradient: both skip, nothing is deferred, the next step recovers
            for e in (now, later):
                e.units[1].g_shard[0] = float("nan")
        results = [e.step(C.SCHEDULE(step)) for e in (now, later)]
        assert results[0].skipped == results[1].skipped == (step == 3)
        if step == 3:
            assert later._updates.pending == 0
            continue
        assert results[0].grad_norm == results[1].grad_norm
        # Deferred for real: past the spread window (whose spreads launch at once and take their units'
        # updates first) no master has moved yet, and those units still hold their OS gradients.
        waiting = later.units[later.options.spread_window:]
        assert later._updates.pending == len(waiting) > 0
        assert all(u.os_grad is not None for u in waiting)
        if step == 1:  # validation between steps takes every update through the forward's hooks
            assert torch.equal(now.evaluate(*val), later.evaluate(*val))
            assert later._updates.pending == 0 and all(u.os_grad is None for u in later.units)
        if step == 4:  # a checkpoint read completes the pending updates before it reads a master
            a, b = _state(now), _state(later)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "checkpoint state differs"
    a, b = _state(now), _state(later)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert now.optimizer_steps == later.optimizer_steps == 5
    # A plan switch releases the engine with updates still pending: they land first, then the memory goes.
    _micro_batches(later, 6)
    later.step(C.SCHEDULE(6))
    assert later._updates.pending == len(waiting)
    later.release()
    assert later._updates.pending == 0
