"""scripts/gpu/check.sh's budgeting and part selection, with a stand-in interpreter that only records its
arguments: device time is scarce (one call of at most 600 s), so a part that overruns the budget, a typo
that silently runs nothing, or a run without its dependencies must show here, not on the device."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _check(tmp_path: pathlib.Path, env_rc: int = 0, **env: str) -> tuple[int, str, dict[str, int]]:
    """(exit status, output, {part: time limit}) of check.sh run with a stand-in PYTHON."""
    fake = tmp_path / "fakepy"
    fake.write_text(f"#!/bin/bash\necho \"FAKEPY $*\"\ncase \"$*\" in *env_report*) exit {env_rc};; esac\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_")}
    full.update(PYTHON=str(fake), OUT=str(out), **env)
    p = subprocess.run(["bash", "scripts/gpu/check.sh"], cwd=ROOT, env=full, capture_output=True, text=True,
                       timeout=60)
    text = p.stdout + p.stderr
    return p.returncode, text, {m[1]: int(m[2]) for m in re.finditer(r"==== (\w+) \(limit (\d+)s\) ====", text)}


def test_each_part_leaves_the_later_parts_their_minimum(tmp_path):
    rc, out, limits = _check(tmp_path, GPU_CHECK_PARTS="bench,memory,tests,kernels,predict",
                             GPU_CHECK_BUDGET_S="560", GPU_TESTS_TIMEOUT_S="250")
    assert rc == 0, out
    # the tests asked for 250 s; kernels, predict, memory and bench need 45, 90, 45, 90 s (+20 s each)
    assert 170 <= limits["gpu_tests"] <= 175, limits
    assert list(limits) == ["env", "gpu_tests", "kernels", "predict", "memory", "bench"], limits  # fixed order
    assert "--time-budget-s" in out and limits["bench"] < 560


def test_too_small_a_budget_runs_nothing_and_says_so(tmp_path):
    rc, out, limits = _check(tmp_path, GPU_CHECK_PARTS="tests,memory,bench", GPU_CHECK_BUDGET_S="100")
    assert rc == 1 and "gpu_tests" not in limits and "bench" not in limits, out
    assert re.search(r"tests\s+NOT RUN", out) and re.search(r"bench\s+NOT RUN", out), out


def test_an_unknown_part_is_an_error_and_a_failed_environment_stops_the_rest(tmp_path):
    rc, out, _ = _check(tmp_path, GPU_CHECK_PARTS="tests,kernel")
    assert rc == 2 and "unknown part 'kernel'" in out, out
    rc, out, limits = _check(tmp_path, env_rc=1, GPU_CHECK_PARTS="tests, bench")
    assert rc == 1 and list(limits) == ["env"] and "NOT RUN (env failed)" in out, out
    assert "FAKEPY -m pytest" not in out
