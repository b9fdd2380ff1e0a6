"""An unwritable run directory stops every rank at startup with one line and the input exit code."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.training.runs import train


def _assert_unwritable(proc, where):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert lines[-1].startswith(f"input error: cannot write the run directory {where}"), lines[-3:]
    assert "set trainer.output_dir / trainer.run_name to a writable place" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_a_file_where_the_run_directory_should_be(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder\n")
    proc = train(blocker / "r", check=False)
    _assert_unwritable(proc, blocker / "r")
    assert blocker.read_text() == "not a folder\n"  # nothing of the user's was touched


@pytest.mark.slow  # torchrun's teardown races the second worker's line; kept out of CI, run with -m slow
def test_read_only_file_system_on_two_ranks(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    # Root ignores permission bits, so the unwritable place is a read-only mount.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        proc = train(ro / "runs" / "r", nproc=2, check=False)
        # torchrun exits 1 whenever a worker fails and lists the workers' own codes: the first to
        # exit reports 2; the other may be SIGTERMed by torchrun right after its own line.
        codes = re.findall(r"exitcode\s+: (-?\d+) \(pid", proc.stderr)  # torchrun's summary: one per worker
        assert proc.returncode == 1 and "2" in codes and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]
        lines = set(proc.stderr.splitlines())
        said = {0: (f"input error: cannot write the run directory {ro / 'runs' / 'r'} (Read-only file system): "
                    f"set trainer.output_dir / trainer.run_name to a writable place") in lines,
                1: f"rank 1: input error: rank 0 cannot write the run directory {ro / 'runs' / 'r'}" in lines}
        # Each worker said its line, unless torchrun's SIGTERM took it first.
        assert sum(said.values()) >= codes.count("2") and any(said.values()), proc.stderr[:2000]
        assert proc.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own, no worker's
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_a_second_launch_into_a_live_run_directory_touches_nothing(tmp_path):
    """The run directory's lock is taken before anything is written: a second launch is refused without
    replacing the live run's config.yaml (it did, before the lock moved ahead of the startup)."""
    import socket
    import sys

    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("the live run's config\n")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / "checkpoints" / ".lock").write_text(f"{holder.pid} {socket.gethostname()}\n")
        proc = train(run, check=False)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0 and f"is in use by pid {holder.pid}" in proc.stderr, proc.stderr[-2000:]
    assert (run / "config.yaml").read_text() == "the live run's config\n"
