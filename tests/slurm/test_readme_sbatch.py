"""The README's sbatch lines against the local Slurm: `sbatch --test-only` accepts each submission,
and the README's CPU example runs for real (slow).

The commands come from tests/test_readme_commands.py's parser (the README's ```bash blocks).
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

from slurm_cluster import ROOT, _run

_spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "tests" / "test_readme_commands.py")
readme = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = readme  # dataclasses look their module up there
_spec.loader.exec_module(readme)

SBATCH = readme.by_kind("sbatch")
# The local cluster is one host without GPUs or a `gpu` partition: these options are replaced.
LOCAL_ONLY = ("--nodes=", "--partition=", "--gpus-per-node=")


def local_argv(cmd) -> list[str]:
    argv = [str(ROOT / a) if a.endswith(".sbatch") else a for a in cmd.argv]
    script = next(i for i, a in enumerate(argv) if a.endswith(".sbatch"))
    options = [a for a in argv[1:script] if not a.startswith(LOCAL_ONLY)]
    return ["sbatch", "--nodes=1", "--gpus-per-node=0", *options, *argv[script:]]


@pytest.mark.slurm
@pytest.mark.parametrize("cmd", SBATCH, ids=readme.ids(SBATCH))
def test_readme_sbatch_lines_are_accepted_by_slurm(cmd, local_slurm, tmp_path):
    argv = local_argv(cmd)
    r = _run([argv[0], "--test-only", *argv[1:]], env=dict(local_slurm.env, **dict(cmd.env)), cwd=tmp_path)
    assert r.returncode == 0 and "to start at" in r.stderr, f"{cmd}\n{' '.join(argv)}\n{r.stderr}"


CPU_EXAMPLE = [c for c in SBATCH if dict(c.env).get("NPROC_PER_NODE") and "--gpus-per-node=0" in c.argv]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cmd", CPU_EXAMPLE, ids=readme.ids(CPU_EXAMPLE))
def test_readme_cpu_sbatch_example_trains(cmd, local_slurm, tmp_path):
    """The README's `NPROC_PER_NODE=2 sbatch --nodes=1 --gpus-per-node=0 ...` exactly as written."""
    i = next(i for i, a in enumerate(cmd.argv) if a.endswith(".sbatch"))
    job = local_slurm.sbatch(pathlib.Path(cmd.argv[i]).name, *cmd.argv[i + 1:], sbatch_args=list(cmd.argv[1:i]),
                             env=dict(cmd.env), cwd=tmp_path)
    info = local_slurm.wait_done(job, timeout=800)
    log = next(tmp_path.glob(f"*-{job}.out"))
    text = log.read_text()
    assert info.state == "COMPLETED" and info.exit_code == "0:0", text[-4000:]
    assert re.search(r"p/g/os = .* on 2 ranks", text), text[-4000:]
    assert re.search(r"saved checkpoint step \d+ to ", text), text[-4000:]
