"""Pipeline parallelism (torch.distributed.pipelining) with AMSP on each stage's DP group equals
single-process training in fp32: PP x DP with 1F1B, GPipe, interleaved 1F1B and zero bubble, an uneven layer split,
PP x TP with sequence parallelism, and AMSP plans other than 1/1/1. One spawned 4-rank gloo group."""
from __future__ import annotations

import types
from contextlib import nullcontext

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed
SEED, MBS, SEQ, MICRO, STEPS = 7, 2, 16, 4, 3


def _cfg(n_layers: int, checkpointing: str = "none"):
    from models.llama import get_preset

    return get_preset("debug").with_overrides(n_layers=n_layers, activation_checkpointing=checkpointing)


def _batch(step: int, micro: int, data_rank: int, vocab: int):
    g = torch.Generator().manual_seed((SEED * 1000 + step) * 10000 + micro * 100 + data_rank)
    t = torch.randint(0, vocab, (MBS, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _settings(case: dict):
    """The tests' AdamW settings, with the case's eps where it names one."""
    from dataclasses import replace

    from tests.amsp.amsp_cases import SETTINGS

    return replace(SETTINGS, eps=case["eps"]) if "eps" in case else SETTINGS


def _reference(n_layers: int, dp: int, steps: int = STEPS, settings=None, checkpointing: str = "none") -> dict:
    from amsp.optim import param_groups
    from models.llama import build_model
    from tests.amsp.amsp_cases import SCHEDULE, SETTINGS

    settings = settings or SETTINGS

    cfg = _cfg(n_layers, checkpointing)
    model = build_model(cfg, seed=SEED)
    opt = torch.optim.AdamW(param_groups(model, settings.weight_decay), lr=SCHEDULE(0), betas=settings.betas,
                            eps=settings.eps, foreach=False)
    losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = SCHEDULE(step)
        total = 0.0
        for m in range(MICRO):
            xs, ys = zip(*(_batch(step, m, r, cfg.vocab_size) for r in range(dp)))
            loss = model(torch.cat(xs), torch.cat(ys))
            (loss / MICRO).backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / MICRO)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _run(rank: int, world: int, cases: list[dict]) -> list[dict]:
    from torch.distributed.tensor.parallel import loss_parallel

    from amsp import control
    from amsp.engine import AMSPEngine, EngineOptions
    from amsp.parallel.mesh import ParallelMesh
    from amsp.parallel.pipeline import PipelineRunner, stage_parts
    from amsp.parallel.tensor_parallel import parallelize_llama
    from amsp.plan import Degrees, Plan
    from models.llama.model import Llama
    from tests.amsp.amsp_cases import SCHEDULE, rel
    from tests.parallel.test_tp_engine import _max_abs_param_error, _param_error_parts, _worst_param_error

    torch.set_num_threads(1)
    out = []
    for case in cases:
        mesh = ParallelMesh(world, world, tp=case.get("tp", 1), pp=case["pp"])
        cfg = _cfg(case["layers"], case.get("checkpointing", "none"))
        pcfg = types.SimpleNamespace(schedule=case["schedule"], virtual_stages=case.get("v", 1),
                                     layer_split=case.get("split"), sequence_parallel=True, loss_parallel=True)
        with torch.device("meta"):
            model = Llama(cfg)
        ctx = nullcontext
        if mesh.tp > 1:
            parallelize_llama(model, mesh.device_mesh("cpu")["tp"], sequence_parallel=True, loss_parallel=True,
                              seq_len=SEQ)
            ctx = loss_parallel
        plan = Plan(Degrees(*case["blocks"]), Degrees(*case["blocks"]), name="test")
        eng = AMSPEngine(cfg, plan, mesh.dp_topology(rank), rank, seed=SEED, mesh=mesh,
                         parts=stage_parts(model, pcfg, mesh, rank, loss_context=ctx),
                         options=EngineOptions(precision="fp32", optim=_settings(case),
                                               overlap_update=case.get("update", False)))
        runner = PipelineRunner(eng, mesh, rank, pcfg, MICRO, SEQ, MBS) if mesh.pp > 1 else None
        data_rank = mesh.coords(rank).dp
        if case.get("fault") == "weight_pass_unreported":  # must be the last case: the ranks part ways here
            for st in runner.stages:
                st.amsp_weights_ready = lambda: None
            xs, ys = zip(*(_batch(0, m, data_rank, cfg.vocab_size) for m in range(MICRO)))
            try:
                runner.train_step(list(xs), list(ys))
                out.append({"case": case, "error": None})
            except RuntimeError as e:
                out.append({"case": case, "error": str(e)})
            return out
        steps = case.get("steps", STEPS)
        ref = _reference(case["layers"], mesh.dp, steps, _settings(case), case.get("checkpointing", "none"))
        loss_err = norm_err = 0.0
        for step in range(steps):
            xs, ys = zip(*(_batch(step, m, data_rank, cfg.vocab_size) for m in range(MICRO)))
            if runner is not None:
                total, count = runner.train_step(list(xs), list(ys))
            else:  # no pipeline: the engine runs the micro-batches itself
                total = sum(eng.forward_backward(x, y, m, MICRO).item() for m, (x, y) in enumerate(zip(xs, ys)))
                count = MICRO
            res = eng.step(SCHEDULE(step))
            total, count = control.all_reduce_sum_floats([total, float(count)])
            loss_err = max(loss_err, rel(total / count, ref["losses"][step]))
            norm_err = max(norm_err, rel(res.grad_norm, ref["norms"][step]))
        vx, vy = zip(*(_batch(99, m, data_rank, cfg.vocab_size) for m in range(MICRO)))
        held = runner.evaluate(list(vx), list(vy)) if runner is not None else \
            (sum(eng.evaluate(x, y).item() for x, y in zip(vx, vy)), MICRO)
        val, n = control.all_reduce_sum_floats([float(v) for v in held])
        out.append({"case": case, "loss_err": loss_err, "norm_err": norm_err, "val": val / max(n, 1),
                    "param_err": _worst_param_error(eng, ref["params"]),
                    "abs_err": _max_abs_param_error(eng, ref["params"]),
                    "param_parts": _param_error_parts(eng, ref["params"])})
    return out


def per_parameter_error(rank_parts: list[dict]) -> float:
    """Worst relative error of a whole parameter, norm(trained - reference) / norm(reference), over the
    union of every rank's shards (each global run counted once however many ranks hold it); the
    per-fragment figure (param_err) divides by a fragment's own norm, which a shard of a few small
    weights makes large."""
    runs: dict = {}
    for parts in rank_parts:
        runs.update(parts)
    diff2: dict = {}
    ref2: dict = {}
    for (name, _, _), (d2, r2) in runs.items():
        diff2[name] = diff2.get(name, 0.0) + d2
        ref2[name] = ref2.get(name, 0.0) + r2
    return max((diff2[n] / max(ref2[n], 1e-24)) ** 0.5 for n in diff2)


CASES = [
    {"pp": 2, "schedule": "1f1b", "layers": 4, "blocks": (2, 2, 2), "split": [1, 3]},  # PP x DP, zero3, uneven
    {"pp": 4, "schedule": "1f1b", "layers": 4, "blocks": (1, 1, 1)},  # PP alone
    {"pp": 2, "schedule": "interleaved", "v": 2, "layers": 4, "blocks": (1, 2, 2)},  # interleaved, zero2
    {"pp": 2, "schedule": "gpipe", "layers": 2, "blocks": (1, 1, 2)},  # GPipe, zero1
    {"pp": 2, "tp": 2, "schedule": "1f1b", "layers": 2, "blocks": (1, 1, 1)},  # PP x TP (+ SP)
    # The update deferred to each unit's next forward (amsp.overlap_update), under the schedules' own
    # forward order: virtual stages, and DTensor parameters.
    {"pp": 2, "schedule": "interleaved", "v": 2, "layers": 4, "blocks": (1, 2, 2), "update": True},
    {"pp": 2, "tp": 2, "schedule": "1f1b", "layers": 2, "blocks": (1, 1, 1), "update": True},
    # Zero bubble (torch's ScheduleInterleavedZeroBubble): each backward split into an input-gradient pass
    # and a deferred weight pass whose gradients reach the engine through weight_grads_ready. Zero3 with
    # recomputation and an uneven split (the weight pass re-gathers), two chunks per rank with the
    # overlapped update, and TP.
    {"pp": 2, "schedule": "zero_bubble", "layers": 4, "blocks": (2, 2, 2), "split": [1, 3], "checkpointing": "full"},
    {"pp": 2, "schedule": "zero_bubble", "v": 2, "layers": 4, "blocks": (1, 2, 2), "update": True},
    {"pp": 2, "tp": 2, "schedule": "zero_bubble", "layers": 2, "blocks": (1, 1, 1)},
    # Last: a weight pass the engine is not told about leaves the chunk without gradients, and the step says so.
    {"pp": 2, "schedule": "zero_bubble", "layers": 2, "blocks": (1, 1, 1), "fault": "weight_pass_unreported"},
]


def test_pp_dp_and_pp_tp_equal_single_process():
    results = run_distributed(_run, 4, CASES, timeout=400)
    for rank_results in results:
        for r in rank_results:
            if "fault" in r["case"]:
                continue
            assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
            assert 0 < r["val"] < 20, r
    # the unreported weight pass: the ranks of the second stage (whose weight gradients torch assigns
    # itself) refuse the step; the first stage's weight pass is a full backward and its hooks fire
    errors = [rank_results[-1]["error"] for rank_results in results]
    assert errors[:2] == [None, None], errors
    assert all("expected 4 each" in (e or "") for e in errors[2:]), errors


LAYOUTS_8 = [  # the acceptance shape: 8 ranks, 20 steps, AMSP plans other than 1/1/1
    {"tp": 2, "pp": 1, "schedule": "1f1b", "layers": 4, "blocks": (4, 4, 4), "steps": 20},  # TP x DP (zero3)
    {"pp": 2, "schedule": "1f1b", "layers": 4, "blocks": (2, 4, 4), "steps": 20},  # PP x DP
    {"tp": 2, "pp": 2, "schedule": "1f1b", "layers": 4, "blocks": (1, 2, 2), "steps": 20},  # TP x PP x DP (zero2)
    {"tp": 2, "pp": 2, "schedule": "zero_bubble", "layers": 4, "blocks": (2, 2, 2), "steps": 20},  # the same, ZB1P, zero3
]
# Each layout twice: with AdamW's eps at 1e-6 and at the default 1e-8. Below eps an element's update is
# lr * g / eps, so a gradient that is itself a cancellation of much larger terms (2e-9 here) carries its
# rounding into the update. At 1e-8 that is fp32's floor on this data, above 1e-5: the single-process
# reference against itself, the same rows fed as one batch of 8 or as four of 2, differs by 1.55e-5
# (layers.0.feed_forward.w2 after one step) and 9.6e-6 after 20. At 1e-6 the same runs agree to a few
# 1e-6, so there the 1e-5 is asserted as it stands.
EIGHT_RANK_CASES = [{**c, "eps": eps} for eps in (1e-6, 1e-8) for c in LAYOUTS_8]
PARAM_TOLERANCE = {1e-6: 1e-5, 1e-8: 3e-5}


@pytest.mark.slow  # 8 spawned ranks on a small machine: about three minutes
def test_eight_ranks_tp_pp_dp_20_steps_equal_single_process():
    results = run_distributed(_run, 8, EIGHT_RANK_CASES, timeout=900)
    keys = ("loss_err", "norm_err", "param_err", "abs_err")
    worst = [{**{k: max(rank[i][k] for rank in results) for k in keys},
              "per_param_err": per_parameter_error([rank[i]["param_parts"] for rank in results])}
             for i in range(len(EIGHT_RANK_CASES))]
    for case, w in zip(EIGHT_RANK_CASES, worst):
        print(f"8 ranks, 20 steps, tp {case.get('tp', 1)} pp {case['pp']} {case['schedule']} eps {case['eps']:g}, "
              f"worst over ranks:",
              {k: f"{v:.2g}" for k, v in w.items()})
    for case, w in zip(EIGHT_RANK_CASES, worst):
        # Losses within 1e-5 (measured: about 1e-7). Parameters, relative per whole parameter
        # (per_param_err), per fragment (param_err) and elementwise absolute (abs_err): 1e-5 at eps 1e-6
        # (measured 1e-6 to 4e-6); at eps 1e-8, 3e-5 (measured 1.2e-5 to 2.5e-5, the same tensor also with
        # plan 1/1/1). A dropped shard or a double-counted copy is off by far more
        # (tests/parallel/test_tp_engine.py). Gradient norm 1e-4.
        tol = PARAM_TOLERANCE[case["eps"]]
        assert w["loss_err"] <= 1e-5 and w["norm_err"] <= 1e-4, (case, w)
        assert max(w["per_param_err"], w["param_err"], w["abs_err"]) <= tol, (case, w)
