"""scripts/slurm/common.sh worker_exit_code: torchrun ends with status 1 whatever its workers' codes, so a
job whose ranks all refused a config typo (exit 2: do not requeue, fix the command) looked like a bug to
Slurm (ExitCode 1:0). The ranks record their codes (amsp/errors.py record_exit_code) and the job script
exits with them. No Slurm needed: the function runs in bash."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _exit_code(rc: int, codes: dict[str, int] | None, tmp_path: pathlib.Path) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AMSP_EXIT_CODE_DIR"}
    if codes is not None:
        d = tmp_path / "codes"
        d.mkdir(parents=True, exist_ok=True)
        for name, code in codes.items():
            (d / name).write_text(f"{code}\n")
        env["AMSP_EXIT_CODE_DIR"] = str(d)
    p = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/slurm/common.sh && worker_exit_code {rc}"],
                       env=env, capture_output=True, text=True, check=True)
    return p.stdout.strip(), p.stderr


def test_the_ranks_codes_replace_the_launchers_status(tmp_path):
    assert _exit_code(1, {"rank0": 2, "rank1": 2}, tmp_path)[0] == "2"
    out, err = _exit_code(1, {"rank0": 3, "rank1": 2}, tmp_path / "mixed")  # an input error wins
    assert out == "2" and "ranks exited with code(s) 2 3 (launcher status 1): exiting 2" in err, err
    assert _exit_code(1, {"rank1": 3}, tmp_path / "fault")[0] == "3"
    assert _exit_code(1, {}, tmp_path / "none")[0] == "1"  # a bug: no rank recorded a code
    assert _exit_code(0, {"rank0": 2}, tmp_path / "ok")[0] == "0"
    assert _exit_code(1, None, tmp_path)[0] == "1"  # not set: as before


def test_a_rank_records_its_code_where_the_job_script_reads_it(tmp_path):
    code = ("import os, sys; from amsp.errors import one_line_errors, InputError\n"
            "with one_line_errors():\n    raise InputError('bad value')\n")
    env = {**os.environ, "AMSP_EXIT_CODE_DIR": str(tmp_path / "codes"), "RANK": "3"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "input error: bad value" in p.stderr, p.stderr
    assert (tmp_path / "codes" / "rank3").read_text() == "2\n"
