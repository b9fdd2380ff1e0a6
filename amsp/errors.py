"""The failures a run reports as one line, and the exit codes that tell them apart.

A week-long job's log is read by a person and by a scheduler. Known failures are therefore one line
that names what to change, never a traceback (set HYDRA_FULL_ERROR=1 or logging.level=DEBUG for
one), and the exit code says whose move it is:

    0  the run finished (or stopped cleanly on a preemption signal, with a checkpoint)
    1  an unexpected error: a bug, shown with its traceback
    2  INPUT: the config, the data, the tokenizer or a checkpoint does not fit; rerunning the same
       command fails the same way (a scheduler should not requeue)
    3  FAULT: the run met a runtime fault (a peer that stopped answering, a full disk, a damaged
       checkpoint with nothing verified to fall back to, no memory); it can be retried or resumed
"""
from __future__ import annotations

import errno
import logging
import os
import sys
import time
from contextlib import contextmanager

log = logging.getLogger(__name__)

EXIT_BUG = 1
EXIT_INPUT = 2
EXIT_FAULT = 3


class RunError(Exception):
    """A known failure with a one-line message; exit_code says whether it is input or fault."""

    exit_code = EXIT_FAULT
    kind = "fault"

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # one line, whatever the caller built


class InputError(RunError):
    """Something the user must change (config value, data file, tokenizer, incompatible resume)."""

    exit_code = EXIT_INPUT
    kind = "input error"


class FaultError(RunError):
    """A runtime fault the run could not get past (it may succeed when retried or resumed)."""

    exit_code = EXIT_FAULT
    kind = "fault"


def _input_types() -> tuple[type, ...]:
    # Imported lazily: this module must stay importable from every layer without cycles.
    from amsp.plan import PlanError
    from amsp.planner.report import NoFeasiblePlan
    from configs.validate import ConfigError
    from data.errors import DataError

    return InputError, ConfigError, DataError, PlanError, NoFeasiblePlan


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, kind) for a known failure; None for anything else (a bug: keep the traceback)."""
    if isinstance(exc, RunError):
        return exc.exit_code, exc.kind
    from configs.validate import ConfigError

    if isinstance(exc, ConfigError):
        return EXIT_INPUT, "config error"
    if isinstance(exc, _input_types()):
        return EXIT_INPUT, "input error"
    if disk_full(exc):  # wherever the write was (a log row, config.yaml, the lock): free space and resume
        return EXIT_FAULT, "fault"
    return None


# A full disk or an exhausted quota: no fault of the command's, and a rerun with space freed goes on.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def disk_full_message(exc: OSError, where=None) -> str:
    """`no space left on device (PATH)` (or `disk quota exceeded (PATH)`), PATH the file being written
    (`where`, else the error's file name): OSError's own text is `[Errno 28] No space left on device:
    'PATH'`, names no file for a failed write(), and names the source for a failed copy."""
    what = "disk quota exceeded" if exc.errno == errno.EDQUOT else "no space left on device"
    where = where or exc.filename
    return f"{what} ({where})" if where else what


def _message(exc: BaseException) -> str:
    return disk_full_message(exc) if disk_full(exc) else str(exc)


def tracebacks_requested(level: str | None = None) -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or (level or "").upper() == "DEBUG"


@contextmanager
def one_line_errors(level: str | None = None):
    """Turn known failures into one line on stderr and their exit code (sys.exit, so Hydra adds
    nothing); anything else propagates with its traceback."""
    try:
        yield
    except BaseException as exc:  # noqa: B902 - DCP raises BaseException subclasses
        known = classify(exc)
        if known is None or tracebacks_requested(level):
            if isinstance(exc, Exception):  # not SystemExit / KeyboardInterrupt: their codes are their own
                record_exit_code(EXIT_BUG)  # the traceback goes to torchrun's error file (train.py's @record)
            raise
        code, kind = known
        rank = _launch_rank()
        prefix = f"rank {rank}: " if rank not in (None, "0") else ""
        for h in logging.getLogger().handlers:
            h.flush()
        record_exit_code(code)  # first: a rank stopped while it waits below has still left its code
        if prefix and kind == "config error":
            _wait_for_rank_0()
        # One write of the whole line: ranks share the terminal, and print() writes the newline
        # separately, which lets another rank's line land in between.
        sys.stderr.write(f"{prefix}{kind}: {_message(exc)}\n")
        sys.stderr.flush()
        _release_process_groups()
        sys.exit(code)


# How long a rank other than 0 holds back its config error (see _wait_for_rank_0); tests set it to 0.
CONFIG_ERROR_WAIT_S = 5.0


def _launch_rank() -> str | None:
    """This process's rank as the launcher gave it: RANK (torchrun; train.py sets it under srun once the process
    group starts), else SLURM_PROCID, for a config error found before that (srun starts every rank at once)."""
    return os.environ.get("RANK") or os.environ.get("SLURM_PROCID")


def _wait_for_rank_0() -> None:
    """Every rank checks the same config and fails it alike, and a 64-rank job printed the line 64 times; but
    staying silent on ranks other than 0 lost it: when one of them exited first, torchrun's agent (or srun's
    --kill-on-bad-exit) stopped rank 0 before it wrote its line, and a check that depends on the node (an
    init_from path or a cluster file missing on one node only) was never said at all. So such a rank waits:
    if rank 0 fails the same way it exits at once and the launcher stops this rank during the wait (one line);
    if it did not, this rank's own line follows (never none). Its exit code is recorded before the wait."""
    time.sleep(CONFIG_ERROR_WAIT_S)


def record_exit_code(code: int) -> None:
    """Leave this rank's exit code in AMSP_EXIT_CODE_DIR (file rank<RANK>) when that is set. torchrun ends
    with status 1 whatever its workers' codes were, so a job script that wants to tell an input error (2:
    do not requeue, fix the command) from a fault (3) reads them there (scripts/slurm/common.sh run_step).
    Best effort: a failure here must not keep the error line from being written."""
    where = os.environ.get("AMSP_EXIT_CODE_DIR")
    if not where:
        return
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    try:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"rank{rank}"), "w") as f:
            f.write(f"{int(code)}\n")
    except OSError as e:
        log.debug("cannot record exit code %s in %s: %s", code, where, e)


def record_bug(error: BaseException) -> None:
    """For a rank that dies of an unexpected error through os._exit (amsp.resilience: a normal exit can block
    on a peer), what a normal exit does: exit code 1 in AMSP_EXIT_CODE_DIR, and the traceback in torchrun's
    error file (@record's job), which torchrun's failure summary shows as the root cause. Call it inside the
    `except` block that caught `error` (the traceback is the one being handled). Best effort."""
    record_exit_code(EXIT_BUG)
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(error)  # writes only under torchrun (TORCHELASTIC_ERROR_FILE)
    except Exception as e:  # noqa: BLE001 - the error line is already written
        log.debug("cannot record the error for torchrun: %s", e)


def _release_process_groups(wait_s: float = 10.0) -> None:
    """Destroy the process groups before the interpreter exits: left to the interpreter's teardown,
    their backend threads were destroyed while still joinable, and about half of the 4-rank runs that
    stopped on an input error had a rank abort with "terminate called without an active exception"
    (SIGABRT, exit -6, instead of the error's code). Bounded: a rank that left a collective in flight
    could wait on its peers, so after wait_s the exit goes ahead as before."""
    import threading

    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return

    def destroy():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - best effort on the way out; the error line is already written
            log.debug("destroy_process_group on exit: %s", e)

    t = threading.Thread(target=destroy, name="release-process-groups", daemon=True)
    t.start()
    t.join(wait_s)
