"""Per-log-interval training metrics: a console line on rank 0 and one JSONL record per interval.

The loop calls `record_step` after every optimizer step (with the StepTimer's phase times and,
once the engine supplies them, its communication stats) and `log` at log steps on every rank
(`log` runs one small all-gather for the straggler and memory view). Rank 0 appends the record to
RUN_DIR/metrics.jsonl (append, so a resumed run continues the same file, after drop_after() has
removed the rows of the steps it logs again) and forwards it to an
optional sink such as the wandb logger.

Field meanings (times are means per step over the interval, in seconds):
- tokens_per_s: global throughput over the interval's wall time; tokens_per_s_per_device divides
  it by the world size; tflops_per_device uses models.llama.flops_per_token; mfu divides by the
  per-device peak (None when no peak is known).
- time_*: the step-time breakdown. time_exposed_comm_s is the engine's time spent waiting on
  collectives; that wait happens inside the forward_backward/optimizer phases, so it is shown
  next to them, not added to them. time_other_s is what no phase covered.
- comm_bytes_intra_node / comm_bytes_inter_node: bytes per step as counted by rank 0's AMSP engine: its
  data-parallel traffic only (the console's `dp comm/step`). Tensor-parallel collectives and pipeline
  sends are not counted; with tp or pp > 1 startup says so once (model_parallel_comm_note).
- tokens: tokens seen since the run's start, counted from the data loader's consumed samples
  (so a resumed run, even one resumed with another batch size, continues the count correctly).
- memory_*: per rank, reduced over ranks by max (memory_peak_rank names the rank of the largest
  peak); memory_kind says what they measure. cuda_allocator: memory_peak_bytes /
  memory_reserved_peak_bytes are torch.cuda.max_memory_allocated / max_memory_reserved since the
  previous log step (the peaks are reset after each reading), memory_current_bytes is allocated
  now. cpu_rss: memory_current_bytes is the resident set size now, memory_peak_bytes the peak RSS
  since the previous log step (VmHWM, reset after each reading), memory_reserved_peak_bytes is null.
- elapsed_s: wall time since the metrics logger started (after the run's setup), continued across
  resumes: each checkpoint stores the elapsed time at its step (checkpoint_state) and a resumed run
  starts from that value (restore_checkpoint_state). The time between that checkpoint and the crash
  or stop (steps trained again after the resume), and each restart's setup, are not counted.
- rank_busy_*, slowest_rank: spread of the per-rank mean busy times (data wait + forward/backward
  + optimizer minus the engine's exposed communication wait: what a rank does on its own; wall step
  times are equal across ranks because collectives make everyone wait for the slowest),
  step_time_max_rank_s: the largest per-rank mean wall step time.
"""
from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import time
from typing import Any, Callable, Protocol

import torch

from .memory import MEMORY_FIELDS, MEMORY_KIND, memory_snapshot
from .peak import Peak
from .stragglers import gather_rank_values, straggler_summary
from .timer import PHASES

log = logging.getLogger("metrics")

# Keys of the per-step communication dict the engine passes to record_step.
COMM_KEYS = ("bytes_intra_node", "bytes_inter_node", "exposed_s")
# The checkpoint's meta.json key holding the run's elapsed wall time at the checkpoint's step.
ELAPSED_KEY = "elapsed_s"


def model_parallel_comm_note(tp: int, pp: int) -> str | None:
    """The startup line for a tp or pp > 1 run: its metrics line's byte count leaves out that traffic (a TP=2
    run logged `comm/step intra 4 B` beside megabytes of TP all-reduces). None at tp = pp = 1."""
    if tp * pp <= 1:
        return None
    left_out = " and ".join(w for w, on in (("tensor-parallel collectives", tp > 1), ("pipeline sends", pp > 1))
                            if on)
    return (f"metrics: 'dp comm/step' (comm_bytes_intra_node / comm_bytes_inter_node in metrics.jsonl) counts the "
            f"AMSP engine's data-parallel traffic only; this run's {left_out} (tp {tp}, pp {pp}) are not in it")


def append_row(path: pathlib.Path, row: str) -> None:
    """Append one line, whole or not at all: a write that fails part way (a full disk) is cut back to the
    file's earlier end, since a torn last row breaks every reader of the file (and the resume's trim)."""
    from amsp.errors import FaultError, disk_full, disk_full_message

    data = row.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # one write() in practice; a short write is continued, not left torn
                view = view[os.write(fd, view):]
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError as undo:
                log.debug("cannot cut %s back to %d bytes: %s", path, start, undo)
            if disk_full(e):
                raise FaultError(f"cannot append a row: {disk_full_message(e, path)}") from None
            raise
    finally:
        os.close(fd)


class MetricsSink(Protocol):
    def log_metrics(self, record: dict[str, Any], step: int) -> None: ...


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{int(n)}"


def _memory_text(r: dict[str, Any]) -> str:
    """Compact memory for the console line (the full numbers are in the JSONL record)."""
    rank = f" on rank {r['memory_peak_rank']}" if r["world_size"] > 1 else ""
    if r["memory_kind"] == "cuda_allocator":
        return (f"mem peak {_fmt_bytes(r['memory_peak_bytes'])}{rank} "
                f"(reserved {_fmt_bytes(r['memory_reserved_peak_bytes'])})")
    return f"rss {_fmt_bytes(r['memory_current_bytes'])} (peak {_fmt_bytes(r['memory_peak_bytes'])}{rank})"


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    # Strict JSON has no NaN/Infinity: a non-finite number (a diverged loss) is written as null.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def drop_rows_after(path: str | pathlib.Path, step: int) -> int:
    """Remove the JSONL rows of `path` whose "step" is after `step` (and torn or unreadable lines, as a
    kill during a write leaves), rewriting the file atomically; returns how many rows were dropped.

    A run resumed from the checkpoint of step N logs steps N+1.. again: the rows the previous run wrote
    for those steps (after its last checkpoint) would otherwise appear twice.
    """
    path = pathlib.Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            row_step = None
        if isinstance(row_step, int) and row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        log.info("%s: dropped %d row(s) after step %d, the step this run resumes from (they are logged again)",
                 path, dropped, step)
    return dropped


class MetricsLogger:
    def __init__(self, run_dir: str | pathlib.Path, *, rank: int, world_size: int, total_steps: int,
                 tokens_per_step: int, flops_per_token: float, device: torch.device, peak: Peak | None,
                 sink: MetricsSink | None = None, filename: str = "metrics.jsonl",
                 clock: Callable[[], float] = time.perf_counter):
        self.rank, self.world_size = rank, world_size
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.device = device
        self.peak = peak
        self.sink = sink
        self.path = pathlib.Path(run_dir) / filename
        self._clock = clock
        self._t_start = clock()
        self._elapsed_before = 0.0  # elapsed_s at the checkpoint this run resumed from (restore_checkpoint_state)
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_t0: float | None = None
        self._steps = 0
        self._phase_sums = dict.fromkeys((*PHASES, "step"), 0.0)
        self._comm_sums = dict.fromkeys(COMM_KEYS, 0.0)
        self._comm_steps = 0

    def elapsed_s(self) -> float:
        """Wall time of the run so far: this process's time since the logger started, plus the elapsed time
        stored in the checkpoint it resumed from."""
        return self._elapsed_before + self._clock() - self._t_start

    def checkpoint_state(self) -> dict[str, float]:
        """What a checkpoint stores for the metrics (meta.json): the elapsed time at its step."""
        return {ELAPSED_KEY: self.elapsed_s()}

    def restore_checkpoint_state(self, meta: dict[str, Any], checkpoint: str | pathlib.Path) -> None:
        """On resume: continue elapsed_s from the value the checkpoint (its meta.json, `meta`) stored, so the
        dashboards' wall clock does not restart at 0 with each resume. A checkpoint written before the value
        was stored resumes from 0, saying so, and so does one whose value is not a time (a metric: the
        training state it sits beside is still good)."""
        if ELAPSED_KEY not in meta:
            if self.rank == 0:
                log.info("checkpoint %s holds no %s (written before it was recorded): elapsed_s restarts at 0",
                         checkpoint, ELAPSED_KEY)
            return
        value = meta[ELAPSED_KEY]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            if self.rank == 0:
                log.warning("checkpoint %s: meta.json %s=%r is not a finite number of seconds >= 0: elapsed_s "
                            "restarts at 0", checkpoint, ELAPSED_KEY, value)
            return
        self._elapsed_before = float(value)

    def drop_after(self, step: int) -> int:
        """On resume from step `step`: drop metrics.jsonl rows after it (rank 0 owns the file)."""
        return drop_rows_after(self.path, step) if self.rank == 0 else 0

    def record_step(self, timings: dict[str, float], comm: dict[str, float] | None = None) -> None:
        """Account one finished step: StepTimer.end_step() output and the engine's comm stats."""
        if "step" not in timings:
            raise KeyError("record_step needs the step's total time under 'step' (StepTimer.end_step())")
        if self._window_t0 is None:
            # The window starts where its first step started, so setup time is not counted.
            self._window_t0 = self._clock() - timings["step"]
        for k, v in timings.items():
            if k not in self._phase_sums:
                raise KeyError(f"unknown step phase {k!r}; known: {', '.join(self._phase_sums)}")
            self._phase_sums[k] += v
        if comm is not None:
            unknown = set(comm) - set(COMM_KEYS)
            if unknown:
                raise KeyError(f"unknown comm stats {sorted(unknown)}; known: {', '.join(COMM_KEYS)}")
            for k in COMM_KEYS:
                self._comm_sums[k] += float(comm.get(k, 0.0))
            self._comm_steps += 1
        self._steps += 1

    def log(self, step: int, *, loss: float, lr: float, grad_norm: float, skipped_steps: int = 0,
            tokens_seen: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Close the interval ending at `step` (steps completed, 1-based). Collective: every rank
        calls it at the same steps. Returns the record on rank 0, None elsewhere.

        tokens_seen: tokens consumed since the run's start (the loader's consumed samples x seq_len);
        without it, step x tokens_per_step, which is wrong after a resume that changed the batch."""
        if self._steps == 0:
            raise RuntimeError("MetricsLogger.log() with no recorded step in the interval")
        now = self._clock()
        n = self._steps
        mean_step = self._phase_sums["step"] / n
        busy = sum(self._phase_sums[p] for p in PHASES) - self._comm_sums["exposed_s"]
        mem = memory_snapshot(self.device)
        # None (no such number on this device) travels as NaN: the gather carries floats only.
        per_rank = gather_rank_values([mean_step, max(0.0, busy / n)]
                                      + [math.nan if mem[k] is None else float(mem[k]) for k in MEMORY_FIELDS])
        wall = now - self._window_t0
        tokens = step * self.tokens_per_step if tokens_seen is None else int(tokens_seen)
        record = self._build_record(step, n, wall, per_rank, float(loss), float(lr), float(grad_norm),
                                    int(skipped_steps), now, tokens)
        if extra:
            record.update(extra)
        self._reset_window()
        if self.rank == 0:
            append_row(self.path, json.dumps(_json_safe(record), allow_nan=False) + "\n")
            log.info(self.console_line(record))
            if self.sink is not None:
                self.sink.log_metrics(record, step)
        # The next interval starts now, so its throughput also pays for this logging.
        self._window_t0 = self._clock()
        return record if self.rank == 0 else None

    def _build_record(self, step: int, n: int, wall: float, per_rank: list[list[float]], loss: float,
                      lr: float, grad_norm: float, skipped: int, now: float, tokens: int) -> dict[str, Any]:
        tps = self.tokens_per_step * n / wall
        tps_dev = tps / self.world_size
        flops_dev = tps_dev * self.flops_per_token
        phases = {f"time_{p}_s": self._phase_sums[p] / n for p in PHASES}
        mean_step = self._phase_sums["step"] / n
        have_comm = self._comm_steps > 0
        comm = {k: (self._comm_sums[k] / self._comm_steps if have_comm else None) for k in COMM_KEYS}
        record: dict[str, Any] = {
            "step": step, "total_steps": self.total_steps, "tokens": tokens,
            "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tps, "tokens_per_s_per_device": tps_dev,
            "tflops_per_device": flops_dev / 1e12,
            "mfu": flops_dev / self.peak.flops if self.peak else None,
            "peak_tflops_per_device": self.peak.flops / 1e12 if self.peak else None,
            "step_time_s": mean_step, **phases,
            "time_exposed_comm_s": comm["exposed_s"],
            "time_other_s": max(0.0, mean_step - sum(phases.values())),
            "comm_bytes_intra_node": comm["bytes_intra_node"],
            "comm_bytes_inter_node": comm["bytes_inter_node"],
            **self._memory_fields([r[2:] for r in per_rank]),
            "step_time_max_rank_s": max(r[0] for r in per_rank),
            **straggler_summary([r[1] for r in per_rank]),
            "skipped_steps": skipped, "world_size": self.world_size,
            "elapsed_s": self._elapsed_before + now - self._t_start,
            "eta_s": (self.total_steps - step) * wall / n,
            "time": time.time(),
        }
        return record

    def _memory_fields(self, per_rank: list[list[float]]) -> dict[str, Any]:
        out: dict[str, Any] = {"memory_kind": MEMORY_KIND[self.device.type]}
        for i, key in enumerate(MEMORY_FIELDS):
            values = [r[i] for r in per_rank]
            out[key] = None if any(math.isnan(v) for v in values) else int(max(values))
        peaks = [r[0] for r in per_rank]
        out["memory_peak_rank"] = max(range(len(peaks)), key=lambda r: (peaks[r], -r))
        return out

    @staticmethod
    def console_line(r: dict[str, Any]) -> str:
        pct = 100.0 * r["step"] / r["total_steps"] if r["total_steps"] else 100.0
        parts = [
            f"step {r['step']:5d}/{r['total_steps']} ({pct:.0f}%)", f"{_fmt_count(r['tokens'])} tok",
            f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"grad norm {r['grad_norm']:.3f}",
            f"{r['tokens_per_s']:.0f} tok/s ({r['tokens_per_s_per_device']:.0f}/dev)",
            f"{r['tflops_per_device']:.3g} TFLOP/s/dev",
            f"MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else "MFU n/a",
            "step {:.3f}s (data {:.3f} fwd+bwd {:.3f} opt {:.3f}{})".format(
                r["step_time_s"], r["time_data_wait_s"], r["time_forward_backward_s"], r["time_optimizer_s"],
                f" comm wait {r['time_exposed_comm_s']:.3f}" if r["time_exposed_comm_s"] is not None else ""),
        ]
        if r["comm_bytes_intra_node"] is not None:
            # "dp": the engine counts its data-parallel collectives only, not TP's or the pipeline's
            parts.append(f"dp comm/step intra {_fmt_bytes(r['comm_bytes_intra_node'])} "
                         f"inter {_fmt_bytes(r['comm_bytes_inter_node'])}")
        parts.append(_memory_text(r))
        if r["world_size"] > 1:
            parts.append(f"slowest rank {r['slowest_rank']} (busy {r['rank_busy_max_over_median']:.2f}x median)")
        parts += [f"skipped {r['skipped_steps']}", f"ETA {_fmt_duration(r['eta_s'])}"]
        return " | ".join(parts)
