"""The optimizer update's price, one rule for both planners (cost_model.CostModel per role,
joint/stage_cost.py per stage): the bytes an AdamW step moves, and what an update overlapped with the
next forward (amsp.overlap_update) still costs."""
from __future__ import annotations

# Bytes an AdamW step moves per OS element (fp32), before the compute-weight write: read gradient, master,
# m and v, write master, m and v, and write the gradient back. The engine clips by default (grad_clip > 0):
# the clip scale rides in torch._fused_adamw_'s grad_scale, and the kernel stores each gradient divided by
# it (an H200's profile of the 1.88B bench: 38 bytes a parameter with the bf16 weight write). csrc's
# one-pass kernel (amsp.optimizer_kernel=csrc) does not write it back (28), priced here as the fused one.
ADAM_BYTES_PER_ELEM = 36
# What an optimizer update on the side stream (amsp.overlap_update) still costs per second of it that the
# schedule hides behind a forward. Measured on an H200 (BENCHMARKS.md, "GPU path on one H200"): the 1.88B
# bench's update was 20.5 ms of exposed step time inline and 19.6 ms overlapped, of which 3.6 ms are the
# embedding's and first block's (exposed by design), so the 16.9 ms hidden cost 16.0 (0.95). cuBLAS's
# matmul kernels occupy every SM, so the update's memory-bound kernels mostly run between them.
UPDATE_HIDDEN_COST = 0.95


def overlapped_update_exposed(waits: float, later: list[float], window: float) -> float:
    """Exposed seconds of updates on the side stream (amsp.overlap_update): the updates nothing runs
    before (`waits`: the embedding's, the first block's) in full, each later unit's beyond the forward
    `window` of the unit before it. The rule both planners use (CostModel.update_exposed per role,
    joint/stage_cost.py per stage); the hidden rest still costs UPDATE_HIDDEN_COST of itself."""
    return waits + sum(max(0.0, u - window) for u in later)
