"""A known failure's exit (amsp.errors.one_line_errors): one line, its exit code, and the process
groups destroyed first. Left to the interpreter's teardown, the backend threads of a gloo group were
destroyed while still joinable and a rank sometimes aborted ("terminate called without an active
exception", SIGABRT) after writing its error line (2 of 3 four-rank runs stopping on an input error)."""
import pytest
import torch.distributed as dist

from amsp.errors import InputError, one_line_errors


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
