"""Keeping a long run alive and honest: preemption signals, non-finite steps, dead or hung ranks.

- Preemption: SIGUSR1 (Slurm's --signal before the time limit), SIGUSR2 (submitit) and SIGTERM
  (preemption, scancel)
  only set a flag; the loop checks it once per step with one tiny all_reduce on the control plane
  (amsp.control: a CPU group, never NCCL), so every rank stops after the same step, saves a
  checkpoint, and exits.
- Non-finite loss or gradient: the engine skips the update; SkipGuard counts consecutive skips
  and ends the run after K of them, after a checkpoint of the last good state.
- Dead or hung ranks: collectives carry a timeout; a heartbeat thread per rank bumps a counter in
  the rendezvous store, so when a collective fails (or a peer has been silent past the timeout)
  every survivor exits 3 with one line naming the rank(s) whose counter stopped moving.
- Fault injection (`debug.*` in the config) makes these paths testable end to end.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import control
from .checkpoint_verify import release_held_locks
from .errors import EXIT_FAULT, FaultError, record_bug, record_exit_code

log = logging.getLogger(__name__)


class PreemptionHandler:
    """Turns a preemption signal into "finish this step, save, exit", then hands the signal on.

    A handler installed before this one is kept and called by hand_over() once the checkpoint is
    safe on disk: under Hydra's submitit launcher that is submitit's SIGUSR2 handler, which
    resubmits the job's callable and runs `scontrol requeue` (global rank 0) and exits, so the
    requeued job resumes from the checkpoint just written. Under sbatch the previous handlers are
    the defaults and the batch script requeues (scripts/slurm/common.sh).
    """
    # USR1: Slurm's --signal before the time limit; USR2: submitit's timeout signal; TERM: preemption;
    # INT: Ctrl-C, which would otherwise lose every step since the last checkpoint.
    SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    # A second SIGINT this soon after the first is the same Ctrl-C: a terminal sends it to every process
    # of its foreground group, and torchrun then forwards the one it got to its children too.
    SAME_CTRL_C_S = 1.0

    def __init__(self) -> None:
        self.received: int = 0
        self.receivers: list[int] = []  # the ranks that got a signal, once agreed_signal saw one
        self._first_int: float | None = None  # monotonic time of the first SIGINT
        self._previous = {}
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_int is not None and now - self._first_int > self.SAME_CTRL_C_S:
                raise KeyboardInterrupt  # a second Ctrl-C: the user will not wait for the checkpoint
            if self._first_int is None:
                self._first_int = now
        if not self.received or signum != signal.SIGINT:  # an earlier preemption signal keeps its hand-over
            self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed_signal(self) -> int:
        """The signal any rank received (0 if none). Collective: all ranks call it every step. When it
        is not 0, `receivers` lists the ranks that got a signal (one more collective, on that step only:
        a scancel of one node, or a signal sent by hand to one process, shows there)."""
        signum = control.all_reduce_max_int(self.received)
        if signum:
            got = control.all_gather_floats([float(self.received)])
            self.receivers = [rank for rank, (s,) in enumerate(got) if s]
        return signum

    def describe_receivers(self) -> str:
        """'rank 3', 'ranks 0-3', or 'all 8 ranks' (after agreed_signal returned a signal)."""
        ranks = self.receivers
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return "this process"
        if len(ranks) == world:
            return f"all {world} ranks"
        return ("rank " if len(ranks) == 1 else "ranks ") + _spans(ranks)

    def hand_over(self, signum: int) -> None:
        """Call the handler that `signum` had before this one (after the checkpoint is written), if it
        was a Python function: submitit's checkpoint-and-requeue. Default and ignore handlers are left
        alone (the run then simply exits). Restores the previous handlers first."""
        self.restore()
        previous = self._previous.get(signum)
        # SIGINT's default handler raises KeyboardInterrupt: after a clean save it would only add a traceback
        if not callable(previous) or previous is signal.default_int_handler:
            return
        log.info("handing %s to the handler installed before training (%s): checkpoint written, requeue is "
                 "its call", signal.Signals(signum).name, getattr(previous, "__qualname__", previous))
        previous(signum, None)


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


class TooManySkippedSteps(FaultError):
    """The run stopped after K consecutive non-finite steps (a checkpoint of the last good state
    was written first)."""


class SkipGuard:
    """Counts skipped (non-finite) updates; raises after `limit` consecutive ones."""

    def __init__(self, limit: int, total: int = 0) -> None:
        if limit < 1:
            raise ValueError(f"trainer.max_consecutive_skips must be >= 1, got {limit}")
        self.limit, self.total, self.consecutive = limit, total, 0

    def record(self, skipped: bool, step: int, grad_norm: float) -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        log.warning("step %d: non-finite loss or gradient (grad norm %s); update skipped (%d in a row, %d in all)",
                    step, grad_norm, self.consecutive, self.total)

    @property
    def exhausted(self) -> bool:
        return self.consecutive >= self.limit


class Heartbeat:
    """Liveness that a stopped process cannot fake, and the one line that names who stopped answering.

    A daemon thread bumps this rank's counter in the rendezvous store every `interval` seconds and
    reads everyone else's. A counter that does not move is a stopped (SIGSTOP), dead (SIGKILL) or
    cut-off (partition) rank. Only this process's own monotonic clock measures "does not move", so
    clock skew between hosts cannot make a live rank look dead (the wall time each rank publishes
    is informational and never compared). A rank that leaves on purpose (finished, or exiting on a
    fault it saw) says so in its value, so it is never blamed.

    Only the I/O thread touches the store (a store call can block far past its timeout when the
    network is cut); the main thread and the watchdog read what it last saw. Two ways out, both
    exit 3 (EXIT_FAULT) at once with os._exit (destroying a process group can block on a dead peer):
    - fail(): the main thread's collective raised (gloo's timeout, or a closed connection);
    - the watchdog thread: a peer (or the store) silent for longer than the collective timeout plus
      a margin, wherever the main thread is blocked (a collective, DCP, the data loader, the store).
    """

    def __init__(self, rank: int, world: int, timeout_s: float = 600.0, interval: float = 1.0,
                 clock_skew_s: float = 0.0, watchdog_margin_s: float = 5.0) -> None:
        self.rank, self.world, self.timeout_s, self.interval = rank, world, timeout_s, interval
        self.clock_skew_s = clock_skew_s  # fault injection: this rank's published wall clock is off
        self.watchdog_after = timeout_s + watchdog_margin_s
        self.window = max(3.0, 3 * interval)  # a live counter moves at least twice in this time
        self.step, self.count, self.state = 0, 0, "run"
        self._exiting = threading.Lock()
        self._wake, self._published, self._halt = threading.Event(), threading.Event(), threading.Event()
        self._step_out = threading.Event()  # the current step has been published
        self._seen: dict[int, tuple[int, int, str]] = {}  # peer -> (counter, step, state)
        self._moved: dict[int, float] = {}  # peer -> this process's monotonic time its counter last moved
        self._store_error: str | None = None
        self._started = self._io_ok = time.monotonic()
        # not in a pretend world (one process posing as a rank of many: no peer ever beats)
        live = world > 1 and dist.is_initialized() and not control.pretend_world()
        self._store_timeout_s = float(timeout_s)  # the default store's; _connect() sets its own client's
        self._io: threading.Thread | None = None
        self.store = self._connect() if live else None
        self._prefix = "amsp/alive/" + os.environ.get("TORCHELASTIC_RUN_ID", "") + "/" + \
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if self.store is not None:
            self._publish()
            self._io = threading.Thread(target=self._io_loop, name="amsp-heartbeat", daemon=True)
            self._io.start()
            threading.Thread(target=self._watchdog, name="amsp-watchdog", daemon=True).start()

    def _connect(self):
        # A client of its own with a short timeout: the process group's store is left alone.
        timeout = timedelta(seconds=max(2.0, min(5.0, self.timeout_s / 2)))
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr and port:
            try:
                store = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
                self._store_timeout_s = timeout.total_seconds()
                return store
            except Exception as e:  # noqa: BLE001 - fall back to the default store
                log.debug("heartbeat: no store client of its own (%s); using the default store", e)
        return dist.distributed_c10d._get_default_store()

    def _key(self, r: int) -> str:
        return f"{self._prefix}/{r}"

    def _publish(self) -> None:
        wall = time.time() + self.clock_skew_s  # published for people reading the store; never compared
        self.store.set(self._key(self.rank), f"{self.count} {self.step} {self.state} {wall:.3f}")

    def _read(self) -> None:
        for r in range(self.world):
            if r == self.rank:
                continue
            if self._halt.is_set():  # close(): leave the store at once, not after every peer's key
                return
            key = self._key(r)
            raw = self.store.get(key) if self.store.check([key]) else None
            if raw is None:
                continue
            count, step, state = raw.decode().split()[:3]
            value = (int(count), int(step), state)
            if self._seen.get(r, (None,))[0] != value[0]:
                self._moved[r] = time.monotonic()
            self._seen[r] = value

    def _io_loop(self) -> None:
        while not self._halt.is_set():
            state = self.state
            try:
                if self._store_error is not None:
                    return  # gone once: do not hammer it (c10d logs a C++ stack for each failed call)
                if state == "run":
                    self.count += 1
                step = self.step
                self._publish()
                if step == self.step:
                    self._step_out.set()
                if state != "run":
                    self._published.set()
                self._read()
                self._io_ok = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the store may be gone with a dead rank
                self._store_error = self._store_error or type(e).__name__
                return
            self._wake.wait(self.interval)
            self._wake.clear()

    def _store_unreachable(self, now: float) -> bool:
        # an error, or no successful round for a while (a call blocked on a cut network)
        return self._store_error is not None or now - self._io_ok > self.window + self.interval

    def _watchdog(self) -> None:
        while not self._halt.wait(self.interval):
            if self.state != "run":
                return
            now = time.monotonic()
            stale = self._stale(now)
            if any(age > self.watchdog_after for _, age in stale) or now - self._io_ok > self.watchdog_after:
                self._exit(self._line(self.step, None if self._store_unreachable(now) else stale, None)
                           + " (watchdog: this rank was still blocked)")

    def _stale(self, now: float) -> list[tuple[int, float]]:
        """(peer, seconds its counter has not moved) for every peer still meant to be running."""
        out = []
        for r in range(self.world):
            if r == self.rank or self._seen.get(r, (0, 0, "run"))[2] != "run":
                continue
            out.append((r, now - self._moved.get(r, self._started)))
        return out

    def beat(self, step: int) -> None:
        """The main thread starts `step`: the I/O thread publishes it right away (waited for briefly, so a
        rank that dies in this step is named with it; never long, whatever the network does)."""
        if self.store is None:
            return
        self._step_out.clear()
        self.step = step
        self._wake.set()
        self._step_out.wait(0.5)

    def stop(self, state: str = "done") -> None:
        """Leave on purpose (finished, or exiting on a fault): peers will not blame this rank. Waits a
        little for the I/O thread to publish it, never longer."""
        if self.store is None or self.state != "run":
            return
        self.state = state
        self._wake.set()
        self._published.wait(2.0)

    def close(self, state: str = "done") -> None:
        """The end of the run: stop(state), then end both threads and wait (bounded by the store's timeout)
        until the I/O thread has returned from its store call. A daemon thread still inside a c10d Store call
        (which releases the GIL) when the interpreter finalizes is ended by pthread_exit on its way back into
        Python; the unwind crosses pybind11's noexcept gil_scoped_release and std::terminate aborts the
        process ("terminate called without an active exception", SIGABRT, exit -6) after a run that
        succeeded. Not for _exit()/fail(): their lingering needs the I/O thread still reading."""
        self.stop(state)
        self._halt.set()
        self._wake.set()
        if self._io is not None:
            # a healthy store answers in milliseconds; a hung one must not hold the exit for long
            self._io.join(min(self._store_timeout_s, 10.0) + self.interval)
            self._io = None

    def stopped_ranks(self) -> list[tuple[int, float]] | None:
        """Peers whose counter does not move: waits until every peer has either moved twice since this
        call or been silent for `window` seconds. None when the store cannot be read."""
        if self.store is None:
            return []
        start = time.monotonic()
        before = {r: v[0] for r, v in self._seen.items()}
        while True:
            now = time.monotonic()
            if self._store_unreachable(now):
                return None
            # Alive: the counter moved twice since the failure (a dead rank's last value may still
            # arrive once after it); stopped: not moved for `window` seconds of this process's clock.
            pending = [(r, age) for r, age in self._stale(now)
                       if self._seen.get(r, (-2,))[0] < before.get(r, -1) + 2]
            if all(age >= self.window for _, age in pending) or now - start > self.timeout_s + self.window:
                return [(r, age) for r, age in pending if age >= self.window]
            time.sleep(0.2)

    def _line(self, step: int, stale, error: BaseException | None) -> str:
        tail = f"; collective timeout {self.timeout_s:g} s"
        if stale is None:
            why = f": {self._store_error}" if self._store_error else ""
            return (f"step {step}: unknown rank(s) stopped answering (rendezvous store unreachable{why})"
                    + tail + (f"; {type(error).__name__}: {_first_line(error)}" if error is not None else ""))
        stopped = [(r, age) for r, age in stale if age >= self.window]
        left = sorted(r for r, v in self._seen.items() if v[2] == "left")
        if not stopped and left:
            return (f"step {step}: rank(s) {', '.join(map(str, left))} left the run after an error of their own "
                    f"(see their line){tail}")
        if not stopped:
            return (f"step {step}: a collective failed but every rank's heartbeat is still moving "
                    f"(no rank stopped answering){tail}"
                    + (f"; {type(error).__name__}: {_first_line(error)}" if error is not None else ""))
        parts = []
        for r, age in stopped:
            seen = self._seen.get(r)
            last = f"last started step {seen[1]}" if seen and seen[1] > 0 else "no step started"
            parts.append(f"rank {r} stopped answering (no heartbeat for {age:.0f} s; {last})")
        return f"step {step}: " + ", ".join(parts) + tail

    def _exit(self, line: str, code: int = EXIT_FAULT) -> None:
        if not self._exiting.acquire(blocking=False):
            return  # the other thread is already reporting
        self.stop("left")
        self._linger()
        prefix = f"rank {self.rank}: " if self.rank else ""
        for h in logging.getLogger().handlers:
            h.flush()
        # One write of the whole line: print() writes the newline separately, and ranks share the terminal,
        # so another rank's line could land in between (two faults on one line).
        sys.stderr.write(f"{prefix}fault: {line}\n")
        sys.stderr.flush()
        record_exit_code(code)  # torchrun reports 1 whatever this is: the job script reads it here
        release_held_locks()  # os._exit runs no cleanup: a lock left behind refuses the requeue on another node
        os._exit(code)

    def _linger(self) -> None:
        # With init_method env:// the store lives in rank 0's process: leaving at once would take it
        # away from survivors still naming the stopped rank. Wait (bounded) until they have left too.
        if self.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return
        deadline = time.monotonic() + self.window + 3
        while time.monotonic() < deadline and not self._store_unreachable(time.monotonic()):
            if all(age >= self.window for _, age in self._stale(time.monotonic())):
                return  # everyone still "run" is a stopped rank: the others have left
            time.sleep(0.2)

    def fail(self, step: int, error: BaseException) -> None:
        """The main thread's step raised: a collective failed (name the rank(s) that stopped answering and exit
        3), or, with every peer alive and no communication error, a bug (its traceback, exit 1)."""
        if self.store is None:
            record_bug(error)
            die_now(f"rank {self.rank}: training failed in step {step}: {type(error).__name__}: {error}")
        log.debug("collective failure in step %d", step, exc_info=error)
        stale = self.stopped_ranks()
        if stale == [] and not _is_comm_error(error):  # everyone alive and not a communication error: a bug
            self.stop("left")
            log.error("rank %d: training failed in step %d", self.rank, step, exc_info=error)
            record_bug(error)  # os._exit skips @record: torchrun's summary would say error_file <N/A>
            die_now(f"rank {self.rank}: training failed in step {step}: {type(error).__name__}: {error}")
        self._exit(self._line(step, stale, error))


def _is_comm_error(error: BaseException) -> bool:
    if isinstance(error, (dist.DistError, TimeoutError, ConnectionError)):
        return True
    text = str(error).lower()
    return any(w in text for w in ("gloo", "timed out", "timeout", "connection", "peer"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


def die_now(message: str, code: int = 1) -> None:
    """Exit immediately without waiting on peers (destroying a process group can block on a dead rank)."""
    log.error(message)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(code)


class NaNInjector:
    """Fault injection for tests: make the loss non-finite on chosen steps via a hook on the head."""

    def __init__(self, model: torch.nn.Module, steps: list[int]) -> None:
        self.steps, self.current = set(steps), -1
        self.handle = model.head.register_forward_hook(self._hook) if self.steps else None
        if self.steps:
            log.warning("fault injection: non-finite loss at steps %s", sorted(self.steps))

    def _hook(self, module, args, output):
        return output * float("nan") if self.current in self.steps else output
