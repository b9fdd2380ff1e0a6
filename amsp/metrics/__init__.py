"""Training metrics: throughput and MFU, step-time breakdown, memory, stragglers, wandb, plots."""
from .logger import COMM_KEYS, MetricsLogger
from .memory import memory_snapshot, peak_memory_bytes
from .peak import Peak, resolve_peak
from .stragglers import gather_rank_values, straggler_summary
from .timer import PHASES, StepTimer

__all__ = ["COMM_KEYS", "MetricsLogger", "memory_snapshot", "peak_memory_bytes", "Peak", "resolve_peak",
           "gather_rank_values", "straggler_summary", "PHASES", "StepTimer"]
