"""Engine startup initialises only the slices a rank holds: every rank's P shard and fp32 master
equal the matching ranges of the single-process model for every plan, and no fp32 tensor beyond
one init chunk and the rank's own shards is allocated while the engine is built."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from amsp.engine import AMSPEngine, EngineOptions
from amsp.plan import Degrees, Plan
from amsp.topology import Topology
from models.llama import build_model, get_preset
from models.llama.init import CHUNK
from tests.distributed import run_distributed

SEED = 11
WORLD, RANKS_PER_NODE = 4, 2
# Every unit is larger than one init chunk (the embedding spans 1.5 chunks, a block 1.55), and a
# G shard of a g >= 2 unit is smaller than the smallest unit: a unit-sized fp32 temporary stands out.
CFG = get_preset("debug").with_overrides(dim=384, vocab_size=4096, fused="off")
CASES = [  # (blocks, embed_head) degrees
    ((1, 1, 1), (1, 1, 1)),
    ((1, 1, 4), (1, 1, 4)),
    ((1, 2, 4), (1, 1, 2)),
    ((2, 2, 4), (2, 2, 4)),
    ((2, 4, 4), (2, 2, 2)),
    ((4, 4, 4), (4, 4, 4)),
]


class Fp32Allocations(TorchDispatchMode):
    """Sizes (elements) of the fp32 tensors that ops create with storage of their own (not views,
    not in-place results) on a real device."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and not t.is_meta and t.dtype == torch.float32
                    and t.untyped_storage().data_ptr() not in seen):
                self.sizes.append((t.untyped_storage().nbytes() // 4, str(func)))
        return out


def _reference_flat(ref_params: dict, u) -> torch.Tensor:
    flat = torch.zeros(u.layout.padded)
    for s in u.slots:
        flat[s.offset:s.offset + s.numel] = ref_params[s.name].reshape(-1)
    return flat


def _check_case(rank: int, world: int, blocks, embed_head, precision: str, ref_params: dict) -> dict:
    plan = Plan(Degrees(*blocks), Degrees(*embed_head))
    record = Fp32Allocations()
    with record:
        eng = AMSPEngine(CFG, plan, Topology(world, RANKS_PER_NODE), rank, seed=SEED,
                         options=EngineOptions(precision=precision))
    where = f"rank {rank} plan {blocks}/{embed_head} {precision}"
    for u in eng.units:
        flat = _reference_flat(ref_params, u)
        lo, hi = u.layout.p_range(rank)
        want = flat[lo:hi].to(eng.compute_dtype)
        assert torch.equal(u.p_shard, want), f"{where}: P shard of {u.name}"
        assert torch.equal(u.master, flat[u.os_lo:u.os_hi]), f"{where}: master of {u.name}"
        assert u.master_is_weights == (precision == "fp32")
    if all(u.deg.p == 1 for u in eng.units):  # the parameters are views of the (full) P shards
        for name, p in eng.model.named_parameters():
            assert torch.equal(p, ref_params[name].to(eng.compute_dtype)), f"{where}: {name}"
    # fp32 tensors the rank keeps (gradient shard, optimizer state); anything else larger than one
    # init chunk is a temporary that scales with the unit, not with the shard.
    kept = {n for u in eng.units for n in (u.g_shard.numel(), u.exp_avg.numel(), u.master.numel())}
    largest = max(record.sizes)
    if precision == "bf16":  # fp32 compute allocates the unit-sized gathered buffer, in fp32
        stray = [(n, op) for n, op in record.sizes if n > CHUNK and n not in kept]
        assert not stray, f"{where}: fp32 temporaries beyond one init chunk: {stray[:5]}"
        if all(u.deg.p > 1 for u in eng.units):
            smallest_unit = min(u.layout.numel for u in eng.units)
            assert largest[0] < smallest_unit, f"{where}: fp32 allocation {largest} >= unit size {smallest_unit}"
    return {"case": where, "largest_fp32": largest}


def _all_cases(rank: int, world: int) -> list[dict]:
    torch.manual_seed(0)
    ref = {n: p.detach() for n, p in build_model(CFG, seed=SEED).named_parameters()}
    return [_check_case(rank, world, b, e, prec, ref) for b, e in CASES for prec in ("bf16", "fp32")]


@pytest.mark.distributed
def test_each_rank_initialises_its_own_slices_for_every_plan():
    results = run_distributed(_all_cases, WORLD, timeout=600)
    for r in results[0]:
        print(r["case"], "largest fp32 allocation", r["largest_fp32"])
    assert all(len(r) == 2 * len(CASES) for r in results)


def test_single_process_startup_logs_time_and_device(caplog):
    cfg = get_preset("debug").with_overrides(fused="off")
    with caplog.at_level(logging.INFO, logger="amsp.engine"):
        eng = AMSPEngine(cfg, Plan(Degrees(1, 1, 1), Degrees(1, 1, 1)), Topology(1, 1), 0, seed=SEED,
                         options=EngineOptions(precision="bf16"))
    lines = [r.getMessage() for r in caplog.records if "initialised" in r.getMessage()]
    assert len(lines) == 1 and " on cpu in " in lines[0], lines
    ref = build_model(cfg, seed=SEED)
    for name, p in ref.named_parameters():
        assert torch.equal(eng.model.get_parameter(name), p.to(torch.bfloat16)), name
        frag = [f for f in eng.named_fragments() if f.name == name]
        assert len(frag) == 1 and torch.equal(frag[0].master, p.reshape(-1)), name
