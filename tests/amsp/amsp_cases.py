"""Shared pieces of the AMSP engine tests: deterministic data, the single-process reference, and
the per-rank loop that runs many plans inside one spawned group (spawning costs seconds a rank)."""
from __future__ import annotations

import time

import torch

from amsp import control
from amsp.engine import AMSPEngine, EngineOptions
from amsp.optim import WarmupCosine, param_groups
from amsp.plan import Degrees, Plan
from amsp.schedule import step_collectives, totals
from amsp.sharded_optim import AdamWSettings
from amsp.topology import Topology
from models.llama import build_model, get_preset

SEED = 7
MICRO = 2
MBS = 2
SEQ = 16
SETTINGS = AdamWSettings(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
SCHEDULE = WarmupCosine(lr=3e-3, min_lr=3e-4, warmup_steps=4, decay_steps=20)


def model_cfg(checkpointing: str = "none", tie: bool = False):
    return get_preset("debug").with_overrides(activation_checkpointing=checkpointing, tie_embeddings=tie)


def micro_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(((SEED * 1000 + step) * 100 + micro) * 1000 + rank)
    t = torch.randint(0, model_cfg().vocab_size, (MBS, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def reference(world: int, steps: int, snapshots: tuple[int, ...], tie: bool = False) -> dict:
    """Plain single-process training on the same global batch: torch AdamW + clip_grad_norm_."""
    torch.manual_seed(0)
    model = build_model(model_cfg(tie=tie), seed=SEED)
    opt = torch.optim.AdamW(param_groups(model, SETTINGS.weight_decay), lr=SCHEDULE(0), betas=SETTINGS.betas,
                            eps=SETTINGS.eps, foreach=False)
    losses, norms, params = [], [], {}
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = SCHEDULE(step)
        total = 0.0
        for m in range(MICRO):
            xs, ys = zip(*(micro_batch(step, m, r) for r in range(world)))
            loss = model(torch.cat(xs), torch.cat(ys))
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        # The norm in float64 (torch's fp32 one is ~1e-5 off over a large vocabulary's head on CPU); the clip
        # itself is torch's, whose scale that error does not move.
        norms.append(torch.stack([p.grad.double().norm() for p in model.parameters()]).norm().item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), SETTINGS.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if step + 1 in snapshots:
            params[step + 1] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def check_params(eng: AMSPEngine, ref_params: dict, tol: float, where: str) -> float:
    """This rank's fp32 master fragments and its compute shard against the reference weights."""
    worst = 0.0
    for f in eng.named_fragments():
        want = ref_params[f.name].reshape(-1)[f.start:f.end]
        err = ((f.master - want).norm() / want.norm().clamp_min(1e-12)).item()
        worst = max(worst, err)
        assert err <= tol, f"{where}: master of {f.name}[{f.start}:{f.end}] rel err {err:.2e}"
    for u in eng.units:
        flat = torch.zeros(u.layout.padded)
        for s in u.slots:
            flat[s.offset:s.offset + s.numel] = ref_params[s.name].reshape(-1)
        lo, hi = u.layout.p_range(eng.rank)
        err = ((u.p_shard.float() - flat[lo:hi]).norm() / flat[lo:hi].norm().clamp_min(1e-12)).item()
        worst = max(worst, err)
        assert err <= tol, f"{where}: compute shard of unit {u.name} rel err {err:.2e}"
    return worst


def expected_resident(eng: AMSPEngine) -> int:
    pb, ob = eng.precision.param_bytes, eng.precision.optim_bytes
    return sum(u.layout.padded * pb // u.deg.p + 4 * u.layout.padded // u.deg.g + ob * u.layout.padded // u.deg.os
               for u in eng.units)


def run_case(rank: int, world: int, topo: Topology, case: dict, ref: dict) -> dict:
    blocks, embed_head = Degrees(*case["blocks"]), Degrees(*case.get("embed_head", case["blocks"]))
    plan = Plan(blocks, embed_head, name="test")
    opts = EngineOptions(precision=case.get("precision", "fp32"), overlap_spread=case.get("overlap", False),
                         overlap_update=case.get("update", False), prefetch=case.get("prefetch", True),
                         fuse_wgrad=case.get("fuse", False), optimizer_kernel=case.get("kernel", "auto"),
                         optim=SETTINGS)
    eng = AMSPEngine(model_cfg(case.get("ckpt", "none"), case.get("tie", False)), plan, topo, rank, seed=SEED,
                     options=opts)
    ref = ref["tied" if case.get("tie") else "untied"]
    where = f"rank {rank} plan {blocks}|{embed_head} {case}"
    mem = eng.resident_bytes()["total"]
    assert mem == expected_resident(eng), f"{where}: resident {mem} != formula {expected_resident(eng)}"
    want_bytes = totals(step_collectives(eng.schedule_units(), eng.degrees_of(), topo, MICRO, eng.precision))
    tol = case.get("tol", 1e-5)
    t0 = time.perf_counter()
    worst = 0.0
    step_losses = torch.zeros(case["steps"], dtype=torch.float64)
    for step in range(case["steps"]):
        losses = [eng.forward_backward(*micro_batch(step, m, rank), m, MICRO).item() for m in range(MICRO)]
        res = eng.step(SCHEDULE(step))
        assert not res.skipped
        got = eng.comm_stats().bytes
        assert dict(got) == dict(want_bytes), f"{where} step {step}: bytes {dict(got)} != schedule {dict(want_bytes)}"
        step_losses[step] = sum(losses) / MICRO
        worst = max(worst, rel(res.grad_norm, ref["norms"][step]))
        assert rel(res.grad_norm, ref["norms"][step]) <= tol, \
            f"{where} step {step}: grad norm {res.grad_norm} vs {ref['norms'][step]}"
    for u in eng.units:  # between steps nothing but the shards is resident: no gathered weights, no grads
        assert u.deg.p == 1 or u.full.untyped_storage().nbytes() == 0, f"{where}: {u.name} still gathered"
        assert all(u.param(s).grad is None for s in u.slots), f"{where}: {u.name} keeps parameter grads"
    # one control-plane collective for all steps: the global mean loss per step
    step_losses = torch.tensor(control.all_reduce_sum_floats(step_losses.tolist()), dtype=torch.float64)
    for step, loss in enumerate((step_losses / world).tolist()):
        worst = max(worst, rel(loss, ref["losses"][step]))
        assert rel(loss, ref["losses"][step]) <= tol, f"{where} step {step}: loss {loss} vs {ref['losses'][step]}"
    worst = max(worst, check_params(eng, ref["params"][case["steps"]], tol, where))
    return {"case": case, "worst_rel": worst, "seconds": time.perf_counter() - t0, "resident": mem}


def run_cases(rank: int, world: int, ranks_per_node: int, cases: list[dict], ref: dict) -> list[dict]:
    torch.set_num_threads(1)
    topo = Topology(world, ranks_per_node)
    out = []
    for c in cases:
        if c.get("reload"):
            out.append({"case": c, "held": reload_case(rank, world, ranks_per_node, c["blocks"], c["steps"])})
        else:
            out.append(run_case(rank, world, topo, c, ref))
    return out


def reload_case(rank: int, world: int, ranks_per_node: int, blocks: tuple, steps: int) -> float:
    """Train, copy every fragment into a fresh engine, then take one more step on both: the
    restored engine must match the original exactly (master, moments, step count, compute weights)."""
    torch.set_num_threads(1)
    topo = Topology(world, ranks_per_node)
    plan = Plan(Degrees(*blocks), Degrees(*blocks), name="test")
    opts = EngineOptions(precision="fp32", overlap_spread=True, optim=SETTINGS)
    a = AMSPEngine(model_cfg(), plan, topo, rank, seed=SEED, options=opts)
    for step in range(steps):
        for m in range(MICRO):
            a.forward_backward(*micro_batch(step, m, rank), m, MICRO)
        a.step(SCHEDULE(step))
    saved = {f.name: {k: getattr(f, k).clone() for k in f.STATE_KEYS} for f in a.named_fragments()}
    b = AMSPEngine(model_cfg(), plan, topo, rank, seed=SEED + 1, options=opts)
    b.load_fragments(saved, a.optimizer_steps)
    for ua, ub in zip(a.units, b.units):
        assert torch.equal(ua.p_shard, ub.p_shard), f"rank {rank}: reloaded compute shard of {ua.name} differs"
    for eng in (a, b):
        for m in range(MICRO):
            eng.forward_backward(*micro_batch(steps, m, rank), m, MICRO)
        eng.step(SCHEDULE(steps))
    for fa, fb in zip(a.named_fragments(), b.named_fragments()):
        for k in fa.STATE_KEYS:
            assert torch.equal(getattr(fa, k), getattr(fb, k)), f"rank {rank}: {fa.name}.{k} differs after reload"
    return sum(f.end - f.start for f in a.named_fragments() if f.primary)
