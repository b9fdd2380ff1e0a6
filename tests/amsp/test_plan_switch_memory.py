"""What a plan switch (amsp/replan_switch.py) does besides the recheck: the old engine's memory goes back
before the new engine is built, and a resumed run continues on the plan it switched to."""
from __future__ import annotations

import json

import pytest
import torch

from amsp.engine import AMSPEngine
from amsp.plan import Degrees, Plan
from amsp.replan_switch import plan_after_switch
from amsp.topology import Topology
from models.llama import get_preset


def _held_bytes(eng) -> int:
    return sum(t.untyped_storage().nbytes() for u in eng.units
               for t in (u.p_shard, u.g_shard, u.master, u.exp_avg, u.exp_avg_sq, u.full))


def test_release_gives_the_engine_memory_back_while_references_remain():
    cfg = get_preset("debug")
    eng = AMSPEngine(cfg, Plan(Degrees(1, 1, 1), Degrees(1, 1, 1)), Topology(1, 1), 0)
    params = list(eng.model.parameters())  # what a caller, runner or NaN injector still holds
    x = torch.randint(0, cfg.vocab_size, (2, 17))
    eng.forward_backward(x[:, :-1], x[:, 1:], 0, 1)
    with pytest.raises(RuntimeError, match="middle of a step"):
        eng.release()
    eng.step(1e-3)
    assert _held_bytes(eng) > 4 * cfg.num_params()  # the fp32 weights, moments and gradient shards
    eng.release()
    assert _held_bytes(eng) == 0 and all(p.untyped_storage().nbytes() == 0 for p in params if p.numel())
    with pytest.raises(RuntimeError, match="released"):
        eng.forward_backward(x[:, :-1], x[:, 1:], 0, 1)


def test_a_checkpoint_save_leaves_the_engine_buffers_releasable():
    """A switch releases right after saving a checkpoint, whose writer aliases each fragment's bytes and
    whose checksum hashes them. Through Tensor.numpy() both marked the flat buffers' storages
    non-resizable for good, and the release failed ("Trying to resize storage that is not resizable",
    the first switch on the emulated cluster)."""
    from amsp.checkpoint import _own_storage_alias
    from amsp.checkpoint_verify import digest

    cfg = get_preset("debug")
    eng = AMSPEngine(cfg, Plan(Degrees(1, 1, 1), Degrees(1, 1, 1)), Topology(1, 1), 0)
    x = torch.randint(0, cfg.vocab_size, (2, 17))
    eng.forward_backward(x[:, :-1], x[:, 1:], 0, 1)
    eng.step(1e-3)
    for frag in eng.named_fragments():
        for t in (frag.master, frag.exp_avg, frag.exp_avg_sq):  # what a save writes and hashes
            alias = _own_storage_alias(t.detach())
            assert digest(alias) == digest(t.detach().clone())  # the same bytes
    eng.release()
    assert _held_bytes(eng) == 0


def _run_dir(tmp_path, latest_step: int, world: int, switched_at: int = 4):
    ckpt = tmp_path / "checkpoints"
    name = f"step_{latest_step:08d}"
    (ckpt / name).mkdir(parents=True)
    # The checkpoint's plan is the one switched to: a run whose checkpoint has another did not make this switch.
    plan = "auto (blocks p/g/os = 1/2/4, embedding+head = 1/1/4)"
    (ckpt / name / "meta.json").write_text(json.dumps({"world_size": world, "plan": plan}))
    (ckpt / "latest").write_text(name)
    to = {"p": 1, "g": 2, "os": 4, "embed_head_p": 1, "embed_head_g": 1, "embed_head_os": 4}
    (tmp_path / "replan.json").write_text(json.dumps([
        {"switch": False, "reason": "first"},
        {"switch": True, "reason": "zero2-like predicted 12% faster", "switched_at_step": switched_at,
         "to": plan, "to_degrees": to}]))
    return tmp_path


def test_a_resumed_run_continues_on_the_plan_it_switched_to(tmp_path):
    topo = Topology(4, 2)
    got = plan_after_switch(_run_dir(tmp_path / "a", latest_step=6, world=4), topo, 4)
    assert got is not None
    plan, why, step = got
    assert (plan.blocks, plan.embed_head, plan.name) == (Degrees(1, 2, 4), Degrees(1, 1, 4), "auto")
    assert step == 4 and "switched to it at step 4" in why and "12% faster" in why
    # the latest checkpoint predates the switch, another world wrote it, or nothing was recorded
    assert plan_after_switch(_run_dir(tmp_path / "b", latest_step=3, world=4), topo, 4) is None
    assert plan_after_switch(_run_dir(tmp_path / "c", latest_step=6, world=8), topo, 4) is None
    assert plan_after_switch(tmp_path / "empty", topo, 4) is None
    # a recorded plan that breaks this world's rules leaves the startup's plan in place
    assert plan_after_switch(_run_dir(tmp_path / "d", latest_step=6, world=4), Topology(4, 4), 4) is not None
    assert plan_after_switch(_run_dir(tmp_path / "e", latest_step=6, world=3), Topology(3, 3), 3) is None
