"""Checkpoint layout: reshard across fragment layouts and world sizes, atomic publish, safe loading."""
import json
import zlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from amsp.checkpoint import CheckpointManager, Fragment, SafeFileSystemReader
from tests.distributed import run_distributed

SHAPES = {"a": 37, "b": 10, "c": 101}


def full_tensor(key: str, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}|{kind}".encode()))
    return torch.randn(SHAPES[key], generator=g)


def fragments_for(rank: int, world: int, shards: int, fill: bool) -> list[Fragment]:
    """Each key split into `shards` uneven ranges; rank r holds range r % shards (replicas beyond).
    The pieces are views into one flat buffer, as the engine's fragments are (the save path that
    aliases views instead of letting DCP clone them is the one exercised)."""
    pieces = []
    for key, n in SHAPES.items():
        cuts = [0] + [min(n, (i * n) // shards + i % 3) for i in range(1, shards)] + [n]
        idx = rank % shards
        lo, hi = cuts[idx], cuts[idx + 1]
        for kind in ("model", "optim.exp_avg"):
            data = full_tensor(key, kind)[lo:hi] if fill else torch.full((hi - lo,), float("nan"))
            pieces.append((f"{kind}.{key}", n, lo, data))
    flat = torch.cat([p[3] for p in pieces])
    out, pos = [], 0
    for name, n, lo, data in pieces:
        out.append(Fragment(name, n, lo, flat[pos:pos + data.numel()], primary=rank < shards))
        pos += data.numel()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_aliases_views_of_a_flat_buffer_without_copying(dtype):
    from amsp.checkpoint import _own_storage_alias

    flat = torch.arange(64, dtype=torch.float32).to(dtype)
    view = flat[8:40].view(4, 8)
    alias = _own_storage_alias(view)
    assert alias.untyped_storage().nbytes() == view.nbytes  # DCP's writer will not clone it
    assert alias.data_ptr() == view.data_ptr() and alias.dtype == dtype and alias.shape == view.shape
    assert torch.equal(alias, view)
    whole = torch.ones(5)
    assert _own_storage_alias(whole) is whole  # its own storage already
    strided = flat.view(8, 8)[:, :2]
    assert _own_storage_alias(strided) is strided  # not contiguous: left to DCP


def _save(rank, world, run_dir, shards, async_save):
    mgr = CheckpointManager(run_dir, keep_last=2, async_save=async_save)
    frags = fragments_for(rank, world, shards, fill=True)
    for step in (1, 2, 3):
        mgr.save(step, frags, {"rng.cpu": torch.arange(5, dtype=torch.uint8) + step}, {"consumed_samples": 10 * step},
                 "model: test\n")
    mgr.wait()
    return sorted(p.name for p in mgr.root.iterdir())


def _load(rank, world, run_dir, shards):
    mgr = CheckpointManager(run_dir)
    path = mgr.latest()
    frags = fragments_for(rank, world, shards, fill=False)
    rng = torch.zeros(5, dtype=torch.uint8)
    meta = mgr.load(path, frags, {"rng.cpu": rng})
    for f in frags:
        kind, key = f.key.rsplit(".", 1)
        expect = full_tensor(key, kind)[f.offset: f.offset + f.tensor.numel()]
        assert torch.equal(f.tensor, expect), f.key
    return meta["step"], meta["consumed_samples"], rng.tolist()


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True])
def test_save_on_4_ranks_load_on_3_with_other_layout(tmp_path, async_save):
    names = run_distributed(_save, 4, str(tmp_path), 2, async_save)[0]
    assert names == ["latest", "step_00000002", "step_00000003"]  # keep_last=2 pruned step 1
    for step, consumed, rng in run_distributed(_load, 3, str(tmp_path), 3):
        assert (step, consumed, rng) == (3, 30, [3, 4, 5, 6, 7])


def test_single_process_round_trip_and_meta(tmp_path):
    mgr = CheckpointManager(tmp_path)
    frags = fragments_for(0, 1, 1, fill=True)
    mgr.save(7, frags, {}, {"plan": "ddp"}, "x: 1\n")
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000007"
    assert json.loads((mgr.latest() / "meta.json").read_text())["plan"] == "ddp"
    fresh = fragments_for(0, 1, 1, fill=False)
    assert mgr.load(mgr.latest(), fresh, {})["step"] == 7
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(frags, fresh))


def test_wrong_model_shape_is_a_clear_error(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, fragments_for(0, 1, 1, fill=True), {}, {}, "")
    bad = [Fragment("model.a", 38, 0, torch.zeros(38))]
    with pytest.raises(ValueError, match="model.a"):
        mgr.load(mgr.latest(), bad, {})


def test_metadata_with_foreign_objects_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, fragments_for(0, 1, 1, fill=True), {}, {}, "")
    meta = mgr.latest() / ".metadata"

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    import pickle
    meta.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(Exception, match="allow-list"):
        SafeFileSystemReader(mgr.latest()).read_metadata()


_KILL_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {root!r})
from amsp.checkpoint import CheckpointManager, Fragment
mgr = CheckpointManager({run!r})
big = [Fragment("model.big%d" % i, 4_000_000, 0, torch.randn(4_000_000)) for i in range(60)]
print("saving", flush=True)
mgr.save(2, big, {{}}, {{}}, "")
"""


def test_killed_save_leaves_previous_checkpoint_intact(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mgr = CheckpointManager(tmp_path)
    frags = fragments_for(0, 1, 1, fill=True)
    mgr.save(1, frags, {}, {"consumed_samples": 5}, "")
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT.format(root=root, run=str(tmp_path))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saving"
    tmp_dir = tmp_path / "checkpoints" / ".tmp-step_00000002"
    deadline = time.time() + 60
    while not any(tmp_dir.glob("*.distcp")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert tmp_dir.exists(), "the saver should have died mid-write"
    assert CheckpointManager(tmp_path).latest().name == "step_00000001"  # restart cleans the temporary
    assert not tmp_dir.exists()
    fresh = fragments_for(0, 1, 1, fill=False)
    assert mgr.load(mgr.latest(), fresh, {})["consumed_samples"] == 5
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(frags, fresh))
