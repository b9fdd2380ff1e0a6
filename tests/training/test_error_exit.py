"""A known failure's exit (amsp.errors.one_line_errors): one line, its exit code, and the process
groups destroyed first. Left to the interpreter's teardown, the backend threads of a gloo group were
destroyed while still joinable and a rank sometimes aborted ("terminate called without an active
exception", SIGABRT) after writing its error line (2 of 3 four-rank runs stopping on an input error)."""
import pytest
import torch.distributed as dist

from amsp.errors import InputError, one_line_errors
from configs.validate import ConfigError


def test_input_error_exits_2_after_destroying_the_process_group(capsys):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(SystemExit) as stop:
            with one_line_errors():
                raise InputError("no plan fits")
        assert stop.value.code == 2
        assert capsys.readouterr().err == "input error: no plan fits\n"
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_config_error_is_said_at_once_by_rank_0_and_after_a_wait_by_others(capsys, monkeypatch, tmp_path):
    """Every rank fails the same config check: rank 0 says it at once; another rank first waits (the launcher
    stops it then when rank 0 failed alike: one line), then says its own, so a check that failed on its node
    alone is still said, and a rank that exits first can no longer leave no line at all. Its exit code is
    recorded before the wait. Other input errors can be one rank's own: every rank names itself at once."""
    import amsp.errors as errors

    waits = []
    monkeypatch.setattr(errors, "_wait_for_rank_0", lambda: waits.append((tmp_path / "rank3").read_text()))
    monkeypatch.setenv("AMSP_EXIT_CODE_DIR", str(tmp_path))
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    bad_lr = "optim.lr=-1 is not allowed"
    for rank, error, said, waited in [
            ("0", ConfigError(bad_lr), f"config error: {bad_lr}\n", []),
            ("3", ConfigError(bad_lr), f"rank 3: config error: {bad_lr}\n", ["2\n"]),
            ("3", InputError("no file x"), "rank 3: input error: no file x\n", [])]:
        monkeypatch.setenv("RANK", rank)
        (tmp_path / "rank3").unlink(missing_ok=True)
        waits.clear()
        with pytest.raises(SystemExit) as stop:
            with one_line_errors():
                raise error
        assert stop.value.code == 2
        assert capsys.readouterr().err == said, rank
        assert waits == waited, rank


def test_srun_rank_before_the_process_group_waits_too(capsys, monkeypatch):
    """Under srun RANK is set only once the process group starts; a config error found before that (every
    rank's validate_config) knows its rank from SLURM_PROCID, so srun's ranks say it once too."""
    import amsp.errors as errors

    monkeypatch.setattr(errors, "CONFIG_ERROR_WAIT_S", 0.0)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    with pytest.raises(SystemExit) as stop:
        with one_line_errors():
            raise ConfigError("optim.lr=-1 is not allowed")
    assert stop.value.code == 2
    assert capsys.readouterr().err == "rank 5: config error: optim.lr=-1 is not allowed\n"
