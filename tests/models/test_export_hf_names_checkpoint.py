"""export_hf names what it read: given a run directory it resolves `latest` itself, and its last line said
only "exported 21 tensors (float32) to OUT", not which checkpoint or step that was. A path that does not
exist was called "not a torch.distributed.checkpoint directory (no .metadata)", sending the user to look
for a file inside a folder that is not there."""
from __future__ import annotations

import logging

import pytest

from amsp.checkpoint import CheckpointManager, Fragment
from models.llama.export_hf import export, main
from tests.models.test_hf import CONFIGS, config_yaml, random_weights, write_checkpoint

# The checkpoints here are written in one process without a process group, as intended.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trainer_checkpoints(run, steps):
    cfg = CONFIGS["untied_mha"]
    mgr = CheckpointManager(run)
    for step in steps:
        state = random_weights(cfg, seed=step)
        mgr.save(step, [Fragment(f"model.{n}", tuple(t.shape), (0,) * t.dim(), t) for n, t in state.items()],
                 {}, {}, config_yaml(cfg))
    return run / "checkpoints"


def test_export_of_a_run_directory_names_the_checkpoint_and_step(tmp_path, caplog):
    ckpts = _trainer_checkpoints(tmp_path / "run", (5, 9))
    with caplog.at_level(logging.INFO, logger="models.llama.export_hf"):
        export(tmp_path / "run", tmp_path / "hf")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("exported "))
    assert f"checkpoint {ckpts / 'step_00000009'} (step 9, named by {ckpts / 'latest'})" in line, line
    assert line.endswith(f" to {tmp_path / 'hf'}"), line

    caplog.clear()  # a step directory named directly: no `latest` to mention
    with caplog.at_level(logging.INFO, logger="models.llama.export_hf"):
        export(ckpts / "step_00000005", tmp_path / "hf5")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("exported "))
    assert f"checkpoint {ckpts / 'step_00000005'} (step 5)" in line, line


def test_export_of_a_checkpoint_written_outside_the_trainer_says_it_has_no_step(tmp_path, caplog):
    ckpt = tmp_path / "imported"
    ckpt.mkdir()
    write_checkpoint(ckpt, CONFIGS["untied_mha"], seed=0)  # no meta.json, as import_hf writes it
    with caplog.at_level(logging.INFO, logger="models.llama.export_hf"):
        export(ckpt, tmp_path / "hf")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("exported "))
    assert f"checkpoint {ckpt} (no step: no meta.json" in line, line


def test_a_path_that_does_not_exist_is_named_as_such(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    with pytest.raises(FileNotFoundError, match="no_such_run does not exist$"):
        export(missing, tmp_path / "hf")
    assert main([str(missing), str(tmp_path / "hf")]) == 2  # an input error (amsp/errors.py)
    err = capsys.readouterr().err
    assert f"error: {missing} does not exist" in err and ".metadata" not in err, err
    assert not (tmp_path / "hf").exists()
