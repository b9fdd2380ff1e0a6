"""scripts/bench/bench_optimizer.py runs every AdamW variant on small shards and the variants' masters agree
(it had stopped running when the sharded optimizer began reading a unit's norm_excluded; nothing ran it)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_variant_runs_and_takes_the_same_steps():
    from amsp.sharded_optim import native_adamw_unavailable

    variants = ["fused", "foreach", "old"] + ([] if native_adamw_unavailable("cpu") else ["csrc"])
    proc = subprocess.run([sys.executable, "scripts/bench/bench_optimizer.py", "--units", "2", "--dim", "64",
                           "--ffn", "160", "--rounds", "2", "--steps", "2", "--variants", ",".join(variants)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    timed = dict(re.findall(r"^(\w+)\s+([\d.]+)\s+[\d.]+", proc.stdout, re.M))
    assert set(timed) >= set(variants), proc.stdout
    diffs = dict(re.findall(r"masters after \d+ steps: (\w+) vs fused max rel diff (\S+)", proc.stdout))
    assert sorted(diffs) == sorted(variants[1:]), proc.stdout
    assert all(float(d) < 1e-5 for d in diffs.values()), diffs
