"""What one data-parallel rank has to hold and compute: units, FLOPs per unit, activation bytes.

Units are the engine's flat buffers (amsp/engine.py): each transformer block ("blocks" group), the
embedding and the final norm + output head ("embed_head" group); with tied embeddings the embedding
and the head are one unit, gathered from the embedding's forward to the head's. With tensor parallelism (tp) a
unit's parameters, FLOPs and activations are split tp ways; with pipeline parallelism (pp) the rank
priced is the one holding the most blocks of the runtime's split (parallel.layer_split, else balanced).
For memory we keep the embedding and the head on every stage, which is
exact for pp = 1 and conservative (by one of the two) for pp > 1.

Activation memory per transformer layer and micro-batch, following Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", eq. 1: s*b*h*(34 + 5*a*s/h) bytes
for GPT with fp16 and dropout), adapted to LLaMA and to the kernels the run executes (Kernels): no
dropout masks, a fused attention kernel that keeps no s x s score matrix (its per-row softmax
statistics are negligible), a SwiGLU MLP of width f. With e bytes per element, T = s*b tokens, a rank
holding the fraction r of the sequence in the residual stream (1/tp with sequence parallelism, else 1)
and K the width of the K/V the attention kernel keeps (h_kv = n_kv_heads*head_dim, or h where it takes
repeated K/V copies), the tensors autograd keeps in `none` mode are, per layer:
  each of the 2 norms: its input, e r h T with the fused kernel; its fp32 input and normalised
             output, (4 + e) r h T, with the eager reference (models/llama/backends.py)
  each of the 2 column-parallel inputs (the norm's output, all-gathered under sequence
             parallelism): e h T, the whole sequence
  Q, K, V (after rotary) and the attention output: (2h + 2K) e T / tp
  SwiGLU: gate and up, and their product for the down projection, 3 f e T / tp with the fused
             kernel; silu(gate) besides with the eager one, 4 f e T / tp
(scripts/bench/joint_memory_caps.py's model, fp32, T = 512, saved tensors counted through
torch.autograd.graph.saved_tensors_hooks: 24.0 MiB per layer at tp 1 with the CPU kernels, 15.0 at
tp 2; a test holds the formula to the saved tensors. Resident set kept by 4 blocks' forward, MHA:
24.07 / 15.08 MiB per layer, and with selective recomputation 18.54 / 10.79 MiB against 18.50 / 10.75
priced; a test holds these too.)
  selective: the model's policy keeps matmul and attention outputs and recomputes norms, rotary and
             SiLU: layer input, Q, K, V, attention out, w1 out, w3 out, and wo out, w2 out, which
             under TP are whole-sequence partial sums before their reduce-scatter
                                                 -> (r h + (2h + 2h_kv + 2f) / tp + 2h) e T
             (tp 1: 5h + 2h_kv + 2f)
  full:      the layer input only (e r h T), plus one layer's `none` set while it is recomputed.
The output head keeps its norm's input, the projection's (whole-sequence) input and the logits in
the compute dtype plus an fp32 copy for the loss: (norm + h e + V (e + 4) / tp) T. Where the head computes the
loss through the fused linear + cross-entropy (models/llama/fused.py; tp = pp = 1), its forward
already produces both gradients and keeps them for the backward instead of any logits: d/dW (V h, in
the weight's dtype) and d/dh (h e T), while it runs one chunk of fp32 logits (fused.default_chunk
rows of V; on CUDA with their compute-dtype copy) and, for a reduced-precision weight, an fp32
accumulator of d/dW and, on CPU, an fp32 copy of W (Kernels.loss_kernel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from amsp.parallel.micro_batches import SCHEDULES
from amsp.schedule import Precision, Unit
from models.llama.config import LlamaConfig
from models.llama.fused_ops import ALL_OPS, AUTO_OPS, CHUNK_LOGITS

RECOMPUTE_MODES = ("none", "full", "selective")
# logits per chunk of the fused head's forward (fused.default_chunk), on CPU and on CUDA
FUSED_CHUNK_LOGITS = CHUNK_LOGITS["cpu"]
FUSED_CHUNK_LOGITS_CUDA = CHUNK_LOGITS["cuda"]


@dataclass(frozen=True)
class Kernels:
    """The kernels a run executes where they change what autograd keeps: the fused ops with a native
    kernel on the run's device (models.llama.fused.ops_running; under tensor parallelism the model still
    runs the loss, and with sequence parallelism the norms, eagerly), and whether the attention kernel
    takes repeated K/V copies for grouped-query heads (SDPA on CPU and in fp32 on CUDA) rather than
    the grouped heads themselves (cuDNN / flash SDPA in bf16, flash-attn, Transformer Engine); and
    whether the blocks run under torch.compile (amsp/compile.py; only with tp = pp = 1), whose
    partitioner recomputes each norm's normalised output and SiLU in the backward and so keeps what the
    fused kernels keep (a compiled block on CPU, eager references inside: its saved tensors within 1.3% of
    the fused-kernel formula, fp32 and bf16, 22-28% under the eager one)."""
    fused: frozenset = frozenset()
    kv_repeated: bool = False
    compiled: bool = False
    # Which fused-loss kernel runs: the CPU one multiplies by an fp32 copy of the head weight, in chunks
    # of 8M logits; the CUDA one multiplies in the compute dtype (d/dW accumulated in fp32), in chunks of
    # 32M logits held in fp32 and in the compute dtype (models/llama/fused.py default_chunk).
    loss_kernel: str = "cpu"

    def describe(self) -> str:
        """One line for the planner's startup log and plan.txt: what the activations are priced for."""
        return (f"activations priced for: fused ops {', '.join(sorted(self.fused)) or 'none'}; "
                f"K/V {'repeated per query head' if self.kv_repeated else 'grouped'}; "
                f"blocks {'compiled' if self.compiled else 'eager'}")


def default_kernels(model: LlamaConfig) -> Kernels:
    """What the planner assumes without a device to ask: every op model.fused enables runs fused."""
    return Kernels(fused=frozenset({"off": (), "on": ALL_OPS}.get(model.fused, tuple(AUTO_OPS))))


# Layer-equivalents the default pipeline split gives the embedding and the head (norm + vocabulary projection +
# loss): the head of a LLaMA-7B costs about two thirds of a block's FLOPs per token and the embedding little
# compute but a vocabulary-sized table, so one layer each keeps the end stages from being the stragglers
# (torchtitan weights them the same way).
EMBED_WEIGHT = 1.0
HEAD_WEIGHT = 1.0


def pipeline_split(n_layers: int, stages: int, layer_split=None) -> list[int]:
    """Blocks per stage, for the planner and the runtime alike (amsp.parallel.pipeline.split_layers; here
    because this module imports no torch, as the planner CLI must not): `layer_split` wins; otherwise equal
    shares of n_layers + EMBED_WEIGHT + HEAD_WEIGHT layer-equivalents, every stage keeping at least one
    block. A split that cannot run is a ValueError."""
    if stages < 1:
        raise ValueError(f"pipeline stages must be >= 1, got {stages}")
    if layer_split is not None:
        split = [int(n) for n in layer_split]
        if len(split) != stages or sum(split) != n_layers or min(split) < 1:
            raise ValueError(f"parallel.layer_split={split} must give {stages} stages of >= 1 layer summing to "
                             f"model.n_layers={n_layers}")
        return split
    if stages > n_layers:
        raise ValueError(f"{stages} pipeline stages for model.n_layers={n_layers}: every stage needs a block")
    total = n_layers + EMBED_WEIGHT + HEAD_WEIGHT
    bounds = [math.floor(total * k / stages - EMBED_WEIGHT + 0.5) for k in range(stages + 1)]
    bounds[0], bounds[-1] = 0, n_layers
    for k in range(1, stages):  # at least one block each, and room left for the stages after
        bounds[k] = min(max(bounds[k], bounds[k - 1] + 1), n_layers - (stages - k))
    return [bounds[k + 1] - bounds[k] for k in range(stages)]


@dataclass(frozen=True)
class Workload:
    model: LlamaConfig
    seq_len: int
    micro_batch_size: int
    micro_batches: int  # per rank per optimizer step
    precision: Precision
    recompute: str = "none"
    tp: int = 1
    pp: int = 1
    # What the run's device executes (train.py's startup knows: amsp.planner.startup.kernels_for_run).
    # None: every op model.fused enables runs fused and attention keeps grouped K/V, which the planner
    # CLI assumes (it cannot know the device's build).
    kernels: Kernels | None = None
    # the residual stream is split over the TP group between blocks (parallel.sequence_parallel)
    sequence_parallel: bool = True
    # the cross-entropy runs on vocabulary-sharded logits under tp > 1 (parallel.loss_parallel); off, the
    # head all-gathers the full logits on every TP rank and the plain cross-entropy runs on them
    loss_parallel: bool = True
    # one stage of a pipeline priced on its own (the joint planner's per-stage workloads have pp = 1):
    # its loss runs in the pipeline's loss function and its blocks are not compiled, as with pp > 1
    pipeline_stage: bool = False
    # the pipeline schedule a hand-named pp > 1 runs (parallel.schedule / parallel.virtual_stages): its
    # bubble and how many micro-batches' activations a stage holds (the joint planner prices 1F1B)
    schedule: str = "1f1b"
    virtual_stages: int = 1
    # blocks per (virtual) stage as parallel.layer_split names them; None: the runtime's balanced split
    layer_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recomputation mode {self.recompute!r} is not one of {RECOMPUTE_MODES}")
        if self.micro_batches < 1 or self.micro_batch_size < 1 or self.seq_len < 1:
            raise ValueError("micro_batches, micro_batch_size and seq_len must be positive")
        if self.pp < 1:
            raise ValueError(f"pipeline degree pp={self.pp} must be >= 1")
        if self.schedule not in SCHEDULES or self.virtual_stages < 1:
            raise ValueError(f"pipeline schedule {self.schedule!r} x {self.virtual_stages} virtual stages: expected "
                             f"one of {SCHEDULES} and >= 1")
        # no divisibility rule: the runtime splits any n_layers (amsp.parallel.pipeline.split_layers), and a
        # split it cannot make is refused here with its reason, so the planner never prices another split
        self.stage_layers()

    @property
    def run_kernels(self) -> Kernels:
        return self.kernels if self.kernels is not None else default_kernels(self.model)

    @property
    def pipelined(self) -> bool:
        """Whether the model runs under a pipeline schedule (pp > 1, or a stage priced on its own)."""
        return self.pp > 1 or self.pipeline_stage

    @property
    def head_loss_fused(self) -> bool:
        """Whether the head's loss runs fused (the pipeline's loss function and DTensor's loss_parallel
        are never fused)."""
        if self.tp > 1 or self.pipelined:
            return False
        return "linear_cross_entropy" in self.run_kernels.fused

    @property
    def loss_vocab(self) -> float:
        """Vocabulary entries of the logits one rank's loss holds per token: its 1/tp shard under
        loss_parallel, the whole vocabulary without tensor parallelism or with loss_parallel off (the head's
        output all-gathered on every TP rank, amsp.parallel.tensor_parallel)."""
        return self.model.vocab_size / self.tp if self.tp > 1 and self.loss_parallel else self.model.vocab_size

    @property
    def stream_fraction(self) -> float:
        """The fraction of a micro-batch's positions a rank holds in the residual stream."""
        return 1 / self.tp if self.tp > 1 and self.sequence_parallel else 1.0

    def norm_kept_bytes(self) -> float:
        """What one RMSNorm keeps for its backward per token: its input with the fused kernel (which
        saves the rstd beside it); the fp32 input and the normalised output with the eager reference.
        Under sequence parallelism the norms see DTensors and run the reference
        (amsp.parallel.tensor_parallel._use_unfused_where_sharded)."""
        e = self.act_bytes
        fused = self.runs_fused("rms_norm") and not (self.tp > 1 and self.sequence_parallel)
        return (e if fused else 4 + e) * self.model.dim * self.stream_fraction

    def runs_fused(self, op: str) -> bool:
        """Whether `op` keeps what its fused kernel keeps: the kernel runs, or a compiled block recomputes
        what the eager reference would keep (compiled only with tp = pp = 1: amsp/build.py)."""
        kernels = self.run_kernels
        return op in kernels.fused or (kernels.compiled and self.tp == 1 and not self.pipelined)

    # ---- units ----
    def stage_layers(self) -> list[int]:
        """Blocks of each (virtual) stage, in stage order: what the pipeline builds (pipeline_split)."""
        stages = self.pp * self.virtual_stages if self.pp > 1 else 1
        return pipeline_split(self.model.n_layers, stages, self.layer_split if self.pp > 1 else None)

    @property
    def layers(self) -> int:
        """Blocks of the pipeline rank holding the most (its chunks' stages: s % pp, as
        amsp.parallel.pipeline.rank_stages places them): the worst stage the rank is priced as. An uneven
        split (n_layers not divisible by pp, or an explicit parallel.layer_split) prices its largest rank."""
        per_stage = self.stage_layers()
        if self.pp < 2:
            return per_stage[0]
        return max(sum(per_stage[s] for s in range(r, len(per_stage), self.pp)) for r in range(self.pp))

    @property
    def block_numel(self) -> int:
        return -(-self.model.block_params() // self.tp)

    @property
    def embedding_numel(self) -> int:
        return -(-self.model.embedding_params() // self.tp)

    @property
    def head_numel(self) -> int:
        return -(-self.model.head_params() // self.tp)

    def unit_roles(self) -> list[tuple[Unit, str]]:
        """The flat units of one rank in forward order (named as the engine names them), each with
        its role for the cost model: embedding (first), block, head (last). A rank of a pipeline (pp > 1)
        is priced as its worst stage: n_layers / pp blocks and the head, which is the embedding's table
        and the final norm (the first stage holds the embedding instead; tied embeddings cannot be
        pipelined). Pricing both, as before, put a vocabulary table's weights, gradients and optimizer
        states on every rank: +43.5% on a pp 2 run's peak (BENCHMARKS.md, pipeline schedules)."""
        blocks = [(Unit(f"layers.{i}", "blocks", self.block_numel), "block") for i in range(self.layers)]
        if self.model.tie_embeddings:
            return [(Unit("embed_head", "embed_head", self.embedding_numel + self.head_numel), "embedding")] + blocks
        head = [(Unit("head", "embed_head", self.head_numel), "head")]
        if self.pp > 1:
            return blocks + head
        return [(Unit("tok_embeddings", "embed_head", self.embedding_numel), "embedding")] + blocks + head

    def units(self) -> list[Unit]:
        return [u for u, _ in self.unit_roles()]

    def role_numel(self) -> dict:
        return {role: u.numel for u, role in self.unit_roles()}

    def largest_param_numel(self, role: str) -> int:
        """Elements of the role's largest parameter tensor on this rank (tp-sharded): one autograd
        gradient of it is what a g = 1 unit holds in its backward (cost_model.grad_bucket_bytes). The
        fused head's weight gradient is its forward's d/dW, priced with the head's activations."""
        m = self.model
        if role == "block":
            full = m.dim * max(m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.ffn_hidden_dim)
        elif role == "head" and self.head_loss_fused:
            return m.dim
        else:  # the embedding (the tied embedding+head unit too) and an unfused head: vocab x dim
            full = m.vocab_size * m.dim
        return -(-full // self.tp)

    def params_per_rank(self) -> int:
        """Parameters of the units one rank holds (unit_roles: a pipelined rank's worst stage)."""
        return sum(u.numel for u in self.units())

    # ---- compute (FLOPs per micro-batch, the models/llama/flops.py convention) ----
    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size

    def block_forward_flops(self) -> float:
        m = self.model
        per_token = 2.0 * m.block_params() + 4.0 * m.n_heads * m.head_dim * self.seq_len
        return per_token * self.tokens_per_micro_batch / self.tp

    def head_forward_flops(self) -> float:
        return 2.0 * self.model.vocab_size * self.model.dim * self.tokens_per_micro_batch / self.tp

    def block_backward_flops(self) -> float:
        """Backward is twice the forward; full recomputation runs the forward once more."""
        extra = self.block_forward_flops() if self.recompute == "full" else 0.0
        return 2.0 * self.block_forward_flops() + extra

    def model_flops_per_step(self) -> float:
        """FLOPs of one optimizer step on one rank without recomputation (what MFU counts)."""
        per_mb = 3.0 * (self.layers * self.block_forward_flops() + self.head_forward_flops())
        return per_mb * self.micro_batches

    def pipeline_bubble(self) -> float:
        """The schedule's bubble as a fraction of the compute time. 1F1B and GPipe: (pp - 1) / micro-batches;
        interleaved over v virtual stages: 1/v of that (Narayanan et al. 2021); zero bubble (ZB1P, weight
        passes filling the bubble, Qi et al. 2024): (pp - 1) (T_F + T_B - T_W) / (v m (T_F + T_B + T_W))
        with the backward's input and weight halves equal, i.e. the forward's share of the 1F1B bubble.
        Not priced: the zero-bubble weight pass's own cost (torch reruns the backward nodes between a
        weight and the hidden state's path); on CPU it left zero bubble 7% (v = 1) and 3% (v = 2) slower
        than this (BENCHMARKS.md, pipeline schedules)."""
        one_f_one_b = (self.pp - 1) / self.micro_batches
        if self.schedule == "interleaved":
            return one_f_one_b / self.virtual_stages
        if self.schedule == "zero_bubble":
            fwd = self.block_forward_flops()
            return one_f_one_b * fwd / (fwd + self.block_backward_flops()) / self.virtual_stages
        return one_f_one_b

    def micro_batches_in_flight(self) -> int:
        """Micro-batches whose activations the first stage holds at once: 1F1B (and zero bubble, plus its
        pending weight pass: pending_weight_pass_bytes) pp of them, GPipe every one (all forwards run
        before the first backward)."""
        if self.schedule == "gpipe":
            return self.micro_batches
        return min(self.pp, self.micro_batches)

    # ---- activations ----
    @property
    def act_bytes(self) -> int:
        return self.precision.param_bytes  # activations live in the compute dtype

    def layer_activation_bytes(self, mode: str | None = None) -> float:
        m, e, t, tp = self.model, self.act_bytes, self.tokens_per_micro_batch, self.tp
        h, f = m.dim, m.ffn_hidden_dim
        hkv = m.n_kv_heads * m.head_dim
        mode = mode or self.recompute
        if mode == "selective":
            # the row-parallel projections' matmul outputs are whole-sequence partial sums (h each)
            return (h * self.stream_fraction + (2 * h + 2 * hkv + 2 * f) / tp + 2 * h) * e * t
        if mode == "full":
            return h * e * t * self.stream_fraction
        kernels = self.run_kernels
        # repeated K/V are copies, except of a single local KV head (backends.repeat_kv's reshape is a view)
        kv = h if kernels.kv_repeated and m.n_kv_heads // tp > 1 else hkv
        swiglu = 3 if self.runs_fused("swiglu") else 4
        per_token = 2 * self.norm_kept_bytes() + 2 * h * e + ((2 * h + 2 * kv) + swiglu * f) * e / tp
        return per_token * t

    def head_activation_bytes(self) -> float:
        m, e, t = self.model, self.act_bytes, self.tokens_per_micro_batch
        if self.head_loss_fused:
            cuda = self.run_kernels.loss_kernel == "cuda"
            rows = min(t, max(1, (FUSED_CHUNK_LOGITS_CUDA if cuda else FUSED_CHUNK_LOGITS) // m.vocab_size))
            per_logit = 4 + e if cuda and e != 4 else 4  # fp32 logits, and on CUDA their compute-dtype copy
            return (m.vocab_size * m.dim * e + m.dim * e * t + rows * m.vocab_size * per_logit
                    + self.head_forward_only_bytes())
        # beside the cross-entropy's saved log-softmax, the logits only where the pipeline's schedule
        # holds them as the stage's output (in the model, lm_loss under loss_parallel, they are freed:
        # a tp 2 trace's head kept one local fp32 logits tensor, 34 MiB, where two had been priced);
        # with loss_parallel off that output is the all-gathered, full-vocabulary logits
        logits_kept = self.loss_vocab * e if self.pipelined else 0
        return (self.norm_kept_bytes() + m.dim * e + logits_kept) * t + self.loss_saved_bytes()

    def loss_saved_bytes(self) -> float:
        """The unfused cross-entropy's saved fp32 log-softmax (local logits' size), part of the head's
        activations and gone once the loss's backward has run, before the head's weight gradient
        exists: a trace of pp 2's last stage at 2/2/2 peaked as the head's gradient was copied into its
        flat buffer 63 MiB below the head's activations plus its gradient pair (T x V x 4 = 62.5 MiB).
        The fused head keeps no log-softmax: nothing. With tp > 1 and loss_parallel off the log-softmax is of
        the full logits every TP rank gathers (loss_vocab)."""
        if self.head_loss_fused:
            return 0.0
        return self.tokens_per_micro_batch * self.loss_vocab * 4

    def head_forward_only_bytes(self) -> float:
        """The fused head's forward working tensors that are gone before its backward: in bf16/fp16 the
        fp32 d/dW accumulator, and on CPU the fp32 copy of the weight it multiplies by (Kernels.
        loss_kernel). Its backward holds only the d/dW and d/dh the forward kept. Measured on an H100
        (1.07B, seq 4096, bf16): the head's forward peaked at 0.81 GiB with the 0.49 GiB accumulator; the
        backward's peak had none of it."""
        if not self.head_loss_fused or self.act_bytes == 4:
            return 0.0
        copies = 1 if self.run_kernels.loss_kernel == "cuda" else 2  # the accumulator (+ the CPU's W copy)
        return copies * self.model.vocab_size * self.model.dim * 4

    def block_backward_transient_bytes(self) -> float:
        """A block's backward working tensors beside its saved activations while its weight gradients
        arrive: the SwiGLU backward's two input gradients (tokens x local ffn each, compute dtype), the
        largest pair alive at once (an H100's allocation trace at the peak of a 2/8/8 plan: 0.168 GiB at
        dim 4096, ffn 11008, 4096 tokens, bf16, exactly these two)."""
        return 2 * self.tokens_per_micro_batch * self.model.ffn_hidden_dim / self.tp * self.act_bytes

    def activations_freed_before(self, roles: tuple[str, ...]) -> float:
        """Activation bytes already freed when a gradient-bucket event happens (roles: the unit filling,
        then the one in flight; cost_model.bucket_events), where the model has a head of its own: the
        fused head alone has dropped its forward's working tensors; the last block fills once the head's
        backward freed the head's activations; the next block once the last block's are gone too.
        Measured with tp = pp = 1 (H100, pretend world of 8: the plans with g > 1 were over-predicted by
        18-21% without it) and, since 28 Nov, at tp 2 (a trace of tp 2 at 1/2/2 peaks, 739 MiB above
        the build, at the wait of the head's reduce-scatter while the last block's is launched: the
        head's activations are gone; the fidelity row moved from +7.9% to +2.1% with the credit)."""
        if roles == ("head",):
            return self.head_forward_only_bytes() + self.loss_saved_bytes()
        if roles == ("block", "head"):
            return self.head_activation_bytes()
        if roles == ("block", "block"):
            return self.head_activation_bytes() + self.layer_activation_bytes()
        return 0.0

    def loss_backward_transient_bytes(self) -> float:
        """The unfused cross-entropy's backward on the last stage, before any parameter gradient
        exists: its fp32 working tensors of the local logits' size, 2 for the plain cross-entropy
        (pp > 1: the pipeline's loss function) and 3 under DTensor's loss_parallel (tp > 1). RSS of
        the last stage of train.py runs (dim 768, V 32000, T 512, fp32; scripts/bench/joint_memory_caps.py
        traced by phase): 126 MiB at tp 1 (2.0 local logits), 98 MiB at tp 2 (3.1). The plain
        cross-entropy of the head itself (tp = pp = 1, fused loss off or without a kernel for the
        device) holds the same 2. The fused linear + cross-entropy holds no logits in its backward:
        nothing (its forward's transients are in head_activation_bytes). The loss's forward transient
        (under loss_parallel one local logits tensor beyond what the head keeps: its log-softmax holds
        the shifted logits and their exponent) is gone before this one, which is larger, begins: the
        models charge the larger alone (a tp 2 run's head stage measured +94 MiB over its forward's end
        in the loss, 3.0 local logits; summing both over-predicted it by 31 MiB). With tp > 1 and loss_parallel
        off the plain cross-entropy runs on the full logits every TP rank gathered: its 2 at the whole
        vocabulary (its forward, the gathered logits in the compute dtype beside their fp32 copy and
        log-softmax, is no larger than that beside the saved log-softmax)."""
        if self.head_loss_fused:
            return 0.0
        sharded = self.tp > 1 and self.loss_parallel  # DTensor's loss_parallel
        return self.tokens_per_micro_batch * self.loss_vocab * 4 * (3 if sharded else 2)

    def pipeline_buffer_bytes(self, first: bool = False, last: bool = False, stages: int | None = None) -> float:
        """torch.distributed.pipelining's receive buffers, which a stage allocates once per micro-batch
        of the step and keeps: the activation it receives (all but the first stage) and the gradient
        of its output (all but the last), each a boundary hidden state (micro-batch x seq/tp x dim,
        compute dtype; amsp.parallel.pipeline._boundary_shapes). 70B at tp 8 with 64 micro-batches of
        4096 tokens: 1 GiB per middle stage. Without a stage named, a middle stage's."""
        if (self.pp if stages is None else stages) < 2:
            return 0.0
        hidden = self.tokens_per_micro_batch * self.model.dim * self.act_bytes * self.stream_fraction
        return self.micro_batches * hidden * ((not first) + (not last))

    def activation_bytes_at_embedding_backward(self) -> float:
        """What is alive when the (untied) embedding's gradient arrives, the last of a micro-batch's
        backward: the other micro-batches in flight (1F1B keeps pp of them on the first stage) and the
        pipeline's buffers; with pp = 1 nothing of the activations. The embedding's gradient pair is
        priced beside this rather than beside the full activations, at any tp. Until 28 Nov not with
        tp > 1 (a 25 Nov trace of tp 2 x pp 2's first stage read 4.4% over the prediction with this
        credit, TP layers then priced as saved); a 28 Nov trace of tp 2 at 2/2/2 had the embedding's
        pair at 558 MiB above the build against the run's peak of 670 in the head's backward, and
        with the credit the tp 2 fidelity rows moved from +10.1 / +7.9 / +6.4% to +7.4 / +2.1 / -1.2%
        (tp 2 x pp 2's first stage the last)."""
        in_flight = self.micro_batches_in_flight()
        per_mb = self.layers * self.layer_activation_bytes() + self.head_activation_bytes()
        return (in_flight - 1) * per_mb + self.pipeline_buffer_bytes()

    def activation_bytes(self) -> float:
        """Peak activation bytes on one rank: stored layers of the in-flight micro-batches, the
        head, and under recomputation one layer's full set while it is recomputed; with pp > 1 the
        pipeline's receive buffers (a middle stage's)."""
        in_flight = self.micro_batches_in_flight()
        stored = self.layers * in_flight * self.layer_activation_bytes()
        transient = self.layer_activation_bytes("none") if self.recompute != "none" else 0.0
        # the head's stage runs each micro-batch's backward right after its forward, except under GPipe,
        # whose last stage keeps every micro-batch's logits until the backwards start
        heads = self.micro_batches if self.pp > 1 and self.schedule == "gpipe" else 1
        return (stored + transient + heads * self.head_activation_bytes() + self.pipeline_buffer_bytes()
                + self.pending_weight_pass_bytes())

    def pending_weight_pass_bytes(self) -> float:
        """Zero bubble: torch's input-gradient pass keeps the micro-batch's graph (retain_graph) until its
        weight pass, so a stage holds one more micro-batch than under 1F1B, a chunk of it with virtual
        stages (1/v of the layers; the head's on its chunk). Measured on the CPU bench (pp 2, 4 micro-batches
        of 512 tokens): +195 MiB on the largest rank against 1F1B, where this prices 189 (one micro-batch of
        4 layers and the head); +81 with two virtual stages, priced 95 (BENCHMARKS.md, pipeline schedules)."""
        if self.pp < 2 or self.schedule != "zero_bubble":
            return 0.0
        return (self.layers * self.layer_activation_bytes() + self.head_activation_bytes()) / self.virtual_stages
