"""Every command in the README's fenced bash blocks works as written.

Each command is classified by what running it takes (classify() below; a command no rule knows
fails the test, so a new README command gets a check):
- compose: train.py / torchrun / sbatch / planner overrides compose with Hydra, pass
  configs/validate.py, and give a batch that splits exactly into micro-batches on the world the
  command implies (torchrun --nproc_per_node, sbatch --nodes x the script's GPUs or NPROC_PER_NODE);
- help: CLIs whose arguments name the reader's own files (corpus.txt, CKPT_DIR) or need root
  (netns_cluster.py) or minutes (benchmarks): `--help` works and lists every flag the README uses;
- syntax: shell scripts parse (`bash -n`), make targets exist (`make -n`);
- run (slow): the cheap CPU commands run as written, in a temporary directory;
- sbatch (slurm): `sbatch --test-only` on the local Slurm accepts each sbatch line, and the CPU
  example runs there (tests/slurm/test_readme_sbatch.py, which imports this module's parser);
- skipped: GPU-node-only (nvidia-smi, pip install of CUDA wheels) and log viewing (tail, squeue).
"""
from __future__ import annotations

import functools
import os
import pathlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = pathlib.Path(os.environ.get("AMSP_README_UNDER_TEST", ROOT / "README.md"))  # to show a broken copy fails
SBATCH_DEFAULT_RE = re.compile(r"^#SBATCH --(nodes|gpus-per-node)=(\d+)", re.M)


@dataclass(frozen=True)
class Command:
    line: int  # where it starts in the README
    env: tuple[tuple[str, str], ...]  # leading VAR=value assignments
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"README.md:{self.line}: {' '.join(self.argv)}"


def command_of(line: int, words: list[str]) -> Command | None:
    """A command from its shell words, leading VAR=value assignments split off (None: nothing left)."""
    env = []
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        env.append(tuple(words.pop(0).split("=", 1)))
    return Command(line, tuple(env), tuple(words)) if words else None


def readme_commands(text: str) -> list[Command]:
    """Commands of the ```bash blocks: continuation lines joined, a quoted argument may span lines
    (`python -c "..."`), comments dropped, env prefixes split."""
    commands, in_bash, pending, start = [], False, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("```") and not pending:
            in_bash = raw.strip() == "```bash" if not in_bash else False
            continue
        if not in_bash:
            continue
        if not pending:
            start = number
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the argument goes on on the next line
            pending += "\n"
            continue
        pending = ""
        cmd = command_of(start, words)
        if cmd:
            commands.append(cmd)
    assert not pending, f"an unterminated command from line {start}"
    return commands


COMMANDS = readme_commands(README.read_text())


def classify(cmd: Command) -> str:
    a = cmd.argv
    if a[0] in ("nvidia-smi", "nvcc", "pip") or a[:3] == ("python", "-m", "venv") or a[:2] == ("python", "-c"):
        return "gpu-node"  # installing CUDA wheels / querying the driver: only on a GPU node
    if a[0] in ("squeue", "tail", "grep", "export"):
        return "viewing"
    if a[0] == "make":
        return "make"
    if a[0] == "sbatch":
        return "sbatch"
    if a[0] == "srun" or a[:2] == ("bash", "scripts/gpu/check.sh"):
        return "gpu-check"
    if a[0] == "scripts/slurm/local_cluster.sh":
        return "local-slurm"
    if a[0] == ".venv/bin/python" and a[1] == "train.py":
        return "train"
    if a[0] == ".venv/bin/torchrun":
        return "torchrun"
    if a[0] == ".venv/bin/python" and a[1:3] == ("-m", "amsp.planner"):
        return "planner"
    if a[0] == ".venv/bin/python" and a[1] == "-m":
        return "module-cli"
    if a[0] == "python" and a[1].startswith("scripts/bench/"):
        return "bench"
    return "unknown"


def by_kind(kind: str) -> list[Command]:
    return [c for c in COMMANDS if classify(c) == kind]


def ids(commands):
    return [f"L{c.line}" for c in commands]


def test_the_readme_has_commands_and_every_one_is_classified():
    assert len(COMMANDS) > 20
    unknown = [str(c) for c in COMMANDS if classify(c) == "unknown"]
    assert not unknown, "README commands with no check; add a rule to classify():\n" + "\n".join(unknown)


# ---- composing overrides -------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def compose(overrides: tuple[str, ...]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from configs.schema import register_configs
    from configs.validate import ConfigError, validate_config

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = hydra_compose(config_name="train", overrides=list(overrides))
    try:
        validate_config(cfg)
    except ConfigError as e:
        # Placeholders for the reader's own files (HF_DIR, runs/tiny) do not exist here; any other
        # complaint is the README's command being wrong.
        if not re.fullmatch(r"[\w.]+='[^']*' does not exist", str(e)):
            raise
    return cfg


def assert_composes_with_exact_batch(cmd: Command, overrides, world: int) -> None:
    from amsp.batch_geometry import batch_geometry

    try:
        cfg = compose(tuple(overrides))
    except Exception as e:  # noqa: BLE001 - any failure is the README's command failing
        pytest.fail(f"{cmd}\n  does not compose: {e}")
    model_parallel = cfg.parallel.tp * cfg.parallel.pp
    assert world % model_parallel == 0, f"{cmd}\n  parallel.tp x parallel.pp does not divide the {world} ranks"
    world //= model_parallel  # the batch splits over the data-parallel ranks only
    if cfg.parallel.auto:
        return  # the joint planner picks the micro-batch size so that it splits
    g = batch_geometry(cfg, world, announce=False)
    assert not g.rounded, (f"{cmd}\n  global batch {g.requested} does not split into micro-batches of "
                           f"{g.micro_batch} on {world} data-parallel ranks (train.py would round it to "
                           f"{g.global_batch})")


def after(argv, marker: str) -> list[str]:
    return list(argv[argv.index(marker) + 1:])


@pytest.mark.parametrize("cmd", by_kind("train"), ids=ids(by_kind("train")))
def test_train_commands_compose(cmd):
    assert_composes_with_exact_batch(cmd, after(cmd.argv, "train.py"), world=1)


@pytest.mark.parametrize("cmd", by_kind("torchrun"), ids=ids(by_kind("torchrun")))
def test_torchrun_commands_compose(cmd):
    nproc = int(cmd.argv[cmd.argv.index("--nproc_per_node") + 1])
    assert_composes_with_exact_batch(cmd, after(cmd.argv, "train.py"), world=nproc)


WRAPPED_TRAIN = [c for c in by_kind("bench") if "--" in c.argv and "train.py" in c.argv]


@pytest.mark.parametrize("cmd", WRAPPED_TRAIN, ids=ids(WRAPPED_TRAIN))
def test_train_commands_wrapped_by_the_netns_cluster_compose(cmd):
    """`netns_cluster.py run --nodes N --ranks-per-node R -- python train.py ...` runs N x R ranks."""
    opts = dict(zip(cmd.argv, cmd.argv[1:]))
    world = int(opts["--nodes"]) * int(opts["--ranks-per-node"])
    assert_composes_with_exact_batch(cmd, after(cmd.argv, "train.py"), world=world)


def sbatch_world(cmd: Command) -> int:
    """Ranks the job starts: (--nodes or the script's) x (NPROC_PER_NODE, --gpus-per-node or the script's)."""
    script = next(a for a in cmd.argv if a.endswith(".sbatch"))
    defaults = dict(SBATCH_DEFAULT_RE.findall((ROOT / script).read_text()))
    opts = dict(re.findall(r"^--([\w-]+)=(\S+)$", "\n".join(cmd.argv[1:cmd.argv.index(script)]), re.M))
    per_node = dict(cmd.env).get("NPROC_PER_NODE") or opts.get("gpus-per-node") or defaults["gpus-per-node"]
    return int(opts.get("nodes", defaults["nodes"])) * int(per_node)


@pytest.mark.parametrize("cmd", by_kind("sbatch"), ids=ids(by_kind("sbatch")))
def test_sbatch_commands_compose_on_the_jobs_world(cmd):
    script = next(a for a in cmd.argv if a.endswith(".sbatch"))
    assert (ROOT / script).is_file(), f"{cmd}: no {script}"
    assert_composes_with_exact_batch(cmd, after(cmd.argv, script), world=sbatch_world(cmd))


def planner_overrides(argv) -> list[str]:
    # Its own flags (--gpus 8,64, --json, --price P/G/OS) are checked against its --help below.
    return [w for w in after(argv, "amsp.planner") if "=" in w and not w.startswith("-")]


@pytest.mark.parametrize("cmd", by_kind("planner"), ids=ids(by_kind("planner")))
def test_planner_commands_compose(cmd):
    try:
        compose(tuple(planner_overrides(cmd.argv)))
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{cmd}\n  does not compose: {e}")


# ---- CLIs, scripts and make targets ----------------------------------------------------------------

def run(argv, cwd=ROOT, env=None, timeout=120):
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def help_argv(cmd: Command) -> tuple[str, ...]:
    """The command's program (python -m X, or a script and its subcommand) with --help."""
    if classify(cmd) in ("module-cli", "planner"):
        return (sys.executable, "-m", cmd.argv[2], "--help")
    script, rest = str(ROOT / cmd.argv[1]), cmd.argv[2:]
    sub = (rest[0],) if rest and not rest[0].startswith("-") else ()
    return (sys.executable, script, *sub, "--help")


def help_texts(argvs, timeout: float = 180) -> dict[tuple[str, ...], str]:
    """argv -> the --help text it prints, every argv started at once (each start imports torch, which is
    most of the time); a --help that fails fails the test."""
    procs = {argv: subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in sorted(set(argvs))}
    helps = {}
    for argv, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(argv)}: {stderr[-2000:]}"
        helps[argv] = stdout
    return helps


def test_clis_and_their_flags_exist():
    """`python -m X --help` / `python scripts/bench/Y.py [subcommand] --help` works and lists every
    --flag the README passes (those before a `--` that starts a wrapped command)."""
    commands = by_kind("module-cli") + by_kind("planner") + by_kind("bench")
    helps = help_texts(help_argv(c) for c in commands)
    for cmd in commands:
        own = cmd.argv[:cmd.argv.index("--")] if "--" in cmd.argv else cmd.argv
        for flag in (a.split("=")[0] for a in own if a.startswith("--")):
            assert flag in helps[help_argv(cmd)], f"{cmd}\n  {flag} is not an option of {' '.join(help_argv(cmd)[1:-1])}"


def test_shell_scripts_parse_and_make_targets_exist():
    scripts = {a for c in COMMANDS for a in c.argv if a.endswith((".sh", ".sbatch"))}
    for script in sorted(scripts):
        r = run(["bash", "-n", script])
        assert r.returncode == 0, f"bash -n {script}: {r.stderr}"
    for cmd in by_kind("make"):
        r = run(["make", "-n", *cmd.argv[1:]])
        assert r.returncode == 0, f"{cmd}: {r.stderr}"


# ---- running the cheap ones as written (slow) --------------------------------------------------------

def repo_path(word: str) -> bool:
    return word == "train.py" or ("/" in word and not word.startswith("-") and (ROOT / word).exists())


def as_written(cmd: Command) -> tuple[list[str], dict]:
    """The command with the repository's paths made absolute, to run from an empty directory (runs/
    and the like land there); the shared data cache stays the repository's .cache."""
    argv = [str(ROOT / a) if repo_path(a) else a for a in cmd.argv]
    env = dict(os.environ, **dict(cmd.env), PYTHONPATH=str(ROOT))
    return argv, env


CHEAP_TO_RUN = [c for c in by_kind("train") + by_kind("torchrun") + by_kind("planner")
                if "model=debug" in c.argv or classify(c) == "planner"]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", CHEAP_TO_RUN, ids=ids(CHEAP_TO_RUN))
def test_cheap_commands_run_as_written(cmd, tmp_path):
    argv, env = as_written(cmd)
    if classify(cmd) == "torchrun":  # its log folder (tempfile.mkdtemp) lands in tmp_path, not /tmp
        env["TMPDIR"] = str(tmp_path)
    r = run(argv, cwd=tmp_path, env=env, timeout=900)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
