"""scripts/slurm/common.sh worker_exit_code: torchrun ends with status 1 whatever its workers' codes, so a
job whose ranks all refused a config typo (exit 2: do not requeue, fix the command) looked like a bug to
Slurm (ExitCode 1:0). The ranks record their codes (amsp/errors.py record_exit_code) and the job script
exits with them. No Slurm needed: the function runs in bash (and train.py under torchrun, for a bug)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

from tests.training.runs import BASE

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
    out, err = _exit_code(1, {"rank0": 1, "rank1": 3}, tmp_path / "bug")  # rank 1 lost its peer to rank 0's bug
    assert out == "1" and "exiting 1 (an unexpected error" in err, err
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


# Imported by the workers (PYTHONPATH) before train.py: rank 0's metrics logger raises in step 2, as a bug would.
_INJECT_BUG = """
import os
if os.environ.get("RANK") == "0":
    from amsp.metrics.logger import MetricsLogger
    _log = MetricsLogger.log
    def log(self, step, **kw):
        if step == 2:
            raise RuntimeError("injected bug")
        return _log(self, step, **kw)
    MetricsLogger.log = log
"""


# Slow (the suite's time budget): the default run keeps the code order and the recording (the two tests
# above).
@pytest.mark.slow
@pytest.mark.distributed
def test_a_bug_in_the_step_reaches_torchruns_summary_and_the_job_scripts_code(tmp_path):
    """A bug inside the training loop ends the rank through os._exit (amsp.resilience: a normal exit can block
    on a peer), which skipped @record: torchrun's summary said `error_file: <N/A>` and no rank recorded a code.
    Now rank 0's traceback is the summary's root cause, and the job script's code is 1 (a bug), not rank 1's
    3 (it lost its peer)."""
    (tmp_path / "inject" / "sitecustomize.py").parent.mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(_INJECT_BUG)
    codes = tmp_path / "codes"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AMSP_EXIT_CODE_DIR": str(codes),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "inject")])}
    with tempfile.TemporaryDirectory(prefix="torchrun-") as logs:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            f"--log-dir={logs}", "train.py", f"trainer.output_dir={tmp_path}", "trainer.run_name=r",
                            *BASE, "trainer.max_steps=4"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "RuntimeError: injected bug" in out, out[-4000:]
    root_cause = out[out.index("Root Cause"):]
    assert "rank      : 0" in root_cause and "error_file: <N/A>" not in root_cause, root_cause
    assert 'raise RuntimeError("injected bug")' in root_cause, root_cause  # the traceback, from the error file
    assert {f.name: f.read_text() for f in codes.iterdir()} == {"rank0": "1\n", "rank1": "3\n"}
    job = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/slurm/common.sh && worker_exit_code 1"],
                         env={**os.environ, "AMSP_EXIT_CODE_DIR": str(codes)}, capture_output=True, text=True)
    assert job.stdout.strip() == "1", job.stderr
