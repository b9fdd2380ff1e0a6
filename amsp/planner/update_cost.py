"""The optimizer update's price, one rule for both planners (cost_model.CostModel per role,
joint/stage_cost.py per stage): the bytes an AdamW step moves, and what an update overlapped with the
next forward (amsp.overlap_update) still costs."""
from __future__ import annotations

# Bytes an AdamW step moves per OS element (fp32), before the compute-weight write, by the kernel the run
# resolves (amsp.optimizer_kernel; sharded_optim.resolve_kernel):
# - fused (torch._fused_adamw_, what auto picks where the device has it: CUDA and CPU): read gradient,
#   master, m and v, write master, m and v, and write the gradient back. The engine clips by default
#   (grad_clip > 0): the clip scale rides in grad_scale, and the kernel stores each gradient divided by it
#   (an H200's profile of the 1.88B bench: 38 bytes a parameter with the bf16 weight write).
# - csrc (amsp_fused::adamw_update): the same in one pass without writing the gradient back.
# - foreach (torch._foreach_*, sharded_optim.ShardedAdamW._foreach): nine passes, each reading and writing
#   whole fp32 tensors: divide the gradient 8, decay the master 8, m 12, v 8 + 12, the denominator's sqrt,
#   divide and add 8 + 8 + 8, the master's addcdiv 16.
ADAM_BYTES_PER_ELEM = {"fused": 36, "csrc": 28, "foreach": 88}


def adam_bytes_per_elem(kernel: str) -> int:
    """Bytes one AdamW step moves per OS element with `kernel` (amsp.optimizer_kernel); auto is priced as
    the fused kernel, which torch has on CUDA and on CPU."""
    name = "fused" if kernel == "auto" else kernel
    if name not in ADAM_BYTES_PER_ELEM:
        raise ValueError(f"AdamW kernel {kernel!r} is not one of auto|{'|'.join(ADAM_BYTES_PER_ELEM)}")
    return ADAM_BYTES_PER_ELEM[name]


def timed_and_priced(kernel: str, measured_kernel: str | None) -> tuple[str, str]:
    """(the kernel a measured rate was timed with, the kernel the run is priced as) for a run of `kernel`
    (amsp.optimizer_kernel): a profile without the field was timed with the fused kernel; auto is the
    kernel timed, as startup resolved auto on the run's device (fused, or foreach without a fused one)."""
    timed = measured_kernel or "fused"
    return timed, timed if kernel == "auto" else kernel


def scaled_rate(kernel: str, measured: float, measured_kernel: str | None, weight_write: int = 0) -> float:
    """A rate timed with `measured_kernel` on fp32 masters, for a run of `kernel` that also writes
    `weight_write` bytes of compute weights: scaled by the bytes each moves."""
    timed, run = timed_and_priced(kernel, measured_kernel)
    return measured * (adam_bytes_per_elem(run) + weight_write) / adam_bytes_per_elem(timed)


def adam_seconds_per_elem(kernel: str, weight_write: int, measured: float | None, measured_kernel: str | None,
                          bandwidth_bytes_s: float) -> float:
    """Seconds per OS element of an update with `kernel` that also writes `weight_write` bytes of compute
    weights: a rate measured with `measured_kernel` on fp32 masters (compute_profile.time_optimizer; None:
    the fused kernel, as caches before the field) scaled by the bytes each moves (scaled_rate), else the
    bytes at the device's memory bandwidth. On a GPU the kernels are memory-bound passes (an H200's
    profile: 38 bytes a parameter), so their bytes set their ratio; on the 2-core CPU machine they are
    not purely that (BENCHMARKS.md, "Sharded AdamW step": against the fused kernel, csrc took 0.88-0.99x of a whole step
    where the bytes say 0.80 and 0.83-1.16x of time_optimizer's single tensor where they say 0.78;
    foreach 2.2-2.7x and 3.3-5.1x for 2.3 and 2.44). So startup times the run's own kernel, and this
    scaling is only the fallback for a profile timed with another one."""
    if measured is None:
        return (adam_bytes_per_elem(kernel) + weight_write) / bandwidth_bytes_s
    return scaled_rate(kernel, measured, measured_kernel, weight_write)


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
