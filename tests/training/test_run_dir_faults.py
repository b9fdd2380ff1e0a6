"""An unwritable run directory stops every rank at startup with one line and the input exit code."""
from __future__ import annotations

import json
import os
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


# ---- a full disk anywhere in the run directory: one line, exit 3 (a fault), nothing torn or left half-written ----

def _enospc(path=None):
    import errno

    return OSError(errno.ENOSPC, "No space left on device", *([str(path)] if path else []))


def test_a_full_disk_is_a_one_line_fault_naming_the_file(capsys):
    import errno

    from amsp.errors import EXIT_FAULT, classify, one_line_errors

    assert classify(_enospc()) == (EXIT_FAULT, "fault")
    assert classify(OSError(errno.EDQUOT, "Disk quota exceeded")) == (EXIT_FAULT, "fault")
    assert classify(OSError(errno.EIO, "Input/output error")) is None  # other I/O errors stay bugs (traceback)
    with pytest.raises(SystemExit) as e:
        with one_line_errors():
            raise _enospc("/runs/r/config.yaml")
    assert e.value.code == EXIT_FAULT
    assert capsys.readouterr().err == "fault: no space left on device (/runs/r/config.yaml)\n"


def test_a_metrics_row_is_appended_whole_or_not_at_all(tmp_path, monkeypatch):
    import amsp.metrics.logger as logger
    from amsp.errors import FaultError

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills part way through the row
        real_write(fd, bytes(data[:5]))
        raise _enospc()

    monkeypatch.setattr(logger.os, "write", half_then_full)
    with pytest.raises(FaultError, match=rf"no space left on device \({re.escape(str(path))}\)"):
        logger.append_row(path, '{"step": 2, "loss": 6.2}\n')
    assert path.read_text() == '{"step": 1}\n'  # the torn half row was cut back


def test_run_files_keep_the_earlier_ones_when_the_disk_is_full(tmp_path, monkeypatch):
    import pathlib

    import train as train_py
    from amsp.errors import FaultError

    (tmp_path / "config.yaml").write_text("the earlier config\n")
    tok = tmp_path / "src.model"
    tok.write_bytes(b"tokenizer")
    real = pathlib.Path.write_text

    def full(self, text, *a, **kw):
        real(self, text[:3], *a, **kw)  # a few bytes land, then the disk is full
        raise _enospc()

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(FaultError, match=rf"no space left on device \({re.escape(str(tmp_path / 'config.yaml'))}\)"):
        train_py.write_run_files(tmp_path, "the new config\n", tok, tmp_path / "tokenizer.model", None)
    assert (tmp_path / "config.yaml").read_text() == "the earlier config\n"  # was: 0 bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "src.model"]  # no temporary left


def test_a_lock_the_full_disk_left_unwritten_is_removed(tmp_path, monkeypatch):
    import amsp.checkpoint_verify as cv
    from amsp.checkpoint import CheckpointManager
    from amsp.errors import EXIT_FAULT, FaultError

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd):
            self.f = real_fdopen(fd, "w")

        def __enter__(self):
            return self

        def write(self, _):
            raise _enospc()

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(cv.os, "fdopen", lambda fd, mode: Full(fd))
    with pytest.raises(FaultError, match="no space left on device") as e:
        CheckpointManager(tmp_path / "r", lock=True)
    assert e.value.exit_code == EXIT_FAULT  # was: an input error (2, "do not requeue")
    # Was: an empty .lock, which the next run removed as one "whose writer died between creating and writing it".
    assert not (tmp_path / "r" / "checkpoints" / ".lock").exists()


def _full_tmpfs(where, free_pages):
    """A 6 MB tmpfs at `where` filled up to `free_pages` free 4 KiB pages (skips when it cannot mount)."""
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    st = os.statvfs(where)
    (where / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - free_pages * 4096))


# 0: the lock fails; 36: the metrics rows do (lock and config.yaml a page each, the 8192-token tokenizer 31)
@pytest.mark.parametrize("free_pages", [0, 36])
def test_a_full_disk_through_train_py_is_one_line_exit_3(tmp_path, free_pages):
    small = tmp_path / "small"
    _full_tmpfs(small, free_pages)
    try:
        run = small / "r"
        proc = train(run, "amsp.plan=ddp", "trainer.max_steps=40", "trainer.checkpoint_interval=0", check=False)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]  # was: 2 at startup, 1 later
        assert lines[-1].startswith("fault: ") and f"no space left on device ({run}" in lines[-1], lines[-3:]
        assert "Traceback" not in proc.stderr
        assert not (run / "checkpoints" / ".lock").exists()
        assert not (run / "config.yaml").exists() or (run / "config.yaml").stat().st_size > 0
        if (run / "metrics.jsonl").exists():  # every row whole (was: a torn last row)
            assert all(json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines())
    finally:
        subprocess.run(["umount", str(small)], check=False)


# ---- a Slurm requeue of a trainer.resume=false command resumes its own run ----

def test_a_requeue_of_the_job_that_started_the_run_resumes_it(tmp_path, monkeypatch, caplog):
    import logging

    from amsp.checkpoint import CheckpointManager

    ckpt = CheckpointManager(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert not ckpt.requeue_of_recorded_job()  # the job's first start: trainer.resume=false starts over
    ckpt.record_job()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with caplog.at_level(logging.INFO, logger="amsp.checkpoint"):
        assert ckpt.requeue_of_recorded_job()  # was: its checkpoints moved to superseded-..., back to step 1
    assert "requeue 1 of Slurm job 77" in caplog.text and "resuming it instead of starting over" in caplog.text
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    assert not ckpt.requeue_of_recorded_job()  # another job's requeue: its resume=false still starts over
    monkeypatch.delenv("SLURM_JOB_ID")
    ckpt.record_job()  # a start outside Slurm: no job may claim the run
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert not ckpt.requeue_of_recorded_job()


# ---- an earlier run's replan.json does not change a fresh run's plan ----

def test_a_recorded_switch_is_resumed_only_by_the_run_whose_checkpoint_has_its_plan(tmp_path):
    from types import SimpleNamespace

    from amsp.plan import Degrees, make_plan
    from amsp.replan_switch import plan_after_switch

    to = make_plan("auto", 2, 2, blocks=Degrees(2, 2, 2), embed_head=Degrees(2, 2, 2))
    step = tmp_path / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004\n")
    (tmp_path / "replan.json").write_text(json.dumps([{"switched_at_step": 2, "to": str(to),
                                                       "to_degrees": {"p": 2, "g": 2, "os": 2, "embed_head_p": 2,
                                                                      "embed_head_g": 2, "embed_head_os": 2}}]))
    topo = SimpleNamespace(world=2, ranks_per_node=2)
    # A fresh run that never switched (its checkpoint's plan is the startup's): was resumed on 2/2/2.
    (step / "meta.json").write_text(json.dumps({"plan": "auto (p/g/os = 1/1/1)", "world_size": 2}))
    assert plan_after_switch(tmp_path, topo, 2) is None
    (step / "meta.json").write_text(json.dumps({"plan": str(to), "world_size": 2}))  # the run that switched
    plan, why, at = plan_after_switch(tmp_path, topo, 2)
    assert str(plan) == str(to) and at == 2 and "switched to it at step 2" in why
    # The switch's own checkpoint (written by the old plan) is known by its meta.json's CRC.
    import zlib

    switch = tmp_path / "checkpoints" / "step_00000002"
    switch.mkdir()
    (switch / "meta.json").write_text(json.dumps({"plan": "auto (p/g/os = 1/1/1)", "world_size": 2, "elapsed_s": 1.5}))
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002\n")
    record = json.loads((tmp_path / "replan.json").read_text())
    record[0].update({"from": "auto (p/g/os = 1/1/1)",
                      "checkpoint_meta_crc32": zlib.crc32((switch / "meta.json").read_bytes())})
    (tmp_path / "replan.json").write_text(json.dumps(record))
    assert plan_after_switch(tmp_path, topo, 2) is not None
    # Another run's checkpoint of the same step, on the same old plan: not the switch's.
    (switch / "meta.json").write_text(json.dumps({"plan": "auto (p/g/os = 1/1/1)", "world_size": 2, "elapsed_s": 2.5}))
    assert plan_after_switch(tmp_path, topo, 2) is None


def test_a_fresh_start_sets_an_earlier_replan_json_aside(tmp_path):
    import train as train_py

    (tmp_path / "replan.json").write_text("[]\n")
    train_py.set_aside_logs(tmp_path, ("metrics.jsonl", "validation.jsonl", "replan.json"))
    assert not (tmp_path / "replan.json").exists() and len(list(tmp_path.glob("replan.json.*.old"))) == 1


# ---- a refused resume leaves the run directory as it was, a damaged newest checkpoint included ----

def test_a_fallback_renames_nothing_until_the_resume_is_accepted(tmp_path):
    from amsp.checkpoint import CheckpointManager
    from amsp.checkpoint_verify import CheckpointDamaged

    ckpt = CheckpointManager(tmp_path)
    for step in (2, 4):
        (ckpt.root / f"step_{step:08d}").mkdir(parents=True)
        (ckpt.root / f"step_{step:08d}" / "verified").write_text("")
    (ckpt.root / "latest").write_text("step_00000004\n")

    def load(path):
        if path.name == "step_00000004":
            raise CheckpointDamaged(f"{path}/__0_0.distcp: checksum mismatch")
        return {"step": 2}

    before = sorted(p.name for p in ckpt.root.iterdir())
    path, meta = ckpt.load_latest(load, defer_set_aside=True)
    assert path.name == "step_00000002" and meta == {"step": 2}
    # A resume refused now (train.py's check_resume) has changed nothing (was: step_4 renamed, latest moved).
    assert sorted(p.name for p in ckpt.root.iterdir()) == before
    assert ckpt.latest_name() == "step_00000004"
    ckpt.finish_fallback()  # accepted: set aside as before
    assert (ckpt.root / "damaged-step_00000004").is_dir() and ckpt.latest_name() == "step_00000002"
