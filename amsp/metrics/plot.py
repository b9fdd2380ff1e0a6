"""Plot a run's metrics: `python -m amsp.metrics.plot RUN_DIR` writes RUN_DIR/metrics.png.

Three panels over steps: training loss, global tokens/s, and MFU. A resumed run appends to the
same metrics.jsonl, so a step logged twice keeps its latest record.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")  # headless: no display on cluster nodes or CI
import matplotlib.pyplot as plt  # noqa: E402


def read_records(path: pathlib.Path) -> list[dict]:
    by_step: dict[int, dict] = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{i}: not a JSON record ({e})") from None
        if "step" not in rec:
            raise ValueError(f"{path}:{i}: record has no 'step' field")
        by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key] * scale) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | pathlib.Path, out: str | pathlib.Path | None = None) -> pathlib.Path:
    run_dir = pathlib.Path(run_dir)
    src = run_dir / "metrics.jsonl"
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist: is {run_dir} a run directory with logged steps?")
    records = read_records(src)
    if not records:
        raise ValueError(f"{src} holds no records")
    out = pathlib.Path(out) if out else run_dir / "metrics.png"
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    panels = [("loss", "training loss", 1.0, False), ("tokens_per_s", "tokens/s (global)", 1.0, False),
              ("mfu", "MFU (%)", 100.0, True)]
    for ax, (key, label, scale, optional) in zip(axes, panels):
        xs, ys = _series(records, key, scale)
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2)
        else:
            ax.text(0.5, 0.5, f"no {key} recorded" + (" (no peak FLOP/s known)" if optional else ""),
                    ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    last = records[-1]
    fig.suptitle(f"{run_dir.name}: step {last['step']}/{last.get('total_steps', '?')}, "
                 f"world size {last.get('world_size', '?')}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="run directory holding metrics.jsonl")
    ap.add_argument("-o", "--output", help="output PNG (default RUN_DIR/metrics.png)")
    args = ap.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.output)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
