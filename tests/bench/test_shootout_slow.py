"""End-to-end run of the shoot-out on the emulated cluster: two systems, one short round.

Slow (about 1-2 minutes on 2 cores) and needs root + iproute2, so it is marked `slow` and not part
of the default suite: `pytest -m slow tests/bench/test_shootout_slow.py`.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="needs root and iproute2 (ip, tc)")]


def test_shootout_ddp_vs_amsp_hsdp_same_loss_and_counted_bytes(tmp_path):
    out = tmp_path / "r.json"
    # its temporary work folder goes where TMPDIR says, and a successful run removes it
    env = dict(os.environ, TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench", "shootout.py"), "--regime", "comm-fp32",
                        "--rate", "1gbit", "--systems", "ddp,amsp:hsdp", "--rounds", "1", "--warmup-steps", "0",
                        "--timeout", "400", "--json", str(out)], capture_output=True, text=True, timeout=480, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not list(tmp_path.glob("amspb-shootout-*")), "the work folder of a successful run is left behind"
    rows = {row["system"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["ddp"]["final_loss"] == pytest.approx(rows["amsp:hsdp"]["final_loss"], rel=1e-5)
    # DDP's ring all-reduce of the fp32 gradients crosses the links; AMSP hsdp sends half as much.
    numel = 7_342_336
    assert rows["ddp"]["inter_node_mb_per_step"] > 2 * 4 * numel / 1e6
    assert rows["amsp:hsdp"]["inter_node_mb_per_step"] < 0.75 * rows["ddp"]["inter_node_mb_per_step"]
