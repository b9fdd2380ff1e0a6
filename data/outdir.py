"""The output directory of a CLI that writes PREFIX.* files (data.preprocess, data.tokenizer).

Both create a missing directory, as a user expects of an output path; what a run created is removed
again when the run fails and leaves it empty, so a mistyped path does not leave directories behind.

Both also stop alike on SIGTERM (a Slurm time limit) and Ctrl-C: one line, exit code 143 or 130, and the
files the run created removed (stop_signals, exit_stopped).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from contextlib import contextmanager

from data.errors import DataError


def make_parent(prefix: str, key: str) -> list[str]:
    """Create the directory of PREFIX (and missing parents); returns those created, outermost first.
    A path component that is a file is one line naming `key` (the option that gave the prefix)."""
    parent = os.path.dirname(os.path.abspath(prefix))
    missing = []
    d = parent
    while not os.path.isdir(d):
        if os.path.exists(d):
            raise DataError(key, f"{prefix!r}: {d} is a file, not a directory")
        missing.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise DataError(key, f"cannot create the output directory {parent} ({e.strerror})") from None
    return missing[::-1]


def remove_if_empty(created: list[str]) -> None:
    """Undo make_parent after a failed run: the directories it created that are still empty, innermost
    first (one that now holds anything, e.g. another run's files, stays)."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (or gone): its parents are not empty either


def output_error(key: str, path: str, e: OSError, file: str | None = None) -> DataError:
    """A failed write under an output prefix (a read-only directory, a full disk) as one line naming the
    option that gave it; the errno text says which. `file`: the file written, where the error lacks it
    (a failed write() has no file name, only open() has)."""
    return DataError(key, f"{path!r}: cannot write {e.filename or file or path} ({e.strerror or e})")


class Terminated(BaseException):
    """SIGTERM (a Slurm time limit or preemption) raised where the main process is, like
    KeyboardInterrupt for Ctrl-C, so that the clean-up of a run (try/finally, context managers) runs;
    a SIGTERM that only killed the process left its temporary files behind for good."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise Terminated()


def _raise_interrupt(signum, frame) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # nor a second Ctrl-C
    raise KeyboardInterrupt()


@contextmanager
def stop_signals():
    """SIGTERM raises Terminated and SIGINT KeyboardInterrupt in the main thread, once each."""
    previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
    # A SIGINT ignored from the start (`cmd &` in a script, nohup) stays ignored, as Python leaves it.
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous_int)


def exit_stopped(exc: BaseException, what: str) -> None:
    """One line for a run stopped by SIGTERM or Ctrl-C, and the shell's status for that signal
    (143, 130): a job script tells a stop from an error by it. Never returns."""
    signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
    name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C (SIGINT)"
    # A stop inside `import torch` (datasets imports it) leaves torch's loggers unconfigured, and its atexit
    # hook then logs cache statistics at INFO after this line; a stopped run says one thing only. At exit
    # (atexit runs the latest first), not now: a caller that catches the SystemExit keeps its logging.
    atexit.register(logging.disable, logging.INFO)
    sys.stderr.write(f"stopped by {name}: {what}\n")
    sys.stderr.flush()
    sys.exit(128 + signum)
