"""Tensor (+ sequence) parallelism under the AMSP engine equals single-process training (fp32).

One spawned 4-rank gloo group runs every case: TP x DP with AMSP plans other than 1/1/1 on the DP
group, sequence parallelism on and off, tied embeddings, GQA (the debug preset: 4 query / 2 kv heads).
Each DP rank feeds its own micro-batches and both ranks of a TP group the same ones, so the reference
is amsp_cases.reference() over dp data ranks. A last case counts the TP-replicated gradient copies on
every TP rank (the bug the engine's norm_counted prevents) and must miss the reference's norm. The
joint planner's startup timing of the TP units (amsp/parallel/tp_profile.py) runs in the same group.
"""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from tests.amsp.amsp_cases import MICRO, SCHEDULE, SEED, SETTINGS, micro_batch, model_cfg, reference, rel
from amsp.checkpoint import CheckpointManager
from amsp.planner.startup import kernels_for_model
from amsp.planner.workload import Workload
from amsp.schedule import Precision
from amsp.train_state import load_training_state, save_training_state
from models.llama.config import get_preset
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed
STEPS = 3


def _engine(rank: int, world: int, case: dict):
    from torch.distributed.tensor.parallel import loss_parallel

    from amsp.engine import AMSPEngine, EngineOptions, ModelParts
    from amsp.parallel.mesh import ParallelMesh
    from amsp.parallel.tensor_parallel import parallelize_llama
    from amsp.plan import Degrees, Plan
    from amsp.topology import Topology
    from models.llama.model import Llama

    mesh = ParallelMesh(world, world, tp=case["tp"])
    cfg = model_cfg(tie=case.get("tie", False))
    if case["tp"] == 1:  # data parallelism alone: the engine builds the model itself
        plan = Plan(Degrees(*case["blocks"]), Degrees(*case["blocks"]), name="test")
        return AMSPEngine(cfg, plan, Topology(world, world), rank, seed=SEED,
                          options=EngineOptions(precision="fp32", optim=SETTINGS)), mesh
    with torch.device("meta"):
        model = Llama(cfg)
    parallelize_llama(model, case["device_mesh"]["tp"], sequence_parallel=case["sp"], loss_parallel=True, seq_len=16)
    plan = Plan(Degrees(*case["blocks"]), Degrees(*case["blocks"]), name="test")
    eng = AMSPEngine(cfg, plan, mesh.dp_topology(rank), rank, seed=SEED, mesh=mesh,
                     parts=ModelParts(model, loss_context=loss_parallel),
                     options=EngineOptions(precision="fp32", optim=SETTINGS))
    return eng, mesh


def _count_replicated_copies_everywhere(eng) -> None:
    """The fault: every TP rank's copy of a replicated parameter counted in the norm."""
    from amsp.sharded_optim import _segments

    opt = eng.optim
    opt._norm_runs = [_segments(u.layout.chunk, []) for u in eng.units]
    opt._inv_replicas = torch.tensor([1.0 / u.replicas for u in eng.units])


def _save_format1(mgr, eng, step: int) -> None:
    """A checkpoint as format 1 wrote it: every entry flattened to 1-D (users' existing checkpoints)."""
    from amsp.checkpoint import Fragment
    from amsp.train_state import _KEYS, rng_tensors

    frags = [Fragment(f"{prefix}.{f.name}", f.numel, f.start, getattr(f, attr), f.primary)
             for f in eng.named_fragments() for prefix, attr in _KEYS]
    mgr.save(step, frags, rng_tensors(), {"optimizer_steps": eng.optimizer_steps}, "{}\n")


def _fragment_pairs(eng, ref_params: dict):
    """(trained fp32 master fragment, reference values at the fragment's global positions) for every
    fragment this rank holds."""
    slots = {s.name: s for u in eng.units for s in u.slots}
    for f in eng.named_fragments():
        full, tp = ref_params[f.name].reshape(-1), slots[f.name].tp
        runs = [(f.start, f.start, f.end - f.start)] if tp is None else tp.global_runs(f.start, f.end)
        yield f.master, torch.cat([full[g:g + n] for _, g, n in runs])


def _worst_param_error(eng, ref_params: dict) -> float:
    """Worst relative error (norm of the difference over the norm of the reference, per fragment, as
    tests/amsp/amsp_cases.check_params measures it) of this rank's fp32 master fragments against the
    reference at the fragments' global positions."""
    return max([((got - want).norm() / want.norm().clamp_min(1e-12)).item()
                for got, want in _fragment_pairs(eng, ref_params)], default=0.0)


def _max_abs_param_error(eng, ref_params: dict) -> float:
    """Largest elementwise |trained - reference| over this rank's fragments (the absolute reading of
    "parameters within 1e-5", beside the relative one above)."""
    return max([(got - want).abs().max().item() for got, want in _fragment_pairs(eng, ref_params)
                if got.numel()], default=0.0)


def _param_error_parts(eng, ref_params: dict) -> dict:
    """This rank's squared error and squared reference norm per run of global positions, keyed by
    (parameter, global start, length) so that merging the ranks' dicts counts a replicated shard once
    (tests/parallel/test_pp_engine.per_parameter_error combines them per parameter)."""
    slots = {s.name: s for u in eng.units for s in u.slots}
    out = {}
    for f in eng.named_fragments():
        full, tp = ref_params[f.name].reshape(-1), slots[f.name].tp
        runs = [(f.start, f.start, f.end - f.start)] if tp is None else tp.global_runs(f.start, f.end)
        pos = 0
        for _, g, n in runs:
            got, want = f.master[pos:pos + n], full[g:g + n]
            out[(f.name, g, n)] = ((got - want).double().pow(2).sum().item(), want.double().pow(2).sum().item())
            pos += n
    return out


def _run(rank: int, world: int, cases: list[dict]) -> list[dict]:
    from amsp import control
    from amsp.parallel.mesh import ParallelMesh

    torch.set_num_threads(1)
    out, meshes = [], {}
    for case in cases:
        tp = case["tp"]
        if tp not in meshes and tp > 1:  # DeviceMesh creation is collective: once per shape
            meshes[tp] = ParallelMesh(world, world, tp=tp).device_mesh("cpu")
        if case.get("profile"):  # the joint planner's startup timing of TP units on real TP groups
            from amsp.parallel.tp_profile import measure_tp_units

            t = measure_tp_units(model_cfg(tie=case.get("tie", False)), 16, 2, "fp32", "cpu", tp, world, repeats=1)
            out.append({"case": case, "times": (t.block_s, t.head_s, t.embedding_s)})
            continue
        if case.get("te"):  # Transformer Engine kernels under TP, with stand-ins that check what TE needs
            out.append({"case": case, **_te_under_tp(meshes[tp]["tp"], case["sp"])})
            continue
        if case.get("timeouts"):  # every group this rank is in, the mesh's included, has the run's timeout
            from amsp.parallel.mesh import ParallelMesh

            ParallelMesh(world, 2, tp=2, pp=2).device_mesh("cpu")  # all three dims < world: new groups
            out.append({"case": case, "timeouts": _group_timeouts(), "want": control.collective_timeout()})
            continue
        if case.get("embedding_grad"):  # the vocabulary-parallel table's gradient: this rank's rows only
            from amsp.parallel.tensor_parallel import parallelize_llama
            from amsp.routing_check import data_plane
            from models.llama.model import Llama

            with torch.device("meta"):
                model = Llama(model_cfg())
            parallelize_llama(model, meshes[tp]["tp"], sequence_parallel=True, loss_parallel=True, seq_len=16)
            model.to_empty(device="cpu")
            seen = {}
            model.tok_embeddings.weight.register_post_accumulate_grad_hook(
                lambda p: seen.update(placements=str(p.grad.placements), shape=tuple(p.grad.to_local().shape)))
            with data_plane():
                model.tok_embeddings(torch.randint(0, model_cfg().vocab_size, (2, 16))).sum().backward()
            out.append({"case": case, **seen})
            continue
        if case.get("saved"):  # what autograd keeps for one TP block's forward (the planner's layer term)
            from amsp.parallel.tensor_parallel import parallelize_llama
            from amsp.routing_check import data_plane
            from models.llama.model import Llama
            from tests.planner.planner_cases import saved_activation_bytes

            torch.manual_seed(0)
            model = Llama(model_cfg().with_overrides(max_seq_len=64))
            parallelize_llama(model, meshes[tp]["tp"], sequence_parallel=True, loss_parallel=True, seq_len=64)
            with data_plane():
                out.append({"case": case, "bytes": saved_activation_bytes(model, 2, 64, tp=tp)})
            continue
        if case.get("kept"):  # resident set a forward keeps per block, with and without selective recompute
            from amsp.parallel.tensor_parallel import parallelize_llama
            from amsp.routing_check import data_plane
            from models.llama.model import Llama
            from tests.planner.planner_cases import kept_per_layer_bytes

            kept = {}
            for layout in (1, tp):
                for mode in ("none", "selective"):
                    torch.manual_seed(0)
                    model = Llama(KEPT_MODEL.with_overrides(activation_checkpointing=mode))
                    if layout > 1:
                        parallelize_llama(model, meshes[tp]["tp"], sequence_parallel=True, loss_parallel=True,
                                          seq_len=KEPT_SEQ)
                    with data_plane():
                        kept[(layout, mode)] = kept_per_layer_bytes(model, 2, KEPT_SEQ, tp=layout)
                    del model
            out.append({"case": case, "kept": kept})
            continue
        if case.get("profile_cache"):  # parallel.auto's startup: measured once, then read from its cache
            from amsp.launch import DistEnv
            from amsp.parallel.joint_startup import measured_tp_units
            from amsp.planner.__main__ import compose_config
            from configs.schema import to_llama_config

            cfg = compose_config(["model=debug", "data.seq_len=16", "trainer.micro_batch_size=2",
                                  "amsp.ranks_per_node=2", f"amsp.planner.cache_dir={case['profile_cache']}"])
            denv = DistEnv(rank, world, rank % 2, 2, "test")
            first = measured_tp_units(cfg, to_llama_config(cfg.model), denv, "cpu")
            again = measured_tp_units(cfg, to_llama_config(cfg.model), denv, "cpu")
            # a mixed cluster's two node groups: each keeps its own ranks' times, cached apart from the above
            groups = ["fast", "fast", "slow", "slow"]
            by_group = measured_tp_units(cfg, to_llama_config(cfg.model), denv, "cpu", groups)
            by_group_again = measured_tp_units(cfg, to_llama_config(cfg.model), denv, "cpu", groups)
            out.append({"case": case, "first": first, "again": again, "by_group": by_group,
                        "by_group_again": by_group_again})
            continue
        eng, mesh = _engine(rank, world, {**case, "device_mesh": meshes.get(tp)})
        if case.get("fault"):
            _count_replicated_copies_everywhere(eng)
        dp_index = mesh.coords(rank).dp
        ref = reference(mesh.dp, STEPS, (STEPS,), tie=case.get("tie", False))
        losses, norm_err = [], 0.0
        if "load" in case:  # a checkpoint of step STEPS - 1 written under another (tp, dp, plan)
            mgr = CheckpointManager(case["load"])
            load_training_state(mgr, mgr.latest(), eng)
            saved = reference(case["saved_dp"], STEPS - 1, (STEPS - 1,), tie=case.get("tie", False))
            out.append({"case": case, "param_err": _worst_param_error(eng, saved["params"][STEPS - 1]),
                        "loss_err": 0.0, "norm_err": 0.0})
            continue
        for step in range(STEPS):
            if "save" in case and step == STEPS - 1:
                save_training_state(CheckpointManager(case["save"]), eng, step, {}, "{}\n")
            if "save_flat" in case and step == STEPS - 1:
                _save_format1(CheckpointManager(case["save_flat"]), eng, step)
            total = 0.0
            for m in range(MICRO):
                total += eng.forward_backward(*micro_batch(step, m, dp_index), m, MICRO).item() / MICRO
            res = eng.step(SCHEDULE(step))
            losses.append(total)
            norm_err = max(norm_err, rel(res.grad_norm, ref["norms"][step]))
        mean = [x / world for x in control.all_reduce_sum_floats(losses)]  # every rank of a DP group agrees
        loss_err = max(rel(a, b) for a, b in zip(mean, ref["losses"]))
        out.append({"case": {k: v for k, v in case.items()}, "loss_err": loss_err, "norm_err": norm_err,
                    "param_err": _worst_param_error(eng, ref["params"][STEPS])})
    return out


def _group_timeouts() -> dict:
    """{description and ranks: timeout} of every process group this rank belongs to (gloo)."""
    import torch.distributed as dist

    out = {}
    for pg in list(dist.distributed_c10d._world.pg_map):
        ranks = tuple(sorted(dist.distributed_c10d._world.pg_group_ranks[pg]))
        out[f"{pg.group_desc} {ranks}"] = pg._get_backend(torch.device("cpu")).options._timeout
    return out


class _FakeTEAttention(torch.nn.Module):
    """Stands in for backends.TEAttention: built for head counts, as TE's DotProductAttention is, and refusing
    q/k/v with others (TE would misread them), then attending as SDPA does."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads

    def forward(self, q, k, v):
        from models.llama.backends import sdpa_attention

        if (q.shape[2], k.shape[2]) != (self.n_heads, self.n_kv_heads):
            raise RuntimeError(f"kernel built for {self.n_heads}/{self.n_kv_heads} heads got {q.shape[2]}/{k.shape[2]}")
        return sdpa_attention(q, k, v)


class _FakeTENorm(torch.nn.Module):
    """Stands in for transformer_engine.pytorch.RMSNorm: a gain named `weight`, kernels for plain tensors only."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, torch.nn.Parameter(torch.empty(dim))

    def forward(self, x):
        from torch.distributed.tensor import DTensor

        from models.llama.backends import rms_norm_reference

        if isinstance(x, DTensor) or isinstance(self.weight, DTensor):
            raise TypeError("a Transformer Engine kernel got a DTensor")
        return rms_norm_reference(x, self.weight, self.eps)


def _te_under_tp(tp_mesh, sp: bool) -> dict:
    """A model whose attention and norms are (stand-ins for) Transformer Engine's, made tensor-parallel: its
    loss must equal the unsplit model's, its kernels must be built for the local heads, and its norms must
    be ones that take DTensors where sequence parallelism hands them DTensors."""
    import copy

    from torch.distributed.tensor.parallel import loss_parallel

    import models.llama.backends as backends
    from amsp.parallel.tensor_parallel import parallelize_llama
    from amsp.routing_check import data_plane
    from models.llama.model import Llama, RMSNorm

    cfg = model_cfg()
    real = backends.make_attention
    backends.make_attention = lambda choice, h, kv, d: _FakeTEAttention(h, kv, d) if choice == "te" else real(
        choice, h, kv, d)
    try:
        torch.manual_seed(0)
        model = Llama(cfg)
        model.attention_backend, model.norm_backend = "te", "te"
        for block in model.layers:
            block.attention.kernel = backends.make_attention("te", cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
            block.attention_norm = _FakeTENorm(cfg.dim, cfg.norm_eps)
            block.ffn_norm = _FakeTENorm(cfg.dim, cfg.norm_eps)
        model.head.norm = _FakeTENorm(cfg.dim, cfg.norm_eps)
        model.init_weights(SEED)
        with torch.no_grad():  # gains other than init's ones, so a copy that drops them shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        ref = copy.deepcopy(model)
        parallelize_llama(model, tp_mesh, sequence_parallel=sp, loss_parallel=True, seq_len=16)
        tokens, targets = micro_batch(0, 0, 0)
        with data_plane(), loss_parallel():
            loss = model(tokens, targets)
            loss.backward()
        want = ref(tokens, targets)
        kernels = {(b.attention.kernel.n_heads, b.attention.kernel.n_kv_heads) for b in model.layers}
        norms = [m for b in model.layers for m in (b.attention_norm, b.ffn_norm)] + [model.head.norm]
        gains = [n.weight.to_local() if hasattr(n.weight, "to_local") else n.weight for n in norms]
        ref_norms = [m for b in ref.layers for m in (b.attention_norm, b.ffn_norm)] + [ref.head.norm]
        return {"loss_err": rel(loss.item(), want.item()), "kernels": kernels,
                "norm_types": {type(n).__name__ for n in norms},
                "own_norms": all(isinstance(n, RMSNorm) and not n.fused for n in norms),
                "gains_kept": all(torch.equal(g.detach(), r.weight.detach()) for g, r in zip(gains, ref_norms))}
    finally:
        backends.make_attention = real


CASES = [
    {"tp": 2, "sp": True, "blocks": (2, 2, 2)},  # zero3 on the DP group of 2
    {"tp": 2, "sp": False, "blocks": (1, 2, 2), "tie": True},  # zero2, tied embeddings
    {"tp": 2, "sp": True, "blocks": (1, 1, 2)},  # zero1
    {"tp": 2, "sp": True, "blocks": (2, 2, 2), "fault": True},
    {"tp": 2, "profile": True},
    {"tp": 2, "profile": True, "tie": True},  # the tied head's two-input plan (tensor_parallel.py)
    {"tp": 2, "te": True, "sp": True},
    {"tp": 2, "te": True, "sp": False},
    {"tp": 2, "embedding_grad": True},
    {"tp": 2, "saved": True},
    {"tp": 2, "kept": True},
]
# big enough that every kept tensor is served by mmap (the resident set then follows them); grouped K/V
# with 2 local KV heads at tp 2, so SDPA's repeated copies are real ones
KEPT_SEQ = 256
KEPT_MODEL = get_preset("debug").with_overrides(dim=768, n_heads=12, n_kv_heads=4, n_layers=4, max_seq_len=KEPT_SEQ)


def test_tp_dp_equals_single_process(tmp_path):
    tp_run, dp_run, flat_run = (str(tmp_path / n) for n in ("tp2_zero3", "dp4_zero2", "dp4_format1"))
    # Checkpoints are logical: written at (tp 2, dp 2, zero3) they load at (tp 1, dp 4, zero2) and back.
    ckpt_cases = [{"tp": 2, "sp": True, "blocks": (2, 2, 2), "save": tp_run},
                  {"tp": 1, "sp": False, "blocks": (1, 4, 4), "load": tp_run, "saved_dp": 2},
                  {"tp": 1, "sp": False, "blocks": (1, 4, 4), "save": dp_run},
                  {"tp": 2, "sp": False, "blocks": (1, 1, 2), "load": dp_run, "saved_dp": 4},
                  # a format-1 (flattened) checkpoint of a DP run still loads, under another plan
                  {"tp": 1, "sp": False, "blocks": (2, 2, 2), "save_flat": flat_run},
                  {"tp": 1, "sp": False, "blocks": (1, 1, 4), "load": flat_run, "saved_dp": 4}]
    cache = tmp_path / "profile_cache"
    results = run_distributed(_run, 4, CASES + ckpt_cases + [{"tp": 1, "profile_cache": str(cache)},
                                                              {"tp": 1, "timeouts": True}], timeout=300)
    for rank_results in results:  # the TP/PP/DP mesh's groups and the TP profile's: trainer's timeout, not torch's
        (t,) = [r for r in rank_results if r["case"].get("timeouts")]
        assert any(k.startswith("mesh_") for k in t["timeouts"]), t
        assert all(v == t["want"] for v in t["timeouts"].values()), t
    for sp in (True, False):  # Transformer Engine's kernels under TP: rebuilt for the local heads, norms that run
        (te,) = [r for r in results[0] if r["case"].get("te") and r["case"]["sp"] == sp]
        assert te["kernels"] == {(2, 1)} and te["loss_err"] <= 1e-5 and te["gains_kept"], te
        assert te["own_norms"] if sp else te["norm_types"] == {"_FakeTENorm"}, te
    (emb,) = [r for r in results[0] if r["case"].get("embedding_grad")]
    cfg = model_cfg()  # not the full vocab x dim table on every TP rank (DTensor's own embedding backward)
    assert emb["placements"] == "(Shard(dim=0),)" and emb["shape"] == (cfg.vocab_size // 2, cfg.dim), emb
    (saved,) = [r for r in results[0] if r["case"].get("saved")]
    kernels = kernels_for_model(cfg, "cpu", "fp32")  # sequence-parallel norms, repeated K/V, fused SwiGLU
    predicted = Workload(cfg.with_overrides(max_seq_len=64), 64, 2, 1, Precision.named("fp32"), tp=2,
                         kernels=kernels).layer_activation_bytes()
    assert saved["bytes"] == pytest.approx(predicted, rel=0.05), (saved, predicted)
    (kept,) = [r for r in results[0] if r["case"].get("kept")]
    for (layout, mode), got in kept["kept"].items():  # the per-layer term against the resident set
        w = Workload(KEPT_MODEL, KEPT_SEQ, 2, 1, Precision.named("fp32"), recompute=mode, tp=layout,
                     kernels=kernels_for_model(KEPT_MODEL, "cpu", "fp32"))
        priced = w.layer_activation_bytes()
        assert got == pytest.approx(priced, rel=0.05), (layout, mode, got, priced)
    (cached,) = [r for r in results[0] if r["case"].get("profile_cache")]
    assert list(cached["first"]) == [(None, 2)] and cached["again"] == cached["first"], cached  # tp 2 in a node of 2
    assert list(cached["by_group"]) == [("fast", 2), ("slow", 2)] and cached["by_group_again"] == cached["by_group"]
    assert cached["by_group"][("fast", 2)] != cached["by_group"][("slow", 2)]  # two groups' own medians, not one
    assert len(list(cache.glob("tp2-v*-*.json"))) == 2
    for tie in (False, True):
        profiles = [r["times"] for rank_results in results for r in rank_results
                    if r["case"].get("profile") and r["case"].get("tie", False) == tie]
        assert len(profiles) == 4 and all(p == profiles[0] for p in profiles), \
            f"every rank must get the slowest rank's TP unit times: {profiles}"
        assert all(0 < t < 60 for t in profiles[0]), profiles[0]
    for r in results[0]:
        c = r["case"]
        if any(c.get(k) for k in ("profile", "profile_cache", "embedding_grad", "saved", "kept", "te", "timeouts")):
            continue
        if c.get("fault"):
            assert r["norm_err"] > 1e-5, f"counting replicated copies on every TP rank went unnoticed: {r}"
            continue
        assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
    for rank_results in results[1:]:  # every rank checked its own shards
        for r in rank_results:
            if not any(r["case"].get(k) for k in ("fault", "profile", "profile_cache", "embedding_grad", "saved",
                                                  "kept", "te", "timeouts")):
                assert r["param_err"] <= 1e-5, r


# Slow (the suite's time budget): the default run keeps tensor parallelism's equality
# (test_tp_dp_equals_single_process).
@pytest.mark.slow
def test_tp_without_sequence_parallelism_trains_a_sequence_tp_does_not_divide(tmp_path):
    """parallel.tp=2 with sequence and loss parallelism off at data.seq_len=63 (torchrun, 2 ranks): the startup
    planner timed no tp for a sequence tp does not divide, as if sequence parallelism split it, and stopped
    with a traceback; its TP units are now timed and cached as the run applies them (their own file)."""
    from amsp.parallel.tp_profile import TP_PROFILE_VERSION
    from tests.training.runs import records, train

    run, cache = tmp_path / "tp2_nosp", tmp_path / "cache"
    proc = train(run, "data.seq_len=63", "trainer.max_steps=2", "parallel.tp=2",
                 "parallel.sequence_parallel=false", "parallel.loss_parallel=false", "trainer.checkpoint_interval=0",
                 f"amsp.planner.cache_dir={cache}", "amsp.planner.probe_budget_s=1", nproc=2, timeout=300)
    assert [r["step"] for r in records(run)] == [1, 2], proc.stdout[-2000:]
    assert "tensor-parallel profile: tp 2:" in proc.stdout + proc.stderr
    names = [p.name.split("-")[:4] for p in cache.glob("tp2-*.json")]
    assert names == [["tp2", f"v{TP_PROFILE_VERSION}", "nosp", "nolp"]], names
