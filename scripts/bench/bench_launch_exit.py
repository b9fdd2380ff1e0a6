"""What amsp/exit_gc.py saves at the end of a run: the wall time of short torchrun launches of train.py with
the collect-then-freeze at exit ("on", train.py as it is) and without it ("off": the registration
replaced by a no-op before train.py runs), alternating in one session so that the host's load falls on
both alike. Also the exit of a bare `import torch.distributed.checkpoint` with and without it.

    .venv/bin/python scripts/bench/bench_launch_exit.py [--rounds 4] [--nproc 4]

Each launch is a 3-step debug-sized run on the built-in corpus (the shape tests/training/runs.py uses);
the corpus and the native extension must already be built (any earlier train.py run does it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from torchrun_cmd import torchrun_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# train.py run as __main__, with the exit hook's registration first replaced by a no-op ("off")
WRAPPER = """import runpy, sys
sys.path.insert(0, {root!r})
if {off!r}:
    import amsp.exit_gc
    amsp.exit_gc.skip_shutdown_gc_passes = lambda: None
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""
RUN = ["model=debug", "model.vocab_size=8192", "data.seq_len=32", "trainer.global_batch_size=8",
       "trainer.micro_batch_size=2", "trainer.max_steps=3", "trainer.checkpoint_interval=0",
       "trainer.val_samples=0", "logging.wandb.mode=disabled", "logging.plot=false", "amsp.ranks_per_node=2"]
IMPORT = ("import sys; sys.path.insert(0, {root!r}); import torch.distributed.checkpoint\n"
          "if {on!r}:\n    from amsp.exit_gc import skip_shutdown_gc_passes; skip_shutdown_gc_passes()")


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=4)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {k: [] for k in ("launch off", "launch on", "import off", "import on")}
    with tempfile.TemporaryDirectory(prefix="bench_exit_") as tmp:
        wrappers = {}
        for variant in ("off", "on"):
            wrappers[variant] = os.path.join(tmp, f"train_{variant}.py")
            with open(wrappers[variant], "w") as fh:
                fh.write(WRAPPER.format(root=ROOT, off=variant == "off", train=os.path.join(ROOT, "train.py")))
        for r in range(args.rounds):
            for variant in ("off", "on") if r % 2 == 0 else ("on", "off"):
                run = [f"trainer.output_dir={tmp}", f"trainer.run_name={variant}{r}", *RUN]
                times[f"launch {variant}"].append(timed(
                    torchrun_cmd(args.nproc, [wrappers[variant], *run], tmp), env))
                times[f"import {variant}"].append(timed(
                    [sys.executable, "-c", IMPORT.format(root=ROOT, on=variant == "on")], env))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)
    print(f"\n| what | without (s, each round) | with collect-then-freeze (s) | median saved |\n|---|---|---|---:|")
    for what, label in (("launch", f"torchrun, {args.nproc} ranks, 3 debug steps"),
                        ("import", "`python -c 'import torch.distributed.checkpoint'`")):
        off, on = times[f"{what} off"], times[f"{what} on"]
        print(f"| {label} | {', '.join(f'{t:.2f}' for t in off)} | {', '.join(f'{t:.2f}' for t in on)} | "
              f"{statistics.median(off) - statistics.median(on):.2f} s |")


if __name__ == "__main__":
    main()
