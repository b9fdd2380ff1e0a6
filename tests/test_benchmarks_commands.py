"""The commands BENCHMARKS.md gives for its results still name what exists, so a result can be reproduced
as written: in its ```bash blocks and in inline code that starts with a program (`python scripts/...`),
- scripts/bench CLIs and `python -m` modules (subcommand included) accept every --flag used (an option
  hidden from --help, such as bench_fused.py's child-process flags, must still be defined in the script);
- train.py and `python -m amsp.planner` overrides compose with Hydra and pass configs/validate.py (the
  batch is not required to split exactly: some results measured the rounding on purpose);
- `python -c` snippets compile, and the names they import from this project exist;
- every repository path a command names exists.
Nothing is run: the benchmarks take minutes to hours and some need root or a GPU.
"""
from __future__ import annotations

import ast
import importlib
import os
import pathlib
import re
import shlex
import sys

import pytest

from tests.test_readme_commands import ROOT, Command, command_of, compose, help_texts, readme_commands

DOC = pathlib.Path(os.environ.get("AMSP_BENCHMARKS_UNDER_TEST", ROOT / "BENCHMARKS.md"))  # to show a broken copy fails
PYTHONS = ("python", "python3", ".venv/bin/python")
PROJECT_PACKAGES = ("amsp", "models", "data", "configs", "csrc")
# inline code that is a command: optional VAR=value prefixes, then a Python or torchrun
INLINE = re.compile(r"`((?:[A-Z_][A-Z0-9_]*=\S* )*(?:\.venv/bin/)?(?:python3?|torchrun) [^`\n]*)`")


def inline_commands(text: str) -> list[Command]:
    out = []
    for m in INLINE.finditer(text):
        cmd = command_of(text.count("\n", 0, m.start()) + 1, shlex.split(m.group(1)))
        if cmd:
            out.append(cmd)
    return out


TEXT = DOC.read_text()
COMMANDS = readme_commands(TEXT) + inline_commands(TEXT)


def program(cmd: Command) -> tuple[str, ...]:
    """What to ask for --help: (python, script[, subcommand]) or (python, -m, module[, subcommand]);
    () for commands checked otherwise (train.py, python -c)."""
    a = list(cmd.argv)
    if a[0] == "torchrun" or a[0].endswith("/torchrun"):
        a = ["python", "-m", "torch.distributed.run", *a[1:]]
    if a[0] not in PYTHONS or a[1] in ("train.py", "-c"):
        return ()
    head = a[1:3] if a[1] == "-m" else a[1:2]
    rest = a[1 + len(head):]
    sub = rest[:1] if rest and not rest[0].startswith("-") and "=" not in rest[0] and "/" not in rest[0] \
        and not rest[0].endswith(".json") and rest[0] != "train.py" else []
    return (sys.executable, *head, *sub)


def kind(cmd: Command) -> str:
    a = cmd.argv
    if a[0] not in PYTHONS and not a[0].endswith("torchrun"):
        return "unknown"
    if a[0] in PYTHONS and a[1] == "-c":
        return "snippet"
    if a[0] in PYTHONS and a[1] == "train.py":
        return "train"
    return "cli"


def ids(commands):
    return [f"L{c.line}" for c in commands]


def test_benchmarks_has_commands_and_every_one_is_checked():
    assert len(COMMANDS) > 60
    unknown = [f"BENCHMARKS.md:{c.line}: {' '.join(c.argv)}" for c in COMMANDS if kind(c) == "unknown"]
    assert not unknown, "commands no rule checks; add one to kind():\n" + "\n".join(unknown)


def own_flags(argv) -> list[str]:
    """--flags of the command itself: up to a `--` that starts a wrapped command, or train.py."""
    end = len(argv)
    for stop in ("--", "train.py"):
        if stop in argv:
            end = min(end, argv.index(stop))
    return [a.split("=")[0] for a in argv[:end] if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", a)]


def overrides_after(argv, marker: str) -> list[str]:
    return [w for w in argv[argv.index(marker) + 1:] if "=" in w and not w.startswith("-")]


def test_clis_accept_every_flag_used():
    clis = [c for c in COMMANDS if kind(c) == "cli"]
    texts = help_texts((*program(c), "--help") for c in clis)
    # whole options: --round is not --rounds
    helps = {argv[:-1]: set(re.findall(r"--[a-z][a-z0-9-]*", text)) for argv, text in texts.items()}
    problems = []
    for cmd in clis:
        p = program(cmd)
        source = (ROOT / p[1]).read_text() if p[1].endswith(".py") else ""
        for flag in own_flags(list(cmd.argv)):
            if flag not in helps[p] and f'"{flag}"' not in source:
                problems.append(f"BENCHMARKS.md:{cmd.line}: {flag} is not an option of {' '.join(p[1:])}")
    assert not problems, "\n".join(problems)


def test_repository_paths_exist():
    problems = []
    for cmd in COMMANDS:
        for word in cmd.argv[1:]:
            if re.fullmatch(r"(scripts|configs|tests|amsp|models|data|csrc)/[\w./-]+\.(py|sh|yaml|sbatch)", word) \
                    and not (ROOT / word).is_file():
                problems.append(f"BENCHMARKS.md:{cmd.line}: no {word}")
    assert not problems, "\n".join(problems)


HYDRA = [c for c in COMMANDS if "train.py" in c.argv or c.argv[1:3] == ("-m", "amsp.planner")]


@pytest.mark.parametrize("cmd", HYDRA, ids=ids(HYDRA))
def test_hydra_overrides_compose(cmd):
    marker = "train.py" if "train.py" in cmd.argv else "amsp.planner"
    try:
        compose(tuple(overrides_after(list(cmd.argv), marker)))
    except Exception as e:  # noqa: BLE001 - any failure is the documented command failing
        pytest.fail(f"BENCHMARKS.md:{cmd.line}: {' '.join(cmd.argv)}\n  does not compose: {e}")


SNIPPETS = [c for c in COMMANDS if kind(c) == "snippet"]


@pytest.mark.parametrize("cmd", SNIPPETS, ids=ids(SNIPPETS))
def test_python_snippets_compile_and_their_project_imports_exist(cmd):
    tree = ast.parse(cmd.argv[2], filename=f"BENCHMARKS.md:{cmd.line}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT_PACKAGES:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"BENCHMARKS.md:{cmd.line}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT_PACKAGES:
                    importlib.import_module(alias.name)
