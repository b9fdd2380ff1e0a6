"""Checkpoint faults: damaged files fall back to the newest verified checkpoint, disk full and
non-finite weights never publish anything, pruning keeps what a fallback needs, one run per dir.

Most cases drive CheckpointManager in this process (fast); the train.py cases check the one line
and the exit code end to end."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from amsp.checkpoint import CheckpointManager, Fragment
from amsp.checkpoint_verify import CheckpointDamaged, CheckpointMismatch, NonFiniteCheckpoint, RunDirInUse
from amsp.errors import FaultError

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"a": 37, "b": 1000}


def frags(fill: bool = True, scale: float = 1.0) -> list[Fragment]:
    out = []
    for key, n in SHAPES.items():
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        data = torch.randn(n, generator=g) * scale if fill else torch.full((n,), float("nan"))
        out.append(Fragment(f"model.{key}", n, 0, data))
    return out


def save(mgr, step, scale=1.0, skipped=0, consecutive=0, **kw):
    return mgr.save(step, frags(scale=scale), {"rng.cpu": torch.arange(4, dtype=torch.uint8)},
                    {"consumed_samples": step, "skipped_steps": skipped, "consecutive_skips": consecutive},
                    "x: 1\n", **kw)


def loader(mgr):
    def load(path):
        fresh = frags(fill=False)
        meta = mgr.load(path, fresh, {"rng.cpu": torch.zeros(4, dtype=torch.uint8)})
        assert all(torch.isfinite(f.tensor).all() for f in fresh)
        return meta
    return load


def shard(path):
    (f,) = sorted(path.glob("*.distcp"))
    return f


def flip_bit(path, fqn="model.b", bit=0x40):
    """Flip one bit in the middle of fqn's stored chunk (inside its tensor payload)."""
    from models.llama.dcp_safe import SafeFileSystemReader

    md = SafeFileSystemReader(path).read_metadata()
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    f = path / info.relative_path
    raw = bytearray(f.read_bytes())
    raw[info.offset + info.length // 2] ^= bit
    f.write_bytes(bytes(raw))
    return f


@pytest.fixture
def two(tmp_path):
    """Checkpoints step 1 (scale 1) and step 2 (scale 2), both verified."""
    mgr = CheckpointManager(tmp_path, keep_last=5)
    save(mgr, 1)
    save(mgr, 2, scale=2.0)
    return mgr


def fallback(mgr, caplog, problem):
    with caplog.at_level(logging.WARNING, logger="amsp.checkpoint"):
        path, meta = mgr.load_latest(loader(mgr))
    assert (path.name, meta["step"]) == ("step_00000001", 1)
    warn = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warn) == 1 and "step_00000002" in warn[0] and warn[0].endswith("checkpoint step_00000001"), warn
    assert problem in warn[0], warn[0]
    assert (mgr.root / "latest").read_text().strip() == "step_00000001"
    assert (mgr.root / "damaged-step_00000002").is_dir()  # set aside, not deleted
    return warn[0]


def test_a_garbled_latest_falls_back_to_the_newest_verified_checkpoint(two, caplog):
    """A crash between writing the pointer and its reaching the disk left NUL bytes in `latest`: every
    verified checkpoint is then a candidate (a name comparison with the garbage excluded them all)."""
    (two.root / "latest").write_bytes(b"\x00" * 16)
    with caplog.at_level(logging.WARNING, logger="amsp.checkpoint"):
        path, meta = two.load_latest(loader(two))
    assert (path.name, meta["step"]) == ("step_00000002", 2)
    assert any("not a checkpoint name; falling back to the newest verified checkpoint step_00000002"
               in r.getMessage() for r in caplog.records)
    assert (two.root / "latest").read_text().strip() == "step_00000002"


def test_the_same_step_damaged_twice_is_set_aside_twice(two, caplog):
    flip_bit(two.root / "step_00000002")
    fallback(two, caplog, "checkpoint step_00000002 is damaged")
    save(two, 2, scale=2.0)  # the run goes on and writes step 2 again, which is damaged again
    flip_bit(two.root / "step_00000002")
    path, _ = two.load_latest(loader(two))
    assert path.name == "step_00000001" and (two.root / "damaged-step_00000002.2").is_dir()


def test_pruning_never_deletes_what_latest_names(tmp_path):
    """A checkpoint with a lower step than others in the directory (a run started over beside an older
    run's) was pruned as the oldest right after it was published: `latest` then named nothing."""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    save(mgr, 8)
    save(mgr, 2)
    assert mgr.latest_name() == "step_00000002" and (mgr.root / "step_00000002" / "verified").is_file()
    path, meta = mgr.load_latest(loader(mgr))
    assert meta["step"] == 2


def test_resume_false_sets_the_old_checkpoints_aside(two):
    save(two, 4)
    dest = two.set_aside_all("trainer.resume=false")
    assert dest.name.startswith("superseded-")
    assert sorted(p.name for p in dest.iterdir()) == ["latest", "step_00000001", "step_00000002", "step_00000004"]
    assert not two.verified() and two.latest_name() is None and two.load_latest(loader(two)) is None
    save(two, 2, scale=3.0)  # the new run's own checkpoints, alone
    assert [p.name for p in two.verified()] == ["step_00000002"]
    assert two.set_aside_all("again") is not None and two.set_aside_all("nothing left") is None


def test_save_writes_manifest_and_verified_mark(two):
    d = two.root / "step_00000002"
    assert (d / "verified").is_file() and (d / "checksums" / "__0.json").is_file()
    man = json.loads((d / "checksums" / "__0.json").read_text())
    assert set(man["checksums"]) == {"model.a@0", "model.b@0", "rng.cpu@0"}
    assert [p.name for p in two.verified()] == ["step_00000002", "step_00000001"]
    path, meta = two.load_latest(loader(two))
    assert (path.name, meta["step"]) == ("step_00000002", 2)


def test_a_newer_format_is_refused_not_set_aside_as_damaged(two, caplog):
    """A checkpoint written by a newer version of the code is not damage: falling back set it aside as
    `damaged-*` and resumed from the older one, losing its steps. Refused (exit 2), nothing moved; a
    format that is not a number at all is still damage."""
    meta = two.root / "step_00000002" / "meta.json"
    record = json.loads(meta.read_text())
    meta.write_text(json.dumps({**record, "format_version": 99}))
    with pytest.raises(CheckpointMismatch, match=r"checkpoint format 99 is not one this code reads .* a newer"):
        two.load_latest(loader(two))
    assert sorted(p.name for p in two.root.iterdir() if p.name.startswith(("step_", "damaged"))) == \
        ["step_00000001", "step_00000002"]
    meta.write_text(json.dumps({**record, "format_version": "x"}))
    fallback(two, caplog, "checkpoint format 'x' is not one of the supported formats")


def test_bit_flip_in_a_shard_falls_back(two, caplog):
    f = flip_bit(two.root / "step_00000002")
    w = fallback(two, caplog, "checksum mismatch")
    assert str(f) in w


def test_truncated_shard_falls_back(two, caplog):
    f = shard(two.root / "step_00000002")
    os.truncate(f, f.stat().st_size // 2)
    w = fallback(two, caplog, "truncated")
    assert "a torn write" in w and str(f) in w


def test_missing_shard_falls_back(two, caplog):
    f = shard(two.root / "step_00000002")
    f.unlink()
    assert str(f) + ": file missing" in fallback(two, caplog, "file missing")


def test_corrupt_meta_json_falls_back(two, caplog):
    (two.root / "step_00000002" / "meta.json").write_text('{"step": 2, "format_')
    assert "meta.json: unreadable (JSONDecodeError" in fallback(two, caplog, "meta.json")


def test_corrupt_dcp_metadata_falls_back(two, caplog):
    (two.root / "step_00000002" / ".metadata").write_bytes(b"\x80\x04garbage")
    assert ".metadata: unreadable" in fallback(two, caplog, ".metadata")


def test_deleted_manifest_falls_back(two, caplog):
    (two.root / "step_00000002" / "checksums" / "__0.json").unlink()
    assert "checksums: missing" in fallback(two, caplog, "checksums")


def test_latest_pointing_to_a_missing_dir_falls_back(two, caplog):
    (two.root / "latest").write_text("step_00000009\n")
    with caplog.at_level(logging.WARNING, logger="amsp.checkpoint"):
        path, meta = two.load_latest(loader(two))
    assert meta["step"] == 2  # the newest verified older one
    warn = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert warn == [f"{two.root / 'latest'} names step_00000009, which does not exist; falling back to the "
                    f"newest verified checkpoint step_00000002"]


def test_nothing_usable_is_a_fault_naming_the_directory(tmp_path):
    mgr = CheckpointManager(tmp_path)
    save(mgr, 1)
    f = shard(mgr.root / "step_00000001")
    os.truncate(f, 10)
    with pytest.raises(FaultError) as e:
        mgr.load_latest(loader(mgr))
    msg = str(e.value)
    assert msg.startswith(f"no usable checkpoint in {mgr.root}: checkpoint step_00000001 is damaged: {f}: truncated")
    assert "\n" not in msg and "no older verified checkpoint" in msg
    assert f.exists()  # nothing deleted


def test_fresh_directory_loads_nothing(tmp_path):
    assert CheckpointManager(tmp_path).load_latest(loader(None)) is None


def test_non_finite_weights_are_never_written(two, caplog):
    bad = frags()
    bad[1].tensor[17] = float("nan")
    with caplog.at_level(logging.WARNING, logger="amsp.checkpoint"):
        assert two.save(3, bad, {}, {}, "") is None
    assert [r.getMessage() for r in caplog.records] == [
        "checkpoint step 3 not written: model.b holds NaN/Inf; keeping step_00000002"]
    assert not (two.root / "step_00000003").exists() and not list(two.root.glob(".tmp-*"))
    assert (two.root / "latest").read_text().strip() == "step_00000002"
    bad[1].tensor[17] = float("inf")
    with pytest.raises(NonFiniteCheckpoint, match=r"^checkpoint step 4 not written: model.b holds NaN/Inf; the last "
                                                  r"checkpoint step_00000002 in .* is kept$"):
        two.save(4, bad, {}, {}, "", final=True)
    assert (two.root / "latest").read_text().strip() == "step_00000002"


def test_pruning_keeps_newest_verified_and_the_one_before_skipped_steps(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save(mgr, 1, skipped=0)
    save(mgr, 2, skipped=0)  # the last checkpoint before a run of skipped steps
    save(mgr, 3, skipped=4, consecutive=4)  # skips recorded as train.py's save() does (SkipGuard)
    save(mgr, 4, skipped=9, consecutive=9)
    save(mgr, 5, skipped=12, consecutive=12)
    names = sorted(p.name for p in mgr.root.glob("step_*"))
    assert names == ["step_00000002", "step_00000004", "step_00000005"]
    # Unverified newer checkpoints (e.g. written before checksums) never push out the newest verified one.
    for n in ("step_00000004", "step_00000005"):
        (mgr.root / n / "verified").unlink()
    save(mgr, 6, skipped=12, consecutive=13)
    (mgr.root / "step_00000006" / "verified").unlink()
    mgr._prune()
    assert sorted(p.name for p in mgr.root.glob("step_*")) == ["step_00000002", "step_00000005", "step_00000006"]


def test_disk_full_during_save_keeps_previous(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        mgr = CheckpointManager(mnt, keep_last=5)
        save(mgr, 1)
        big = [Fragment("model.a", 37, 0, frags()[0].tensor), Fragment("model.b", 40000, 0, torch.randn(40000))]
        with pytest.raises(FaultError) as e:
            mgr.save(2, big, {}, {"skipped_steps": 0}, "")
        msg = str(e.value)
        assert msg.startswith("checkpoint step 2: no space left on device (") and "\n" not in msg, msg
        assert not list(mgr.root.glob(".tmp-*")) and not (mgr.root / "step_00000002").exists()
        assert (mgr.root / "latest").read_text().strip() == "step_00000001"
        path, meta = mgr.load_latest(loader(mgr))
        assert meta["step"] == 1
    finally:
        subprocess.run(["umount", str(mnt)])


def test_second_live_run_is_refused_and_a_stale_lock_taken_over(tmp_path, caplog):
    (tmp_path / "checkpoints").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "checkpoints" / ".lock").write_text(f"{holder.pid} {socket.gethostname()}\n")
        with pytest.raises(RunDirInUse, match=rf"^run directory {tmp_path} is in use by pid {holder.pid} on host "
                                              rf"{socket.gethostname()} \(lock "):
            CheckpointManager(tmp_path, lock=True)
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="amsp.checkpoint"):
        mgr = CheckpointManager(tmp_path, lock=True)  # that pid is dead now: the lock is stale
    assert any(f"removing stale lock {tmp_path / 'checkpoints' / '.lock'} of pid {holder.pid}" in r.getMessage()
               for r in caplog.records)
    assert (tmp_path / "checkpoints" / ".lock").read_text().split()[0] == str(os.getpid())
    mgr.close()
    assert not (tmp_path / "checkpoints" / ".lock").exists()


def test_an_empty_lock_is_waited_for_then_taken_over(tmp_path, caplog):
    """A run killed between creating its lock and writing it leaves an empty file, which refused every later
    start ('in use by pid  on host ?'). A fresh empty lock is another run's, a moment from being written:
    waited for. An old one is taken over, said."""
    lock = tmp_path / "checkpoints" / ".lock"
    lock.parent.mkdir()
    lock.write_text("")
    os.utime(lock, (lock.stat().st_mtime - 60,) * 2)
    with caplog.at_level(logging.WARNING, logger="amsp.checkpoint"):
        mgr = CheckpointManager(tmp_path, lock=True)
    assert any("removing unreadable lock" in r.getMessage() and "60 s old" in r.getMessage() for r in caplog.records)
    mgr.close()
    lock.write_text("")  # fresh: its writer is about to fill it in
    writer = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.5); "
                               f"open({str(lock)!r}, 'w').write('31337 node07\\n')"])
    try:
        with pytest.raises(RunDirInUse, match="is in use by pid 31337 on host node07"):
            CheckpointManager(tmp_path, lock=True)
    finally:
        writer.wait()


def test_a_requeued_slurm_job_takes_over_its_own_lock_from_another_node(tmp_path, monkeypatch, caplog):
    """A run killed without cleanup (time limit, OOM, node failure, a fault exit) leaves its lock; Slurm
    requeues the job on another node, where the old pid cannot be checked. The same job id with another
    restart count is this job's earlier incarnation: its lock is stale. Another job's lock is respected."""
    from amsp.checkpoint_verify import release_held_locks

    (tmp_path / "checkpoints").mkdir()
    lock = tmp_path / "checkpoints" / ".lock"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock.write_text("31337 node07 slurm:4242:0\n")  # this job before its requeue, on another node
    with caplog.at_level(logging.WARNING, logger="amsp.checkpoint"):
        mgr = CheckpointManager(tmp_path, lock=True)
    assert any("written by this Slurm job before its requeue (slurm:4242:0)" in r.getMessage() for r in caplog.records)
    assert lock.read_text().split()[2] == "slurm:4242:1"
    release_held_locks()  # what the fault exits call before os._exit
    assert not lock.exists()
    mgr.close()
    for other in ("31337 node07 slurm:999:0", "31337 node07 slurm:4242:1", "31337 node07"):
        lock.write_text(other + "\n")  # another job; this very incarnation elsewhere; no job: all live
        with pytest.raises(RunDirInUse, match="is in use by pid 31337 on host node07"):
            CheckpointManager(tmp_path, lock=True)


def test_damage_error_is_one_line_naming_the_file(two):
    f = flip_bit(two.root / "step_00000002", bit=1)
    with pytest.raises(CheckpointDamaged) as e:
        two.load(two.root / "step_00000002", frags(fill=False), {"rng.cpu": torch.zeros(4, dtype=torch.uint8)})
    assert str(e.value).startswith(f"{f}: checksum mismatch in model.b") and "\n" not in str(e.value)


# ---- end to end (train.py): the one line and the exit code ----
# Slow (the suite's time budget): the fallback past a damaged shard runs in the default run in-process
# (test_bit_flip_in_a_shard_falls_back).
@pytest.mark.slow
@pytest.mark.distributed
def test_train_resume_falls_back_past_a_bit_flip(tmp_path):
    from tests.training.runs import train

    run = tmp_path / "flip"
    train(run, "trainer.max_steps=4", "trainer.checkpoint_interval=2")
    ck = run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_00000004" and (ck / "step_00000002" / "verified").exists()
    f = _flip_first_model_chunk(ck / "step_00000004")
    proc = train(run, "trainer.max_steps=5", "trainer.checkpoint_interval=0")
    out = proc.stdout + proc.stderr
    assert f"checkpoint step_00000004 is damaged: {f}: checksum mismatch in model." in out
    assert "falling back to the newest verified checkpoint step_00000002" in out
    assert "resumed from checkpoint" in out and "at step 2 " in out
    assert (ck / "latest").read_text().strip() == "step_00000005" and (ck / "damaged-step_00000004").is_dir()


def _flip_first_model_chunk(path):
    from models.llama.dcp_safe import SafeFileSystemReader

    md = SafeFileSystemReader(path).read_metadata()
    fqn = sorted(k.fqn for k in md.storage_data if k.fqn.startswith("model."))[0]
    return flip_bit(path, fqn=fqn)


@pytest.mark.distributed
def test_train_refuses_a_run_dir_held_by_a_live_run(tmp_path):
    from tests.training.runs import train

    run = tmp_path / "busy"
    (run / "checkpoints").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run / "checkpoints" / ".lock").write_text(f"{holder.pid} {socket.gethostname()}\n")
        proc = train(run, "trainer.max_steps=2", check=False)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"input error: run directory {run} is in use by pid {holder.pid} on host "), last
    assert "Traceback" not in proc.stderr
    assert not list((run / "checkpoints").glob("step_*"))


_SIGTERM_DURING_ASYNC_SAVE = r"""
import os, signal, sys, threading, time
import torch
sys.path.insert(0, {root!r})
from amsp.checkpoint import CheckpointManager, Fragment
from amsp.resilience import PreemptionHandler

n = 64 * 2**20  # 256 MB a tensor, 3 of them: the background save takes a while
frags = [Fragment(f"model.p{{i}}", n, 0, torch.full((n,), float(i + 1))) for i in range(3)]
mgr = CheckpointManager({run!r}, keep_last=5, async_save=True)
handler = PreemptionHandler()  # what train.py installs: SIGTERM only sets a flag
mgr.save(1, frags, {{}}, {{"consumed_samples": 1}}, "x: 1\n")
pending = mgr._pending
threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
while not handler.received:  # the training loop goes on until it sees the flag at a step's end
    time.sleep(0.01)
print("save 1 still running when SIGTERM arrived:", pending.is_alive(), flush=True)
mgr.save(2, frags, {{}}, {{"consumed_samples": 2}}, "x: 2\n")  # train.py's preemption save
mgr.wait()
print("signal", handler.received, flush=True)
"""


def test_sigterm_during_an_async_save_completes_it_then_the_preemption_save(tmp_path):
    """SIGTERM while a background save is writing: the handler only sets a flag, the pending save
    finishes and is published verified, then the preemption save follows; nothing is lost."""
    run = tmp_path / "run"
    script = _SIGTERM_DURING_ASYNC_SAVE.format(root=str(ROOT), run=str(run))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "save 1 still running when SIGTERM arrived: True" in proc.stdout, proc.stdout
    assert f"signal {int(signal.SIGTERM)}" in proc.stdout
    mgr = CheckpointManager(run, keep_last=5)
    for step in (1, 2):
        d = run / "checkpoints" / f"step_{step:08d}"
        assert (d / "verified").exists(), f"step {step} not verified"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not list((run / "checkpoints").glob(".tmp-*"))
    n = 64 * 2**20
    fresh = [Fragment(f"model.p{i}", n, 0, torch.empty(n)) for i in range(3)]
    path, meta = mgr.load_latest(lambda p: mgr.load(p, fresh, {}))
    assert meta["step"] == 2 and all(torch.all(f.tensor == i + 1) for i, f in enumerate(fresh))
