"""The fused ops' names (csrc/, models/llama/fused.py) and the ones `model.fused=auto` enables, apart
from the ops themselves: torch-free, so the planner's CLI can read them and still start without torch."""
from __future__ import annotations

ALL_OPS = ("rms_norm", "rope", "swiglu", "linear_cross_entropy")

# Logits per chunk of the fused linear + cross-entropy (fused.default_chunk), by device type; the planner
# prices the same chunk (amsp/planner/workload.py). About 8M (32 MiB in fp32) on CPU: large enough for
# efficient matmuls, small next to the full (tokens x vocab) block it replaces. 32M on CUDA: each chunk
# adds its d/dW (vocab x dim) into the fp32 accumulator, and at 8M that was 16 passes of 131M elements
# per micro-batch for LLaMA-2 (36 ms of a 428 ms H100 step); a chunk's logits cost 6 bytes each there
# (fp32 + bf16).
CHUNK_LOGITS = {"cpu": 1 << 23, "cuda": 1 << 25}

# What `model.fused=auto` enables: only ops that beat eager by >= 1.2x in time or peak memory in
# scripts/bench/bench_fused.py on this project's CPU machines. Measurements and the derivation:
# BENCHMARKS.md, section "csrc fused CPU ops". Re-run the benchmark and update both together.
# Decision table from the 2026-11-22 run (fp32, 1 thread, CPU time; fwd+bwd vs eager):
AUTO_OPS: dict[str, str] = {
    "rms_norm": "4.20x time, 5.04x memory",
    "rope": "3.09x time, 2.52x memory",
    "swiglu": "1.27x time, 2.00x memory",
    "linear_cross_entropy": "1.24x time, 4.82x memory",
}

# On CUDA (csrc/fused_cuda.cu) no kernel has been timed against its reference yet (pending: `bench_fused.py
# --device cuda`, check.sh's `fused` part, not yet run on a GPU; the whole 1.88B step was, BENCHMARKS.md "GPU
# path"), so the CPU table above carries over on its memory column alone, which
# does not depend on the device (autograd keeps the same tensors), with one exception: inside a
# torch.compile'd region on CUDA (model.compile: the transformer blocks, where compiled ones measure faster) the ops
# below trace their eager references instead of calling the kernels, whatever model.fused says. There
# inductor generates fused code for the references and its partitioner keeps what the kernels keep (the
# planner prices compiled blocks so: amsp/planner/workload.py Workload.runs_fused), while a custom op is
# an opaque call that blocks inductor's fusion with its neighbours. The same ops outside compiled code
# (eager blocks: model.compile=off, tp > 1 or pp > 1; the head's norm) call the kernels. The fused
# linear + cross-entropy is never inside a compiled block (the head runs eagerly) and keeps its kernel for
# memory: the eager head keeps fp32 log-probabilities (4 B x tokens x vocab) and its backward peaks at
# about 12 B x tokens x vocab, where the CUDA kernel's forward peaks at about 6 B x vocab x dim in bf16
# (its fp32 d/dW accumulator beside one chunk's bf16 d/dW product, or beside the bf16 d/dW it keeps) plus
# a chunk of logits: 1.5 GiB against 0.8 GiB for llama2_7b (vocab 32000, dim 4096) at 4096 tokens per
# micro-batch, and the gap grows with the tokens per micro-batch (counted from the code, not measured).
# Its GPU time is unmeasured and at risk: in bf16 each of its tokens x vocab / 2^23 chunks adds a vocab x
# dim product into the fp32 accumulator, about 12 B x vocab x dim of memory traffic per chunk (llama2_7b,
# 4096 tokens: 16 chunks, ~25 GB, ~8 ms per micro-batch at H100 bandwidth; a micro-batch takes ~143 ms at
# the measured 28.6k tokens/s).
CUDA_COMPILED_REFERENCE_OPS: dict[str, str] = {
    "rms_norm": "inductor fuses the reference with the residual add before it",
    "rope": "inductor fuses the reference's rotation (real arithmetic when compiling: model.apply_rope) "
            "with the neighbouring element-wise code",
    "swiglu": "inductor fuses silu(a) * b into one kernel and recomputes silu in the backward",
}
