"""What one data-parallel rank has to hold and compute: units, FLOPs per unit, activation bytes.

Units are the engine's flat buffers (amsp/engine.py): each transformer block ("blocks" group), the
embedding and the final norm + output head ("embed_head" group); with tied embeddings the embedding
and the head are one unit, gathered from the embedding's forward to the head's. With tensor parallelism (tp) a
unit's parameters, FLOPs and activations are split tp ways; with pipeline parallelism (pp) a rank
holds n_layers/pp blocks. For memory we keep the embedding and the head on every stage, which is
exact for pp = 1 and conservative (by one of the two) for pp > 1.

Activation memory per transformer layer and micro-batch, following Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", eq. 1: s*b*h*(34 + 5*a*s/h) bytes
for GPT with fp16 and dropout), adapted to LLaMA: no dropout masks, RMSNorm, a fused attention kernel
that keeps no s x s score matrix (flash / memory-efficient SDPA; its per-row softmax statistics are
negligible), grouped-query K/V of width h_kv = n_kv_heads*head_dim, and a SwiGLU MLP of width f.
With e bytes per element and T = s*b tokens, the tensors autograd keeps are
  none:      norm in, norm out, Q, K, V, attention out, norm in, norm out   -> (6h + 2h_kv) e T
             gate, up, silu(gate), silu(gate)*up                            -> 4f e T
  selective: the model's policy keeps matmul and attention outputs and recomputes norms, rotary and
             SiLU: layer input, Q, K, V, attention out, wo out, w1 out, w3 out, w2 out
                                                                            -> (5h + 2h_kv + 2f) e T
  full:      the layer input only (h e T), plus one layer's `none` set while it is recomputed.
The output head keeps its input and the logits in the compute dtype plus an fp32 copy for the loss:
(h e + V (e + 4)) T. All divided by tp (sequence parallelism assumed). Where the head computes the
loss through the fused linear + cross-entropy (models/llama/fused.py; tp = pp = 1), its forward
already produces both gradients and keeps them for the backward instead of any logits: d/dW (V h, in
the weight's dtype) and d/dh (h e T), while it runs one chunk of fp32 logits (fused.default_chunk
rows of V) and, for a reduced-precision weight, an fp32 copy of W and an fp32 accumulator of d/dW.
"""
from __future__ import annotations

from dataclasses import dataclass

from amsp.schedule import Precision, Unit
from models.llama.config import LlamaConfig

RECOMPUTE_MODES = ("none", "full", "selective")
# models/llama/fused.py default_chunk: about 8M fp32 logits per chunk of the fused head's forward
FUSED_CHUNK_LOGITS = 1 << 23


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
    # The head computes the loss through the fused linear + cross-entropy. None: it does wherever it
    # can (tp = pp = 1 and model.fused not off); train.py's startup passes what its device runs
    # (the fused kernel exists for that device), the planner CLI cannot know and assumes it.
    fused_loss: bool | None = None

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recomputation mode {self.recompute!r} is not one of {RECOMPUTE_MODES}")
        if self.micro_batches < 1 or self.micro_batch_size < 1 or self.seq_len < 1:
            raise ValueError("micro_batches, micro_batch_size and seq_len must be positive")
        if self.model.n_layers % self.pp:
            raise ValueError(f"pipeline degree pp={self.pp} must divide n_layers={self.model.n_layers}")

    @property
    def head_loss_fused(self) -> bool:
        """Whether the head's loss runs fused (the pipeline's loss function and DTensor's loss_parallel
        are never fused)."""
        if self.tp > 1 or self.pp > 1:
            return False
        return self.model.fused != "off" if self.fused_loss is None else self.fused_loss

    # ---- units ----
    @property
    def layers(self) -> int:
        return self.model.n_layers // self.pp

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
        its role for the cost model: embedding (first), block, head (last)."""
        blocks = [(Unit(f"layers.{i}", "blocks", self.block_numel), "block") for i in range(self.layers)]
        if self.model.tie_embeddings:
            return [(Unit("embed_head", "embed_head", self.embedding_numel + self.head_numel), "embedding")] + blocks
        return ([(Unit("tok_embeddings", "embed_head", self.embedding_numel), "embedding")] + blocks
                + [(Unit("head", "embed_head", self.head_numel), "head")])

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
        return self.embedding_numel + self.layers * self.block_numel + self.head_numel

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
        """1F1B bubble as a fraction of the compute time: (pp - 1) / micro-batches."""
        return (self.pp - 1) / self.micro_batches

    # ---- activations ----
    @property
    def act_bytes(self) -> int:
        return self.precision.param_bytes  # activations live in the compute dtype

    def layer_activation_bytes(self, mode: str | None = None) -> float:
        m, e, t = self.model, self.act_bytes, self.tokens_per_micro_batch
        h, f = m.dim, m.ffn_hidden_dim
        hkv = m.n_kv_heads * m.head_dim
        mode = mode or self.recompute
        if mode == "none":
            width = 6 * h + 2 * hkv + 4 * f
        elif mode == "selective":
            width = 5 * h + 2 * hkv + 2 * f
        else:
            width = h
        return width * e * t / self.tp

    def head_activation_bytes(self) -> float:
        m, e, t = self.model, self.act_bytes, self.tokens_per_micro_batch
        if self.head_loss_fused:
            rows = min(t, max(1, FUSED_CHUNK_LOGITS // m.vocab_size))  # fused.default_chunk
            widened = 0 if e == 4 else 2 * m.vocab_size * m.dim * 4  # fp32 W copy and d/dW accumulator
            return m.vocab_size * m.dim * e + m.dim * e * t + rows * m.vocab_size * 4 + widened
        return (m.dim * e + m.vocab_size * (e + 4)) * t / self.tp

    def parallel_loss_transient_bytes(self) -> float:
        """With tp > 1 the cross-entropy runs on vocabulary-sharded fp32 logits under DTensor's
        loss_parallel, whose log-softmax holds the shifted logits and their exponent beside the logits:
        one local logits tensor (T * V/tp fp32) more at its peak than the plain cross-entropy the head's
        activation term prices (measured on 2 gloo ranks, T=512, V=32000: 3.5 against 2.5 local logits
        beyond the weight gradient)."""
        if self.tp == 1:
            return 0.0
        return self.tokens_per_micro_batch * self.model.vocab_size / self.tp * 4

    def loss_backward_transient_bytes(self, pipelined: bool | None = None) -> float:
        """The unfused cross-entropy's backward on the last stage, before any parameter gradient
        exists: its fp32 working tensors of the local logits' size, 2 for the plain cross-entropy
        (pp > 1: the pipeline's loss function) and 3 under DTensor's loss_parallel (tp > 1). RSS of
        the last stage of train.py runs (dim 768, V 32000, T 512, fp32; scripts/bench/joint_memory_caps.py
        traced by phase): 126 MiB at tp 1 (2.0 local logits), 98 MiB at tp 2 (3.1). The plain
        cross-entropy of the head itself (tp = pp = 1, fused loss off or without a kernel for the
        device) holds the same 2. The fused linear + cross-entropy holds no logits in its backward:
        nothing (its forward's transients are in head_activation_bytes). `pipelined` overrides pp > 1
        (the joint planner prices each stage with a pp = 1 workload)."""
        pipelined = self.pp > 1 if pipelined is None else pipelined
        if self.head_loss_fused and not pipelined:
            return 0.0
        return self.tokens_per_micro_batch * self.model.vocab_size / self.tp * 4 * (3 if self.tp > 1 else 2)

    def pipeline_buffer_bytes(self, first: bool = False, last: bool = False, stages: int | None = None) -> float:
        """torch.distributed.pipelining's receive buffers, which a stage allocates once per micro-batch
        of the step and keeps: the activation it receives (all but the first stage) and the gradient
        of its output (all but the last), each a boundary hidden state (micro-batch x seq/tp x dim,
        compute dtype; amsp.parallel.pipeline._boundary_shapes). 70B at tp 8 with 64 micro-batches of
        4096 tokens: 1 GiB per middle stage. Without a stage named, a middle stage's."""
        if (self.pp if stages is None else stages) < 2:
            return 0.0
        hidden = self.tokens_per_micro_batch * self.model.dim * self.act_bytes / self.tp
        return self.micro_batches * hidden * ((not first) + (not last))

    @property
    def embedding_gradient_comes_last(self) -> bool:
        """Whether the (untied) embedding's gradient pair is priced beside only what is alive at the end
        of a backward (activation_bytes_at_embedding_backward) rather than beside the full activations.
        Not with tp > 1, where the activations are under-priced: the first stage of tp 2 x pp 2 peaks at
        the start of a backward with two micro-batches in flight, each layer measured ~18% over the
        per-layer model (traced: 15.4 against 13 MiB; DTensor's column-parallel linears keep their
        all-gathered sequence-parallel inputs), 63 MiB above what the credit predicts; the pair beside
        the full activations covers it (scripts/bench/joint_memory_caps.py --fidelity)."""
        return self.tp == 1

    def activation_bytes_at_embedding_backward(self) -> float:
        """What is alive when the embedding's gradient arrives, the last of a micro-batch's backward:
        the other micro-batches in flight (1F1B keeps pp of them on the first stage) and the pipeline's
        buffers; with pp = 1 nothing of the activations."""
        in_flight = min(self.pp, self.micro_batches)
        per_mb = self.layers * self.layer_activation_bytes() + self.head_activation_bytes()
        return (in_flight - 1) * per_mb + self.pipeline_buffer_bytes()

    def activation_bytes(self) -> float:
        """Peak activation bytes on one rank: stored layers of the in-flight micro-batches, the
        head, and under recomputation one layer's full set while it is recomputed; with pp > 1 the
        pipeline's receive buffers (a middle stage's)."""
        in_flight = min(self.pp, self.micro_batches)  # 1F1B: the first stage holds pp micro-batches
        stored = self.layers * in_flight * self.layer_activation_bytes()
        transient = self.layer_activation_bytes("none") if self.recompute != "none" else 0.0
        return stored + transient + self.head_activation_bytes() + self.pipeline_buffer_bytes()
