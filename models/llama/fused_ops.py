"""The fused ops' names (csrc/, models/llama/fused.py) and the ones `model.fused=auto` enables, apart
from the ops themselves: torch-free, so the planner's CLI can read them and still start without torch."""
from __future__ import annotations

ALL_OPS = ("rms_norm", "rope", "swiglu", "linear_cross_entropy")

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
