"""A single-process checkpoint save and load (no process group, on purpose: amsp/launch.py initialises
torch.distributed only for several ranks) printed DCP's `torch.distributed is disabled, unavailable or
uninitialized, assuming the intent is to save/load in a single process` UserWarning on every checkpoint.
amsp/checkpoint.py silences exactly that message before its DCP calls; nothing else is hidden."""
from __future__ import annotations

import warnings

import pytest
import torch

from amsp.checkpoint import CheckpointManager
from tests.amsp.test_checkpoint import fragments_for

DCP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_single_process_save_and_load_do_not_warn(tmp_path, recwarn, async_save):
    # recwarn records every warning (simplefilter "always"), whatever pytest's filters say.
    mgr = CheckpointManager(tmp_path, async_save=async_save)
    frags = fragments_for(0, 1, 1, fill=True)
    mgr.save(3, frags, {"rng.cpu": torch.arange(4, dtype=torch.uint8)}, {"plan": "ddp"}, "x: 1\n")
    mgr.wait()  # an async save warns from its writer thread
    fresh, rng = fragments_for(0, 1, 1, fill=False), torch.zeros(4, dtype=torch.uint8)
    assert mgr.load(mgr.latest(), fresh, {"rng.cpu": rng})["step"] == 3
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(frags, fresh)) and rng.tolist() == [0, 1, 2, 3]
    dcp_warnings = [str(w.message) for w in recwarn if DCP_WARNING in str(w.message)]
    assert not dcp_warnings, dcp_warnings


def test_only_that_warning_is_silenced_by_one_filter():
    from amsp.checkpoint import _quiet_single_process_dcp

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = len(warnings.filters)
        _quiet_single_process_dcp()
        _quiet_single_process_dcp()  # every save calls it: one filter in all
        assert len(warnings.filters) == before + 1
        warnings.warn(f"{DCP_WARNING}, assuming the intent is to save in a single process.", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in caught] == ["something else"]
