"""The parameter spread's bounded window: at most amsp.spread_window units have a spread in flight,
launched in forward order, with the spread synchronous or overlapping the next forward; training
still equals single-process training (fp32, 20 steps, 1e-5); the in-flight bytes stay within the
planner's memory term; checkpoint loading goes through the same window; the optimizer makes one
host sync per step on the real engine too. In the same spawned group (g = 1 and g = 2): every gradient
leaves autograd in its own post-accumulate hook, so no unit's gradient is ever held twice (the
autograd tensors beside the flat copy).

FlatUnit.launch_spread / finish_spread are wrapped in the spawned ranks to record what is in flight.
"""
from __future__ import annotations

import pytest
import torch

import amsp_cases as C
from amsp.engine import AMSPEngine, EngineOptions
from amsp.plan import Degrees, Plan
from amsp.planner.cost_model import CostModel, Options
from amsp.planner.workload import Workload
from amsp.schedule import Precision
from amsp.topology import Topology
from tests.distributed import run_distributed
from tests.planner.planner_cases import flat_cluster

WORLD, RPN, STEPS = 4, 2, 20
PLANS = [(1, 1, 4), (1, 2, 4)]  # os > p: every unit's spread is a real all-gather with a receive buffer
WINDOWS = [1, 2]


class SpreadProbe:
    """Wraps FlatUnit's spread methods (class level, in this process) and records the spreads in flight."""

    def __init__(self):
        from amsp.flat_unit import FlatUnit

        self.in_flight: dict[int, tuple[str, int]] = {}  # id(unit) -> (name, receive-buffer bytes)
        self.max_units = 0
        self.max_bytes = 0
        self.launch_order: list[str] = []
        launch, finish = FlatUnit.launch_spread, FlatUnit.finish_spread
        probe = self

        def launch_spread(unit):
            assert id(unit) not in probe.in_flight, f"{unit.name}: spread launched twice"
            launch(unit)
            _, recv = unit._spread
            probe.in_flight[id(unit)] = (unit.name, 0 if recv is None else recv.numel() * recv.element_size())
            probe.launch_order.append(unit.name)
            probe.max_units = max(probe.max_units, len(probe.in_flight))
            probe.max_bytes = max(probe.max_bytes, sum(b for _, b in probe.in_flight.values()))

        def finish_spread(unit):
            finish(unit)
            probe.in_flight.pop(id(unit), None)

        FlatUnit.launch_spread, FlatUnit.finish_spread = launch_spread, finish_spread

    def reset(self) -> None:
        self.max_units = self.max_bytes = 0
        self.launch_order = []


def _count_host_syncs(eng: AMSPEngine, calls: list) -> None:
    """Count the ways a tensor value reaches Python while the engine's optimizer steps."""
    names = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
    step = eng.optim.step

    def counted_step(lr):
        saved = {n: getattr(torch.Tensor, n) for n in names}

        def wrap(n):
            def f(self, *a, **k):
                calls.append(n)
                return saved[n](self, *a, **k)
            return f
        try:
            for n in names:
                setattr(torch.Tensor, n, wrap(n))
            return step(lr)
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)

    eng.optim.step = counted_step


def _watch_held_grads(eng: AMSPEngine) -> list[int]:
    """After the engine's own post-accumulate hook on every parameter, record how many parameters of the
    model still hold a .grad (the engine's hooks were registered first, so they have run)."""
    params = [u.param(s) for u in eng.units for s in u.slots]
    most = [0]

    def after(_param):
        most[0] = max(most[0], sum(p.grad is not None for p in params))

    for p in params:
        p.register_post_accumulate_grad_hook(after)
    return most


def _run(rank: int, world: int, cases: list[dict], ref: dict) -> list[dict]:
    torch.set_num_threads(1)
    topo = Topology(world, RPN)
    probe = SpreadProbe()
    out = []
    for case in cases:
        probe.reset()
        deg = Degrees(*case["blocks"])
        opts = EngineOptions(precision="fp32", overlap_spread=case["overlap"], spread_window=case["window"],
                             optim=C.SETTINGS)
        eng = AMSPEngine(C.model_cfg(), Plan(deg, deg, name="test"), topo, rank, seed=C.SEED, options=opts)
        names = [u.name for u in eng.units]
        held = _watch_held_grads(eng)
        syncs: list = []
        _count_host_syncs(eng, syncs)
        losses = []
        pending_after_step = []
        for step in range(STEPS):
            micro = [eng.forward_backward(*C.micro_batch(step, m, rank), m, C.MICRO).item() for m in range(C.MICRO)]
            syncs.clear()
            res = eng.step(C.SCHEDULE(step))
            assert not res.skipped
            assert syncs == ["item"], f"rank {rank} {case} step {step}: optimizer host syncs {syncs}"
            assert C.rel(res.grad_norm, ref["norms"][step]) <= 1e-5, (case, step, res.grad_norm)
            pending_after_step.append(sum(u.spread_pending for u in eng.units))
            losses.append(sum(micro) / C.MICRO)
        train_order = probe.launch_order[:len(names)]
        C.check_params(eng, ref["params"][STEPS], 1e-5, f"rank {rank} {case}")  # completes the last spread
        # Checkpoint loading re-spreads through the same window.
        saved = {f.name: {k: getattr(f, k).clone() for k in f.STATE_KEYS} for f in eng.named_fragments()}
        fresh = AMSPEngine(C.model_cfg(), Plan(deg, deg, name="test"), topo, rank, seed=C.SEED + 1, options=opts)
        fresh.load_fragments(saved, eng.optimizer_steps)
        for a, b in zip(eng.units, fresh.units):
            assert torch.equal(a.p_shard, b.p_shard), f"rank {rank} {case}: reloaded {a.name} differs"
        out.append({"case": case, "losses": losses, "max_units": probe.max_units, "max_bytes": probe.max_bytes,
                    "launch_order": train_order, "names": names, "pending_after_step": pending_after_step,
                    "transient": [u.spread_transient_bytes() for u in eng.units], "held_grads": held})
    return out


def _planner_spread_term(blocks: tuple, window: int) -> tuple[int, int]:
    """(the cost model's spread memory term, its largest single unit) for the test model in fp32."""
    w = Workload(C.model_cfg(), C.SEQ, C.MBS, C.MICRO, Precision.named("fp32"))
    model = CostModel(w, flat_cluster(WORLD // RPN, RPN), Options(spread_window=window))
    deg = Degrees(*blocks)
    term = model.evaluate(Plan(deg, deg)).memory["spread"]
    return term, max(model.spread_bytes(role, deg) for role in ("embedding", "block", "head"))


@pytest.mark.distributed
def test_spread_window_bounds_in_flight_spreads_and_keeps_equality():
    ref = C.reference(WORLD, STEPS, (STEPS,))
    cases = [{"blocks": b, "window": w, "overlap": o} for b in PLANS for w in WINDOWS for o in (False, True)]
    results = run_distributed(_run, WORLD, cases, ref, timeout=900)
    for per_rank in results:
        for r in per_rank:
            case, n = r["case"], len(r["names"])
            where, w = f"{case}", case["window"]
            assert r["max_units"] <= w, f"{where}: {r['max_units']} spreads in flight, window {w}"
            assert r["max_units"] == min(w, n), f"{where}: the window is not used ({r['max_units']} in flight)"
            assert r["launch_order"] == r["names"], f"{where}: spreads not launched in forward order"
            # overlap off: step() lands every spread; on: the first window is still in flight after it
            want_pending = min(w, n) if case["overlap"] else 0
            assert r["pending_after_step"] == [want_pending] * STEPS, f"{where}: {r['pending_after_step']}"
            term, unit_max = _planner_spread_term(case["blocks"], w)
            assert max(r["transient"]) == unit_max, f"{where}: unit transient {r['transient']} vs planner {unit_max}"
            assert 0 < r["max_bytes"] <= term, f"{where}: {r['max_bytes']} bytes in flight > planner term {term}"
            assert r["held_grads"] == [0], f"{where}: {r['held_grads'][0]} gradients left with autograd"
    for i, case in enumerate(cases):
        for step in range(STEPS):
            mean = sum(per_rank[i]["losses"][step] for per_rank in results) / WORLD
            assert C.rel(mean, ref["losses"][step]) <= 1e-5, f"{case} step {step}: loss {mean} vs {ref['losses'][step]}"


def test_spread_window_validated():
    with pytest.raises(ValueError, match="amsp.spread_window=0 must be an integer >= 1"):
        EngineOptions(spread_window=0)
    with pytest.raises(ValueError, match="amsp.spread_window=0 must be >= 1"):
        Options(spread_window=0)
