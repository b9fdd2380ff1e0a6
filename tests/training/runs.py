"""Launch short train.py runs (single process or torchrun) and read what they logged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A debug-sized model on the built-in corpus; every step logged, no plots or wandb.
BASE = ["model=debug", "model.vocab_size=8192", "data.seq_len=32", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2", "trainer.log_interval=1", "logging.wandb.mode=disabled",
        "logging.plot=false", "trainer.val_samples=0", "optim.warmup_steps=5",
        # The schedule must not depend on where a run stops, so decay is pinned.
        "optim.decay_steps=20"]


def train(run_dir: Path, *overrides: str, nproc: int = 1, timeout: float = 600, check: bool = True,
          ranks_per_node: int | None = None) -> subprocess.CompletedProcess:
    args = [f"trainer.output_dir={run_dir.parent}", f"trainer.run_name={run_dir.name}", *BASE, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # torchrun keeps a folder of its own per launch, in /tmp unless told: here one that goes with the call
    # (not beside the run: some tests make the run's folder read-only)
    with tempfile.TemporaryDirectory(prefix="torchrun-") as logs:
        if nproc == 1:
            cmd = [sys.executable, "train.py", *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   f"--log-dir={logs}", "train.py", *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
