"""--help / -h of the Slurm scripts, and their comments against what the code does. No Slurm needed: the
scripts' argument handling runs in bash before anything reaches Slurm.

`bash pretrain.sbatch --help` said "submit it with sbatch" (exit 2) and no usage; `sbatch pretrain.sbatch
--help` passed --help on to train.py, where Hydra prints its help and exits 0, so the job ended COMPLETED
having trained nothing. `local_cluster.sh --help` printed the usage but exited 2."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "scripts" / "slurm"
JOB_SCRIPTS = ["pretrain.sbatch", "pretrain_srun.sbatch"]
# What each job script reads from the environment, as its code does (and common.sh for both).
ENV_VARS = {"pretrain.sbatch": ["NPROC_PER_NODE", "PYTHON", "RUN_NAME", "REPO_DIR", "TORCHRUN_LOG_DIR",
                                "TORCHRUN_SHUTDOWN_TIMEOUT_S"],
            "pretrain_srun.sbatch": ["PYTHON", "RUN_NAME", "REPO_DIR"]}


def _run(script, *args, env=None, tmp_path):
    """Runs the script in bash outside any job, with fake scontrol/srun/python3 on PATH that leave a mark
    when called: --help must be answered before the script looks for Slurm or Python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("scontrol", "srun", "sbatch", "python3", "slurmctld", "slurmd", "munged", "apt-get"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} >> {tmp_path}/called\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "AMSP_SLURM"))}
    clean["PATH"] = f"{bin_dir}:{clean['PATH']}"
    r = subprocess.run(["bash", str(SLURM_DIR / script), *args], env={**clean, **(env or {})},
                       capture_output=True, text=True, timeout=30, cwd=tmp_path)
    called = (tmp_path / "called").read_text() if (tmp_path / "called").exists() else ""
    return r, called


def header(script: str) -> str:
    """The comment block at the top of the script (up to the #SBATCH lines), `# ` stripped."""
    out = []
    for line in (SLURM_DIR / script).read_text().splitlines()[1:]:
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        out.append(re.sub(r"^# ?", "", line))
    return "\n".join(out)


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_help_outside_a_job_prints_the_usage_and_succeeds(script, flag, tmp_path):
    r, called = _run(script, flag, tmp_path=tmp_path)
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)
    assert f"usage: [ENV=VALUE ...] sbatch [SBATCH OPTION ...] scripts/slurm/{script} [OVERRIDE ...]" in r.stdout
    assert f"\n  sbatch scripts/slurm/{script} model=llama2_7b" in r.stdout, r.stdout  # an example
    for var in ENV_VARS[script]:
        assert var in r.stdout, (var, r.stdout)
    assert r.stdout.strip() == header(script).strip()  # the header comment is the usage, one text
    assert called == ""


# Hydra's --cfg / --info print and exit 0 as --help does: the job would end COMPLETED having trained nothing.
# argparse also takes abbreviations, attached values and short flags run together: -cjob, --cf, --inf, ...
# passed the check that knew only the exact names.
@pytest.mark.parametrize("args", [["--help"], ["model=debug", "-h"], ["model=debug", "--cfg=job"], ["--info"],
                                  ["-cjob", "model=debug"], ["--cf", "job"], ["--inf"], ["--hydra-h"],
                                  ["-iconfig"], ["--in=plugins"], ["-rh"], ["-s"], ["--vers"]],
                         ids=["help", "h-after-an-override", "cfg", "info", "c-attached", "cfg-prefix", "info-prefix",
                              "hydra-help-prefix", "i-attached", "info-prefix-value", "run-then-h", "sc-prefix",
                              "version-prefix"])
@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_help_inside_a_job_is_refused_before_anything_starts(script, args, tmp_path):
    r, called = _run(script, *args, env={"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "pretrain"}, tmp_path=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    flag = next(a for a in args if a.startswith("-"))
    assert last.startswith(f"{script}: error: '{flag}' reached the job (SLURM_JOB_ID=4242)"), last
    assert "Hydra overrides for train.py" in last and f"bash scripts/slurm/{script} --help" in last, last
    assert "would only make Hydra print and exit 0" in last, last
    assert "usage:" in r.stderr and r.stdout == ""  # the usage goes to the job's log too
    assert called == "", called  # neither scontrol nor srun nor python ran: train.py never saw --help


def _hydra_verdict(arg: str) -> str:
    """What Hydra makes of `train.py ARG` or `train.py ARG job` (a flag's value may be the next argument):
    "print" (it prints and exits 0, training nothing) if either does, else "run" if either runs the job, else
    "error" (argparse or Hydra rejects both). hydra/_internal/utils.py _run_hydra's order of checks."""
    verdicts = {_hydra_verdict_of([arg]), _hydra_verdict_of([arg, "job"])}
    return next(v for v in ("print", "run", "error") if v in verdicts)


def _hydra_verdict_of(argv: list[str]) -> str:
    import argparse

    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    class Rejected(Exception):
        pass

    def error(message):
        raise Rejected(message)

    parser.error = error
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --version: argparse prints it and exits 0 (pytest captures the line)
        return "print" if e.code == 0 else "error"
    except (Rejected, argparse.ArgumentError):
        return "error"
    if args.help or args.hydra_help:
        return "print"
    commands = args.run + (args.cfg is not None) + args.multirun + args.shell_completion + (args.info is not None)
    if commands > 1 or (args.resolve and args.cfg is None):
        return "error"
    if args.cfg is not None or args.info is not None or args.shell_completion:
        return "print"
    return "run"


def _candidates(parser) -> list[str]:
    """Argument spellings around Hydra's flags: every prefix of each long flag with and without values, short
    flags run together (with "=" among them), short flags with values attached, and overrides."""
    longs = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    shorts = [o for a in parser._actions for o in a.option_strings if not o.startswith("--")]
    out = {"-", "--", "-1", "-0.5", "model=debug", "+x=-h", "~trainer.x", "--cfg job", "-c job"}
    for flag in longs:
        for end in range(3, len(flag) + 1):
            out.update(flag[:end] + v for v in ("", "=", "=job", "=all", "=config", "=x", "=h"))
    letters = "hcimprsdn="
    out.update("-" + a + b + c for a in letters for b in ("",) + tuple(letters) for c in ("",) + tuple(letters))
    for flag in shorts:
        out.update(flag + v for v in ("job", "hydra", "all", "config", "plugins", "x", "=job", "=config", "=x"))
    return sorted(out)


def test_the_refused_flags_are_exactly_those_hydra_prints_and_exits_on():
    """Each script's hydra_print_flag against Hydra's own parser, on hundreds of spellings: every one that makes
    Hydra print and exit 0 is refused, every one that runs the job passes (one argparse rejects may go either
    way: the job would fail on it regardless)."""
    from hydra._internal.utils import get_args_parser

    candidates = _candidates(get_args_parser())
    verdicts = {arg: _hydra_verdict(arg) for arg in candidates}
    functions = set()
    for script in JOB_SCRIPTS:
        found = re.search(r"^hydra_print_flag\(\) \{\n.*?^\}\n", (SLURM_DIR / script).read_text(), re.M | re.S)
        assert found, script
        functions.add(found.group(0))
    assert len(functions) == 1, "pretrain.sbatch and pretrain_srun.sbatch must refuse the same arguments"
    loop = 'while IFS= read -r a; do if hydra_print_flag "$a"; then echo 1; else echo 0; fi; done'
    r = subprocess.run(["bash", "-c", functions.pop() + loop], input="\n".join(candidates) + "\n",
                       capture_output=True, text=True, timeout=30, check=True)
    refused = dict(zip(candidates, (line == "1" for line in r.stdout.split())))
    assert len(refused) == len(candidates)
    missed = [a for a in candidates if verdicts[a] == "print" and not refused[a]]
    blocked = [a for a in candidates if verdicts[a] == "run" and refused[a]]
    assert not missed and not blocked, (missed, blocked)
    # The spellings of the report are among them, and ordinary uses of Hydra's other flags pass.
    assert all(verdicts[a] == "print" for a in ("-c", "-cjob", "--cf", "--inf", "--hydra-h", "-iconfig", "-rh", "-s"))
    assert all(verdicts[a] == "run" for a in ("-cp", "-cn=x", "-cd", "-r", "-m", "--run", "--multirun",
                                              "--config-name=x", "--config-d", "-px", "model=debug", "-1"))
    assert sum(v == "print" for v in verdicts.values()) > 100 and sum(v == "run" for v in verdicts.values()) > 50


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_outside_a_job_without_help_still_asks_for_sbatch(script, tmp_path):
    r, called = _run(script, "model=debug", tmp_path=tmp_path)
    assert r.returncode == 2 and "submit it with sbatch (no SLURM_JOB_ID)" in r.stderr, r.stderr
    assert called == ""


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_local_cluster_help_succeeds(flag, tmp_path):
    r, called = _run("local_cluster.sh", flag, tmp_path=tmp_path)
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)
    for text in ("local_cluster.sh start", "local_cluster.sh stop", "local_cluster.sh status",
                 "local_cluster.sh env", "AMSP_SLURM_DIR", "AMSP_SLURM_PARTITION", "sbatch "):
        assert text in r.stdout, (text, r.stdout)
    assert called == ""
    r, _ = _run("local_cluster.sh", "restart", tmp_path=tmp_path)  # a wrong command is still an error
    assert r.returncode == 2 and "usage:" in r.stderr and r.stdout == ""


def test_the_shutdown_timeout_comment_states_the_timeout_passed():
    text = (SLURM_DIR / "pretrain.sbatch").read_text()
    default = re.search(r'--shutdown-timeout="\$\{TORCHRUN_SHUTDOWN_TIMEOUT_S:-(\d+)\}"', text).group(1)
    blocks = re.findall(r"(?:^#.*\n)+", text, flags=re.M)
    block = next(b for b in blocks if "--shutdown-timeout" in b)
    assert f"{default} s here" in block, block  # said "(torch's default 30 s): long enough here"
    readme = (ROOT / "README.md").read_text()
    assert f"`--shutdown-timeout` ({default} s here" in readme


def test_srun_header_names_the_variables_launch_py_reads():
    launch = (ROOT / "amsp" / "launch.py").read_text()
    text = header("pretrain_srun.sbatch")
    # The world size is the step's task count (the batch shell's SLURM_NTASKS is only the fallback).
    assert 'env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS"' in launch
    assert re.search(r"world size from SLURM_STEP_NUM_TASKS\b", text), text
    for var in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_NODELIST"):
        assert var in launch and var in text, var
