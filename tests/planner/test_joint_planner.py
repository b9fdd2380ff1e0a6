"""The joint TP x PP x DP x AMSP planner (amsp/planner/joint): choices on known shapes, feasibility,
the layer-split dynamic program against brute force, mixed clusters, the CLI's JSON."""
from __future__ import annotations

import itertools
import json

import pytest

from amsp.errors import InputError
from amsp.planner.joint.hetero import from_spec, load_hetero, load_preset
from amsp.planner.joint.search import (INF, _Candidate, format_joint, plan_joint, price_config, split_bounds,
                                       stage_blocks)
from amsp.planner.joint.stage_cost import Setting
from amsp.schedule import Precision
from models.llama import get_preset

BF16 = Precision.named("bf16")
MIXED = "configs/clusters_mixed/mixed_a100_v100.yaml"


def _fits(plan) -> bool:
    return all(m <= b for m, b in zip(plan.stage_memory_gib, plan.stage_budget_gib))


def test_7b_on_one_h100_node_is_pure_data_parallel():
    plans = plan_joint(get_preset("llama2_7b"), from_spec(load_preset("h100x8", 1)), seq_len=4096,
                       global_batch=256, precision=BF16)
    assert (plans[0].tp, plans[0].pp) == (1, 1) and _fits(plans[0])
    assert [p.step_s for p in plans] == sorted(p.step_s for p in plans)


def test_70b_on_64_h100_nodes_fits_with_tp_inside_a_node_and_says_why():
    cluster = from_spec(load_preset("h100x8", 64))
    plans = plan_joint(get_preset("llama2_70b"), cluster, seq_len=4096, global_batch=1024, precision=BF16)
    best = plans[0]
    assert best.tp > 1 and 8 % best.tp == 0, "70B at 4k context needs TP; TP groups must stay inside a node"
    assert all(_fits(p) for p in plans), "an infeasible plan was returned"
    assert best.tp * best.pp * best.dp == 512 and best.dp * best.micro_batch_size * best.num_micro == 1024
    assert "stays inside a node" in best.decided_by and "largest term" in best.decided_by


def test_mixed_cluster_gives_the_slower_nodes_fewer_layers():
    cluster = load_hetero(MIXED)
    plans = plan_joint(get_preset("llama2_7b"), cluster, seq_len=4096, global_batch=256, precision=BF16)
    staged = [p for p in plans if p.pp > 1 and len(set(p.stage_nodes)) > 1]
    assert staged, "no pipeline plan spans both node kinds"
    for p in staged:
        a100 = [n for n, g in zip(p.layer_split, p.stage_nodes) if g == "a100x8"]
        v100 = [n for n, g in zip(p.layer_split, p.stage_nodes) if g == "v100x8"]
        assert max(v100) < min(a100), (p.layer_split, p.stage_nodes)
        assert _fits(p)


def test_no_pipeline_plan_with_fewer_micro_batches_than_stages():
    """The 1F1B schedule needs at least pp micro-batches a step (train.py refuses fewer at startup): a
    small batch leaves such layouts out of the ranking rather than returning a plan that cannot start."""
    from amsp.parallel.pipeline import check_micro_batches

    tiny = get_preset("tiny")
    plans = plan_joint(tiny, from_spec(load_preset("h100x8", 1).with_shape(2, 2)), seq_len=128, global_batch=16,
                       precision=BF16, top_k=100)
    assert any(p.pp > 1 for p in plans) and any(p.micro_batch_size == 8 for p in plans)
    for p in plans:
        check_micro_batches("1f1b", p.num_micro, p.pp)  # raises for a plan train.py would refuse
    assert not [p for p in plans if p.pp == 2 and p.dp == 2 and p.micro_batch_size == 8], "B = 16/(2 x 8) = 1 < pp"
    assert [p for p in plans if p.pp == 2 and p.dp == 1 and p.micro_batch_size == 8], "B = 16 / 8 = 2 = pp runs"


def test_split_dp_matches_brute_force():
    cfg = get_preset("llama2_7b").with_overrides(n_layers=7)
    cluster = load_hetero(MIXED)
    finite = 0
    for tp, pp, mbs in ((2, 2, 1), (1, 4, 1), (2, 4, 2), (4, 2, 1), (8, 4, 1)):
        dp = cluster.world // (tp * pp)
        s = Setting(cfg, 4096, BF16, tp, pp, dp, mbs, 64 // (dp * mbs) or 1, {})
        cand = _Candidate(s, cluster)
        n = cfg.n_layers + 2
        brute = INF
        for cuts in itertools.combinations(range(2, n - 1), pp - 1):
            b = [0, *cuts, n]
            brute = min(brute, max(cand.stage_time(i, b[i], b[i + 1]) for i in range(pp)))
        b = cand.split()
        if brute == INF:
            assert b is None, (tp, pp, mbs, b)
            continue
        finite += 1
        got = max(cand.stage_time(i, b[i], b[i + 1]) for i in range(pp))
        assert got == pytest.approx(brute), (tp, pp, mbs, b)
    assert finite >= 2, "the brute-force comparison needs feasible cases to mean anything"


def test_nothing_fits_is_one_line_naming_the_shortfall():
    with pytest.raises(InputError, match=r"no joint plan fits .* needs [\d.]+ GiB more per GPU"):
        plan_joint(get_preset("llama2_70b"), from_spec(load_preset("v100x8", 1)), seq_len=4096, global_batch=64,
                   precision=BF16)


def test_a_reserve_that_fills_the_gpu_is_named_not_more_gpus():
    """The reserve alone at the GPU's size: "add GPUs or shorten data.seq_len" could never help."""
    with pytest.raises(InputError, match=r"amsp.planner.reserved_gib=40 GiB .* is all of a GPU's 32 GiB") as e:
        plan_joint(get_preset("debug"), from_spec(load_preset("v100x8", 1)), seq_len=64, global_batch=64,
                   precision=BF16, reserved_bytes=40 * 2**30)
    assert "add GPUs" not in str(e.value)


def test_cli_joint_json(capsys):
    from amsp.planner.__main__ import main

    assert main(["--joint", "--json", "model=llama2_7b", "cluster=h100x8", "cluster.nodes=2", "data.seq_len=4096",
                 "trainer.global_batch_size=128"]) == 0
    out = json.loads(capsys.readouterr().out)
    choice = out["choice"]
    assert choice["tp"] * choice["pp"] * choice["dp"] == 16 and choice["decided_by"]
    assert out["inputs"]["global_batch"] == 128 and out["alternatives"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("overlap_spread", [False, True])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_one_stage_memory_is_the_amsp_planners(precision, overlap_spread, device):
    """tp = pp = 1: a stage is the whole model, and its memory must be what the AMSP cost model (measured
    within 10% on CPU, scripts/bench/bench_memory_fidelity.py) says for the same degrees, phase by phase,
    on either backend (gloo's staged copies on CPU: memory_events.reduce_scatter_inflight_bytes)."""
    import dataclasses

    from amsp.plan import Degrees, Plan
    from amsp.planner.cost_model import CostModel, Options
    from amsp.planner.workload import Workload

    cfg = get_preset("tiny").with_overrides(dim=256, n_layers=4, vocab_size=8192)
    prec = Precision.named(precision)
    cluster = dataclasses.replace(load_preset("a100x8", 1), device=device)
    s = Setting(cfg, 256, prec, 1, 1, 8, 2, 4, {}, memory_margin=0.0, reserved_bytes=0.0,
                overlap_spread=overlap_spread, spread_window=2)
    pricer = _Candidate(s, from_spec(cluster)).pricers[0]
    model = CostModel(Workload(cfg, 256, 2, 4, prec), cluster,
                      Options(memory_margin=0.0, reserved_bytes=0, overlap_spread=overlap_spread, spread_window=2))
    for deg in (Degrees(1, 1, 1), Degrees(1, 1, 8), Degrees(1, 8, 8), Degrees(2, 4, 8), Degrees(8, 8, 8),
                Degrees(2, 2, 2)):
        joint, _ = pricer.memory(cfg.n_layers, True, True, deg, False, 1)
        amsp = model.evaluate(Plan(deg, deg, name="t")).memory_total
        assert joint == pytest.approx(amsp, rel=0.01), (deg, joint, amsp)


def test_last_stage_prices_the_unfused_loss_backward():
    """The cross-entropy's backward runs before any gradient exists and holds fp32 tensors of the local
    logits' size: 2 for the pipeline's plain loss (pp > 1), 3 under loss_parallel (tp > 1), none where the
    head computes the loss itself (tp = pp = 1: the fused path). On the last stage it stands in for the
    gradient pair when larger; other stages are unchanged."""
    from amsp.plan import Degrees
    from amsp.planner.workload import Workload

    cfg = get_preset("tiny").with_overrides(dim=256, n_layers=4, vocab_size=32000)
    prec = Precision.named("fp32")
    logits = 2 * 256 * 32000 * 4  # mbs 2 x seq 256 tokens x V, fp32
    assert Workload(cfg, 256, 2, 4, prec).loss_backward_transient_bytes() == 0
    assert Workload(cfg, 256, 2, 4, prec, pp=2).loss_backward_transient_bytes() == 2 * logits
    assert Workload(cfg, 256, 2, 4, prec, tp=2).loss_backward_transient_bytes() == 3 * logits / 2
    cluster = from_spec(load_preset("a100x8", 1))
    parts = {}
    for tp, pp in ((1, 1), (1, 2), (2, 1)):
        s = Setting(cfg, 256, prec, tp, pp, 8 // (tp * pp), 2, 4, {}, memory_margin=0.0, reserved_bytes=0.0)
        pricer = _Candidate(s, cluster).pricers[0]
        parts[tp, pp] = {head: pricer.memory(2, not head, head, Degrees(1, 1, 1), False, 1)[1]["buffers"]
                         for head in (False, True)}
    pair = parts[1, 1][True]
    assert pair < 2 * logits
    assert parts[1, 2][True] == 2 * logits and parts[2, 1][True] == 3 * logits / 2
    assert parts[1, 2][False] == parts[1, 1][False]  # no head, no loss


def test_stage_blocks_inverts_split_bounds():
    """Blocks per stage <-> unit boundaries (embedding first, head last): what a benchmark hands train.py
    as parallel.layer_split is the split the planner priced."""
    for split in ([4], [1, 3], [2, 2], [3, 1], [1, 1, 2], [2, 1, 1, 4]):
        bounds = split_bounds(split)
        assert bounds[0] == 0 and bounds[-1] == sum(split) + 2 and len(bounds) == len(split) + 1
        assert stage_blocks(bounds, sum(split)) == split


def test_joint_stage_prices_the_loss_path_the_device_runs():
    """train.py's joint startup passes whether the head's loss runs fused on its device: the eager head
    (no kernel for the device) keeps logits and its backward 2 more fp32 logits; a pipeline's loss is
    never fused, whatever is passed."""
    import dataclasses

    from amsp.plan import Degrees
    from amsp.planner.workload import Kernels, Workload
    from models.llama.fused import ALL_OPS

    cfg = get_preset("tiny").with_overrides(dim=256, n_layers=4, vocab_size=32000)
    prec = Precision.named("fp32")
    cluster = from_spec(load_preset("a100x8", 1))
    base = Setting(cfg, 256, prec, 1, 1, 8, 2, 4, {}, memory_margin=0.0, reserved_bytes=0.0)
    fused, eager_loss = Kernels(frozenset(ALL_OPS)), Kernels(frozenset(ALL_OPS) - {"linear_cross_entropy"})
    mem = {}
    for name, kernels in (("default", None), ("fused", fused), ("eager", eager_loss)):
        pricer = _Candidate(dataclasses.replace(base, kernels=kernels), cluster).pricers[0]
        mem[name] = pricer.memory(4, True, True, Degrees(1, 1, 1), False, 1)[0]
    eager, fused_w = Workload(cfg, 256, 2, 4, prec, kernels=eager_loss), Workload(cfg, 256, 2, 4, prec)
    assert mem["default"] == mem["fused"] < mem["eager"]
    assert mem["eager"] - mem["fused"] >= eager.head_activation_bytes() - fused_w.head_activation_bytes()
    piped = dataclasses.replace(base, pp=2, dp=4)
    assert dataclasses.replace(piped, kernels=fused).workload().head_loss_fused is False


def test_every_plan_is_a_layout_training_runs_and_its_dp_groups_are_priced_as_laid_out():
    """3 nodes of 8: tp 2 x pp 2 puts 12 ranks in a stage, 1.5 nodes, which the mesh refuses
    (amsp/parallel/mesh.py); such layouts are left out, and said so. The rest are priced with the DP shape
    the mesh gives the engine (members per node, nodes)."""
    from amsp.parallel.mesh import ParallelMesh

    cluster = from_spec(load_preset("a100x8", 3))
    plans = plan_joint(get_preset("llama2_7b"), cluster, seq_len=256, global_batch=96, precision=BF16, top_k=1000)
    for p in plans:
        stage = cluster.world // p.pp
        assert stage % 8 == 0 or 8 % stage == 0, f"{p.key()}: a stage of {stage} ranks straddles a node"
        topo = ParallelMesh(cluster.world, 8, tp=p.tp, pp=p.pp).dp_topology(0)
        s = Setting(get_preset("llama2_7b"), 256, BF16, p.tp, p.pp, p.dp, p.micro_batch_size, p.num_micro, {})
        pricer = _Candidate(s, cluster).pricers[0]
        assert (pricer.dp_per_node, pricer.spec.nodes) == (topo.ranks_per_node, topo.nodes), p.key()
    assert {(p.tp, p.pp) for p in plans} >= {(1, 1), (2, 3)}
    assert any("tp2 pp2 (12 ranks a stage)" in n and "not considered" in n for n in plans[0].notes), plans[0].notes
    with pytest.raises(InputError, match="neither fits inside a node"):
        price_config(get_preset("llama2_7b"), cluster, seq_len=256, global_batch=96, precision=BF16, tp=2, pp=2,
                     micro_batch_size=1, degrees=None)


def test_tied_embeddings_are_never_pipelined():
    """Training refuses pp > 1 with tied embeddings (configs/validate.py): the search leaves pipelines out
    and says why; pricing one by hand is refused."""
    tied = get_preset("debug").with_overrides(tie_embeddings=True)
    cluster = from_spec(load_preset("a100x8", 1))
    plans = plan_joint(tied, cluster, seq_len=256, global_batch=64, precision=BF16, top_k=1000)
    assert plans and all(p.pp == 1 for p in plans), [p.key() for p in plans if p.pp > 1]
    assert any("model.tie_embeddings=true" in n for n in plans[0].notes), plans[0].notes
    assert "note: pp > 1 not considered" in format_joint(plans, cluster)
    with pytest.raises(InputError, match="tie_embeddings"):
        price_config(tied, cluster, seq_len=256, global_batch=64, precision=BF16, tp=1, pp=2, micro_batch_size=1,
                     degrees=None)


def test_nothing_runs_for_the_batch_says_so_not_memory():
    """A global batch of 2 on 32 GPUs splits over no layout: the message names the batch and the
    pipelines' micro-batches, and the smallest batch that splits, not a 0.0 GiB memory shortfall."""
    with pytest.raises(InputError) as e:
        plan_joint(get_preset("llama2_7b"), load_hetero(MIXED), seq_len=4096, global_batch=2, precision=BF16)
    msg = str(e.value)
    assert "GiB" not in msg.split(" = 32 GPUs: ")[1], msg
    assert "global batch of 2 samples does not split" in msg and "fewer micro-batches a step (B) than pipeline" in msg
    assert "raise trainer.global_batch_size" in msg and "4 samples at the least" in msg, msg


def test_efficiency_is_checked_per_node_group(tmp_path):
    cluster = load_hetero(MIXED)
    tiny = get_preset("tiny")
    with pytest.raises(InputError, match="efficiency of node group a100x8 is 0"):
        plan_joint(tiny, cluster, seq_len=128, global_batch=64, precision=BF16, efficiency={"a100x8": 0})
    with pytest.raises(InputError, match="given for a100, not a node group"):
        plan_joint(tiny, cluster, seq_len=128, global_batch=64, precision=BF16, efficiency={"a100": 0.5})
    from amsp.planner.joint.hetero import read_efficiency_file

    good = tmp_path / "good.json"
    good.write_text('{"v100x8": 0.3}')
    assert read_efficiency_file(good, cluster) == {"v100x8": 0.3}
    for text, why in {'{"a100x8": 0}': "a100x8=0; a fraction of peak in", '{"a100x8": 1.5}': "a100x8=1.5",
                      '{"a100x8": "x"}': "a100x8='x'", '{"a100": 0.5}': "'a100' is not a node group",
                      "[1]": "expected a JSON object", "{": "not readable as JSON"}.items():
        bad = tmp_path / "eff.json"
        bad.write_text(text)
        with pytest.raises(InputError, match=f"--efficiency {bad}: .*{why}"):
            read_efficiency_file(bad, cluster)


def test_an_overlapped_update_is_priced_per_stage_on_cuda_only():
    """amsp.overlap_update in the joint planner: on a CUDA node group a stage's updates hide behind its
    forward except its first unit's (the embedding's, then the first block's on stage 0), the hidden rest at
    its measured UPDATE_HIDDEN_COST; on a CPU group priced as without the switch (inline)."""
    import dataclasses

    from amsp.plan import Degrees
    from amsp.planner.update_cost import UPDATE_HIDDEN_COST

    def price(cluster, on):
        return price_config(get_preset("llama2_7b"), cluster, seq_len=4096, global_batch=64, precision=BF16, tp=1,
                            pp=2, micro_batch_size=1, degrees=Degrees(1, 1, 8), overlap_update=on)

    cuda = from_spec(load_preset("h100x8", 2))
    cpu = from_spec(dataclasses.replace(load_preset("h100x8", 2), device="cpu"))
    (off_s, off), (on_s, on) = price(cuda, False), price(cuda, True)
    assert on_s < off_s and price(cpu, True)[0] == price(cpu, False)[0] == off_s
    s = Setting(get_preset("llama2_7b"), 4096, BF16, 1, 2, 8, 1, 8, {}, overlap_update=True)
    pricer = _Candidate(s, cuda).pricers[0]
    pe, pb, ph = pricer.params
    r, slow = 1e-12, UPDATE_HIDDEN_COST
    assert pb * r < pricer.costs.block / 3  # a block's update is shorter than a block's forward here
    first = pricer.update_s(16, True, False, r)  # stage 0: embedding + 16 blocks
    assert first == pytest.approx((pe + pb) * r + slow * 15 * pb * r)
    assert pricer.update_s(16, False, True, r) == pytest.approx(pb * r + slow * (15 * pb + ph) * r)
    off_pricer = _Candidate(dataclasses.replace(s, overlap_update=False), cuda).pricers[0]
    assert off_pricer.update_s(16, True, False, r) == pytest.approx((pe + 16 * pb) * r)
