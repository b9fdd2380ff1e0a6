"""The memory model: the peak is the larger phase (not a sum of everything), the reserve is explicit,
and the solvers never exclude a plan that evaluate() says fits."""
from __future__ import annotations

import numpy as np
import pytest

from amsp.plan import make_plan
from amsp.planner.cost_model import CostModel, Options
from amsp.planner import ilp
from amsp.planner.exhaustive import grid
from amsp.planner.terms import GroupTerms
from amsp.planner.workload import Kernels, Workload
from models.llama.fused import AUTO_OPS
from tests.planner.planner_cases import flat_cluster, workload

# every CPU kernel but the fused linear + cross-entropy: the head keeps logits
EAGER_LOSS = Kernels(fused=frozenset(AUTO_OPS) - {"linear_cross_entropy"})


def test_peak_is_the_larger_phase():
    w = workload("tiny", seq_len=64, mbs=1, micro_batches=1, precision="bf16")  # bf16 grads: grad_sync is its own buffer
    m = CostModel(w, flat_cluster(1, 8), Options()).evaluate(make_plan("zero1", 8, 8)).memory
    states = m["params"] + m["grads"] + m["optim"] + m["spread"]
    fb = m["gathered"] + m["activations"] + m["buckets"]
    assert m["grad_sync"] > 0 and m["step_reuse"] == -min(fb, m["grad_sync"])
    tensors = sum(v for k, v in m.items() if k != "reserved")
    assert tensors == pytest.approx(states + max(fb, m["grad_sync"]))
    assert tensors < states + fb + m["grad_sync"]  # the old additive sum over-counted


def test_reserve_is_runtime_plus_fragmentation_of_the_peak():
    w = workload("tiny")
    o = Options(memory_margin=0.05, reserved_bytes=2**28)
    m = CostModel(w, flat_cluster(1, 8), o).evaluate(make_plan("zero3", 8, 8)).memory
    tensors = sum(v for k, v in m.items() if k != "reserved")
    assert m["reserved"] == pytest.approx(2**28 + 0.05 * tensors)


def test_the_tables_memory_columns_add_up_to_its_total():
    """The report's memory columns (P, G, OS, act, buf net of the step's reuse, resv) sum to its total,
    so a reader can see where every byte of a plan's peak goes (the reserve had no column before)."""
    from amsp.planner.report import COLUMNS, format_table, row

    w = workload("tiny", seq_len=64, mbs=1, micro_batches=1, precision="bf16")
    costs = [CostModel(w, flat_cluster(1, 8), Options()).evaluate(make_plan(name, 8, 8))
             for name in ("ddp", "zero1", "zero3")]
    first, last = COLUMNS.index("mem_params_gib"), COLUMNS.index("mem_total_gib")
    for c in costs:
        r = row(1, c)
        assert c.memory["reserved"] > 0 and r[COLUMNS.index("mem_reserve_gib")] == c.memory["reserved"] / 2**30
        assert sum(r[first:last]) == pytest.approx(r[last])
    header = format_table(costs).splitlines()[1].split()
    assert header[header.index("buf") + 1] == "resv" and header[header.index("resv") + 1] == "total"


def test_spread_joins_the_phase_it_runs_in():
    """Overlapped, the spread is in flight in the next forward; otherwise it follows the update, which
    has freed the OS-shard gradients (a 1/1/4 run's trace: the resident set fell by their 95 MiB before
    the first unit's spread), so the step phase is the larger of the two, not their sum."""
    w = workload("tiny", seq_len=8, mbs=1, micro_batches=1, precision="bf16", model_overrides={"vocab_size": 1024})
    for overlap in (True, False):
        m = CostModel(w, flat_cluster(1, 8), Options(overlap_spread=overlap)).evaluate(make_plan("zero1", 8, 8)).memory
        states = m["params"] + m["grads"] + m["optim"]
        fb = m["gathered"] + m["activations"] + m["buckets"] + (m["spread"] if overlap else 0)
        step = max(m["grad_sync"], 0 if overlap else m["spread"])
        assert m["spread"] > 0
        assert sum(v for k, v in m.items() if k != "reserved") == pytest.approx(states + max(fb, step))
        if not overlap:  # this shape's step phase decides, and the sum would have over-counted it
            assert step > fb and m["grad_sync"] + m["spread"] > step


def test_a_reduce_scatter_in_flight_holds_its_output_and_on_cpu_glooss_copy():
    """g > 1: while the last block fills, the head's reduce-scatter is in flight. It holds its output (the
    head's G-shard slice) on every backend, and on CPU gloo's copy of its input as well, less the head's
    gathered weights with p > 1 (freed after its backward, still counted by the gathered pair)."""
    import dataclasses

    from amsp.plan import Degrees
    from amsp.planner.memory_events import reduce_scatter_inflight_bytes
    from amsp.schedule import padded_numel

    w = workload("tiny", seq_len=128, mbs=2, micro_batches=2, precision="fp32")
    cpu = CostModel(w, flat_cluster(1, 8), Options())
    cuda = CostModel(w, dataclasses.replace(flat_cluster(1, 8), device="cuda"), Options())
    assert cpu.collectives_stage_copies and not cuda.collectives_stage_copies
    for deg, staged in ((Degrees(1, 8, 8), 1.0), (Degrees(8, 8, 8), 0.0), (Degrees(1, 1, 8), None)):
        head = padded_numel(w.role_numel()["head"], deg)
        out = head / deg.g * 4
        if staged is None:  # g = 1: no reduce-scatter
            assert cpu.grad_inflight_bytes("head", deg) == cuda.grad_inflight_bytes("head", deg) == 0
            continue
        assert cuda.grad_inflight_bytes("head", deg) == out
        assert cpu.grad_inflight_bytes("head", deg) == out + staged * head * 4
    # bf16 weights gathered with p > 1 free half of what the fp32 gradient's copy takes
    assert reduce_scatter_inflight_bytes(800, Degrees(2, 8, 8), 4, 2, True) == 800 / 8 * 4 + 800 * 2
    # the event: the filling block's bucket and gradient in copy, the head's bucket and its in-flight extra
    deg = Degrees(1, 8, 8)

    def event(m):
        roles, filler, credit = next(e for e in m.bucket_events() if e[0] == ("block", "head"))
        held = (m.grad_bucket_bytes("block", deg) + m.grad_bucket_bytes("head", deg)
                + m.grad_fill_bytes("block", deg) + m.grad_inflight_bytes("head", deg) - credit)
        tables = [{r: f(r, deg) for r in ("embedding", "block", "head")}
                  for f in (m.grad_bucket_bytes, m.grad_fill_bytes, m.grad_inflight_bytes)]
        assert m.peak_grad_buckets(*tables) >= held
        return held

    head = padded_numel(w.role_numel()["head"], deg)
    assert event(cpu) - event(cuda) == pytest.approx(head * 4)  # gloo's copy of the head's fp32 gradients
    grid_matches_evaluate(cpu)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("memory_gib", [0.05, 0.08, 0.12, 0.2, 1.0])
def test_solvers_never_exclude_a_plan_that_fits(memory_gib, overlap):
    w = workload("tiny", seq_len=128, mbs=2, micro_batches=2, precision="bf16")
    model = CostModel(w, flat_cluster(1, 8, memory_gib=memory_gib), Options(reserved_bytes=0, overlap_spread=overlap))
    t, memory = grid_matches_evaluate(model)
    choice, _ = ilp.solve(t)
    assert (choice is None) == (not (memory <= t.budget_bytes).any())  # the ILP finds a plan whenever one fits


def grid_matches_evaluate(model: CostModel):
    """(terms, memory grid) after checking every plan's memory and fit in the grid against evaluate()."""
    from amsp.plan import Plan

    t = GroupTerms.build(model)
    _, memory = grid(t)
    for i, b in enumerate(t.candidates):
        for j, e in enumerate(t.candidates):
            cost = model.evaluate(Plan(blocks=b, embed_head=e, name="x"))
            assert cost.memory_total - cost.memory["reserved"] == pytest.approx(memory[i, j], rel=1e-9)
            assert cost.fits == bool(memory[i, j] <= t.budget_bytes * (1 + 1e-12)), (b, e)
    return t, memory


def test_a_plan_fits_in_exactly_its_predicted_need():
    w = workload("tiny")
    plan = make_plan("zero2", 8, 8)
    need = CostModel(w, flat_cluster(1, 8), Options()).evaluate(plan).memory_total
    tight = flat_cluster(1, 8, memory_gib=need * 1.0001 / 2**30)
    assert CostModel(w, tight, Options()).evaluate(plan).fits
    assert not CostModel(w, flat_cluster(1, 8, memory_gib=need * 0.97 / 2**30), Options()).evaluate(plan).fits
    assert np.isfinite(need)


@pytest.mark.slow
@pytest.mark.distributed
def test_measured_peaks_are_within_ten_percent(tmp_path):
    """Measured on 2 gloo ranks (scripts/bench/bench_memory_fidelity.py): each plan's prediction is
    within 10% of its measured peak (issue 15, item 3). An earlier version also required fits() to
    accept a device of exactly the measured peak plus margin and reserve, i.e. that the model never
    over-predicts; an unbiased model over-predicts some plans by a little, and that check failed at
    c2c0a56 (ddp +3.0%) as at cbf1202 (1/1/2 +0.6%): which plans the margin excludes near a device's
    limit is measured by scripts/bench/joint_memory_caps.py (BENCHMARKS.md), not asserted here."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "fidelity"
    subprocess.run([sys.executable, "scripts/bench/bench_memory_fidelity.py", "--ranks", "2", "--plans",
                    "1/1/1,1/1/2,2/2/2", "--layers", "2", "--dim", "512", "--vocab", "8192", "--seq", "64",
                    "--out", str(out)], cwd=root, check=True, capture_output=True, timeout=600)
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["plan"] for r in rows] == ["1/1/1", "1/1/2", "2/2/2"]
    for row in rows:
        assert abs(row["error_pct"]) <= 10, row


def test_gradient_buckets_follow_the_gradient_degree():
    """g > 1: a pair of units' flat reduce-scatter buffers (grad dtype) and the gradient being copied
    into the one filling (compute dtype); g = 1: each gradient is added
    into the G shard in its own hook (amsp.flat_unit take_grad), so one parameter's autograd gradient
    per unit (compute dtype): the fused head's weight gradient is its forward's d/dW, already priced
    with the head's activations. The ILP and the grid agree with evaluate() on mixed degrees."""
    from amsp.plan import Degrees, Plan

    w = workload("tiny", seq_len=128, mbs=2, micro_batches=2, precision="bf16")
    m, cfg = CostModel(w, flat_cluster(1, 8), Options()), w.model
    ffn = cfg.dim * cfg.ffn_hidden_dim
    vocab = cfg.vocab_size * cfg.dim
    assert w.head_loss_fused and w.largest_param_numel("head") == cfg.dim
    # pp = 1: the embedding's pair arrives after the activations are gone, so it is charged against them
    credit = m.bucket_pair_offsets()[m.buffer_pairs().index(("embedding", "block"))]
    assert w.activation_bytes_at_embedding_backward() == 0 and credit == m.constant_memory()["activations"]
    # each event is priced beside what is still alive then (Workload.activations_freed_before):
    # the last block fills once the head's backward freed its activations, the next block once the last
    # block's are gone too; the head alone once its forward's fp32 working tensors are gone
    head, layer, working = w.head_activation_bytes(), w.layer_activation_bytes(), w.block_backward_transient_bytes()
    head_fwd = w.head_forward_only_bytes()
    assert head_fwd == 2 * vocab * 4  # bf16 on CPU: fp32 W copy + d/dW
    g1 = m.evaluate(Plan(Degrees(1, 1, 8), Degrees(1, 1, 8), name="x")).memory["buckets"]
    # g = 1: one bf16 autograd gradient per unit (the block's largest matrix), the block's backward working
    # tensors; here every event is below what was freed before it, so the activations alone are the peak
    assert g1 == max(2 * ffn * 2 + working - head - layer, (ffn + cfg.dim) * 2 + working - head,
                     cfg.dim * 2 - head_fwd, (vocab + ffn) * 2 - credit, 0.0) == 0.0
    g8 = m.evaluate(Plan(Degrees(1, 8, 8), Degrees(1, 8, 8), name="x")).memory["buckets"]
    flat = (w.block_numel + w.head_numel) * w.precision.grad_bytes  # a block's and the head's flat buffers
    # ... and the block's largest gradient, being copied into its buffer while the head's is in flight
    assert g8 == pytest.approx(max(flat + ffn * 2 + working - head, 0.0), rel=1e-3)
    assert g1 <= g8
    # at tp > 1 too (traced at tp 2): the last block fills once the head's activations are gone
    tp2w = workload("tiny", seq_len=128, mbs=2, micro_batches=2, precision="bf16", tp=2)
    assert tp2w.activations_freed_before(("block", "head")) == tp2w.head_activation_bytes() > 0
    grid_matches_evaluate(m)
    tp2 = CostModel(workload("tiny", seq_len=128, mbs=2, micro_batches=2, precision="bf16", tp=2), flat_cluster(1, 8))
    # the embedding's pair comes last at tp > 1 too (traced at tp 2): charged against all the activations
    tp2_credit = tp2.bucket_pair_offsets()[tp2.buffer_pairs().index(("embedding", "block"))]
    assert tp2_credit == tp2.constant_memory()["activations"] > 0
    unfused = workload("tiny", seq_len=128, mbs=2, micro_batches=2, precision="bf16", kernels=EAGER_LOSS)
    assert unfused.largest_param_numel("head") == vocab
    # the eager head fills first, alone: its flat buffer and its vocab x dim autograd gradient in copy
    mu = CostModel(unfused, flat_cluster(1, 8), Options())
    head_alone = mu.evaluate(Plan(Degrees(1, 8, 8), Degrees(1, 8, 8), name="x")).memory["buckets"]
    assert head_alone == pytest.approx(max(unfused.head_numel * 2 + vocab * 2, flat + ffn * 2,
                                           unfused.loss_backward_transient_bytes()), rel=1e-3)
    grid_matches_evaluate(mu)


def test_head_memory_follows_the_loss_path_that_runs():
    """The fused linear + cross-entropy keeps d/dW and d/dh (and runs one fp32 chunk of logits) where the
    eager head keeps the cross-entropy's fp32 log-softmax alone (the logits are freed: measured on CPU,
    fp32 and bf16) and its backward holds 2 more fp32 logits (tp = pp = 1); a pipeline stage keeps its
    output logits too."""
    from amsp.planner.workload import FUSED_CHUNK_LOGITS

    fused = workload("tiny", seq_len=256, mbs=2, micro_batches=1, precision="fp32")
    eager = workload("tiny", seq_len=256, mbs=2, micro_batches=1, precision="fp32", kernels=EAGER_LOSS)
    m, t = fused.model, 512
    rows = min(t, FUSED_CHUNK_LOGITS // m.vocab_size)
    assert fused.head_activation_bytes() == m.vocab_size * m.dim * 4 + m.dim * 4 * t + rows * m.vocab_size * 4
    # the fused norm's input, the projection's input and the fp32 log-softmax, gone before the head's
    # weight gradient exists (the credit of the head's bucket event)
    assert eager.head_activation_bytes() == (2 * m.dim * 4 + m.vocab_size * 4) * t
    assert eager.activations_freed_before(("head",)) == eager.loss_saved_bytes() == m.vocab_size * 4 * t
    assert fused.loss_backward_transient_bytes() == 0
    assert eager.loss_backward_transient_bytes() == 2 * t * m.vocab_size * 4
    # bf16 on CUDA: 4x the rows a chunk, each logit in fp32 and bf16, the fp32 d/dW accumulator during
    # the forward (no fp32 copy of W: the CUDA kernel multiplies in bf16)
    from amsp.planner.workload import FUSED_CHUNK_LOGITS_CUDA

    cuda = workload("tiny", seq_len=256, mbs=2, micro_batches=1, precision="bf16",
                    kernels=Kernels(frozenset(AUTO_OPS), loss_kernel="cuda"))
    rows = min(t, FUSED_CHUNK_LOGITS_CUDA // m.vocab_size)
    assert cuda.head_forward_only_bytes() == m.vocab_size * m.dim * 4
    assert cuda.head_activation_bytes() == (m.vocab_size * m.dim * 2 + m.dim * 2 * t + rows * m.vocab_size * 6
                                            + m.vocab_size * m.dim * 4)
    off = workload("tiny", seq_len=256, mbs=2, micro_batches=1, precision="fp32",
                   model_overrides={"fused": "off"})
    assert not off.head_loss_fused  # model.fused=off: the eager path, whatever the device offers
    piped = workload("tiny", seq_len=256, mbs=2, micro_batches=1, precision="fp32", pp=2)
    assert not piped.head_loss_fused  # the pipeline's loss function is never fused
    assert piped.head_activation_bytes() == eager.head_activation_bytes() + m.vocab_size * 4 * t  # + the output


def test_pipeline_receive_buffers_are_priced_per_stage():
    """torch.distributed.pipelining keeps one receive buffer per micro-batch and direction: a middle stage
    holds both, the first only gradients, the last only activations, pp = 1 none."""
    from amsp.plan import Degrees
    from amsp.planner.joint.hetero import from_spec
    from amsp.planner.joint.search import _Candidate
    from amsp.planner.joint.stage_cost import Setting
    from amsp.schedule import Precision

    w = workload("tiny", seq_len=256, mbs=2, micro_batches=8, precision="bf16", tp=2, pp=4)
    hidden = 2 * 256 * w.model.dim * 2 / 2  # micro-batch x seq x dim, bf16, sequence-parallel over tp 2
    assert w.pipeline_buffer_bytes() == 8 * hidden * 2
    assert w.pipeline_buffer_bytes(first=True) == w.pipeline_buffer_bytes(last=True) == 8 * hidden
    assert workload("tiny", pp=1).pipeline_buffer_bytes() == 0
    s = Setting(w.model, 256, Precision.named("bf16"), 2, 4, 1, 2, 8, {}, memory_margin=0.0, reserved_bytes=0.0)
    pricer = _Candidate(s, from_spec(flat_cluster(1, 8))).pricers[0]
    acts = {(e, h): pricer.memory(2, e, h, Degrees(1, 1, 1), False, 1)[1]["activations"]
            for e, h in ((False, False), (True, False), (False, True))}
    assert acts[False, False] - acts[True, False] == pytest.approx(8 * hidden)  # the middle one receives both


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_layer_activations_match_what_autograd_keeps(dtype):
    """The per-layer activation term against the tensors autograd saves in a real block's forward on
    this CPU (SDPA with repeated K/V), with the fused CPU kernels and with the eager references: within
    5% (rstd and the attention's logsumexp are left out of the formula). The term before kernels were
    priced (4 f e T for the MLP, grouped K/V) is 10-23% off on these shapes."""
    import torch

    from amsp.planner.startup import kernels_for_model
    from amsp.schedule import Precision
    from models.llama.config import get_preset
    from models.llama.model import Llama
    from tests.planner.planner_cases import saved_activation_bytes

    torch.manual_seed(0)
    batch, seq = 2, 64
    for fused in ("auto", "off"):
        cfg = get_preset("debug").with_overrides(fused=fused, max_seq_len=seq)
        model = Llama(cfg)
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        for p in model.parameters():  # the engine's compute weights; the rotary tables stay fp32
            p.data = p.data.to(torch_dtype)
        kernels = kernels_for_model(cfg, "cpu", dtype)
        predicted = Workload(cfg, seq, batch, 1, Precision.named(dtype), kernels=kernels).layer_activation_bytes()
        measured = saved_activation_bytes(model, batch, seq, dtype=torch_dtype)
        assert measured == pytest.approx(predicted, rel=0.05), (fused, kernels, measured, predicted)


def test_startup_names_the_kernels_the_device_runs():
    """What train.py's startup tells the memory model: on CPU the csrc kernels model.fused enables and
    SDPA with repeated K/V; on a GPU without the CUDA build of csrc the eager references, and grouped
    K/V in bf16 (cuDNN / flash SDPA) but repeated in fp32."""
    from amsp.planner.startup import kernels_for_model
    from csrc.loader import CUDA_EXTENSION
    from models.llama.config import get_preset

    cfg = get_preset("debug")
    assert kernels_for_model(cfg, "cpu", "fp32") == Kernels(frozenset(AUTO_OPS), kv_repeated=True)
    assert kernels_for_model(cfg.with_overrides(fused="off"), "cpu", "fp32") == Kernels(frozenset(), True)
    assert kernels_for_model(cfg, "cpu", "fp32").describe() == (
        "activations priced for: fused ops linear_cross_entropy, rms_norm, rope, swiglu; K/V repeated per "
        "query head; blocks eager")
    if CUDA_EXTENSION.lib is None:
        # the CUDA loss kernel multiplies in the compute dtype: no fp32 copy of the head weight
        assert kernels_for_model(cfg, "cuda", "bf16") == Kernels(frozenset(), kv_repeated=False, loss_kernel="cuda")
        assert kernels_for_model(cfg, "cuda", "fp32") == Kernels(frozenset(), kv_repeated=True, loss_kernel="cuda")


def test_compiled_blocks_keep_what_the_fused_kernels_keep():
    """model.compile (on by default on CUDA, where csrc's kernels are often not built): inductor's
    partitioner recomputes the eager norms' normalised outputs and SiLU in the backward, so a compiled
    block with the eager references keeps what the fused-kernel formula prices (Kernels.compiled), far
    less than the eager formula. bf16, as on a GPU."""
    import torch

    from amsp.planner.startup import kernels_for_model
    from amsp.schedule import Precision
    from models.llama.config import get_preset
    from models.llama.model import Llama
    from tests.planner.planner_cases import saved_activation_bytes

    torch.manual_seed(0)
    batch, seq = 2, 128
    cfg = get_preset("debug").with_overrides(fused="off", max_seq_len=seq, dim=256, n_heads=8, n_kv_heads=4)
    model = Llama(cfg)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    block = model.layers[0]
    block.forward = torch.compile(block.forward, fullgraph=True)
    measured = saved_activation_bytes(model, batch, seq, dtype=torch.bfloat16)

    def priced(compiled: bool) -> float:
        kernels = kernels_for_model(cfg, "cpu", "bf16", compiled=compiled)
        return Workload(cfg, seq, batch, 1, Precision.named("bf16"), kernels=kernels).layer_activation_bytes()

    assert measured == pytest.approx(priced(True), rel=0.03)
    assert priced(False) > 1.2 * measured
