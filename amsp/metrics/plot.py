"""Plot runs' metrics on one figure.

    python -m amsp.metrics.plot RUN_DIR                            # writes RUN_DIR/metrics.png
    python -m amsp.metrics.plot RUN_A RUN_B [...] --out cmp.png    # runs compared, one line each

Six panels: training loss, validation loss (RUN_DIR/validation.jsonl), global tokens/s, MFU, peak
memory per rank, and step time, over tokens seen (default) or steps (--x step). Each run is one
colour, named in the legend by its directory name (parent/name when two runs share a name). A
resumed run appends to the same metrics.jsonl, so a step logged twice keeps its latest record.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # headless: no display on cluster nodes or CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from amsp.errors import EXIT_INPUT  # noqa: E402

X_AXES = ("tokens", "step")
# (record key, y label, scale); memory: the largest per-rank peak.
PANELS = (("loss", "training loss", 1.0), ("val_loss", "validation loss", 1.0),
          ("tokens_per_s", "tokens/s (global)", 1.0), ("mfu", "MFU (%)", 100.0),
          ("memory_peak_bytes", "peak memory per rank (GiB)", 2.0 ** -30), ("step_time_s", "step time (s)", 1.0))


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


@dataclass
class Run:
    directory: pathlib.Path
    label: str
    records: list  # metrics.jsonl, one per logged step
    validation: list  # validation.jsonl (step, val_loss), possibly empty


def load_run(run_dir: str | pathlib.Path, label: str | None = None) -> Run:
    run_dir = pathlib.Path(run_dir)
    src = run_dir / "metrics.jsonl"
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist: is {run_dir} a run directory with logged steps?")
    records = read_records(src)
    if not records:
        raise ValueError(f"{src} holds no records")
    val = run_dir / "validation.jsonl"
    validation = read_records(val) if val.exists() else []
    return Run(run_dir, label or run_dir.resolve().name, records, validation)


def run_labels(run_dirs: list[pathlib.Path]) -> list[str]:
    """Directory names; parent/name where names repeat (two sweeps' run "m"), so the legend tells them apart."""
    names = [p.resolve().name for p in run_dirs]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(run_dirs, names)]


def _x_of(run: Run, steps: list[int], x: str) -> list[float]:
    if x == "step":
        return [float(s) for s in steps]
    known = [(r["step"], r["tokens"]) for r in run.records if r.get("tokens") is not None]
    if not known:
        raise ValueError(f"{run.directory}/metrics.jsonl has no 'tokens' field: plot it over steps (--x step)")
    # Validation steps need not be log steps: tokens between two logged steps are interpolated.
    return list(np.interp(steps, [k[0] for k in known], [k[1] for k in known]))


def _value(record: dict, key: str) -> float | None:
    v = record.get(key)
    if v is None and key == "memory_peak_bytes":
        v = record.get("peak_memory_bytes")  # the field's name in runs logged before the rename
    return v


def _series(run: Run, key: str, scale: float, x: str) -> tuple[list[float], list[float]]:
    rows = run.validation if key == "val_loss" else run.records
    pts = [(r["step"], _value(r, key) * scale) for r in rows if _value(r, key) is not None]
    steps = [p[0] for p in pts]
    return (_x_of(run, steps, x) if steps else []), [p[1] for p in pts]


def build_figure(runs: list[Run], x: str = "tokens", title: str | None = None) -> plt.Figure:
    if x not in X_AXES:
        raise ValueError(f"x axis {x!r} is not one of {'|'.join(X_AXES)}")
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex=True)
    for ax, (key, label, scale) in zip(axes.flat, PANELS):
        drawn = 0
        for i, run in enumerate(runs):
            xs, ys = _series(run, key, scale, x)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, color=f"C{i}", label=run.label)
                drawn += 1
        if not drawn:
            why = {"val_loss": " (no validation.jsonl)", "mfu": " (no peak FLOP/s known)"}.get(key, "")
            ax.text(0.5, 0.5, f"no {key} recorded{why}", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("tokens seen" if x == "tokens" else "step")
    # One legend for the figure, from the panel where every run has a line (training loss).
    axes.flat[0].legend(loc="upper right", fontsize="small")
    if title is None and len(runs) == 1:
        last = runs[0].records[-1]
        title = (f"{runs[0].label}: step {last['step']}/{last.get('total_steps', '?')}, "
                 f"world size {last.get('world_size', '?')}")
    fig.suptitle(title or f"{len(runs)} runs compared")
    fig.tight_layout()
    return fig


def plot_runs(run_dirs: list[str | pathlib.Path], out: str | pathlib.Path, x: str = "tokens") -> pathlib.Path:
    """Every run directory's metrics on one figure, written to `out` (PNG)."""
    if not run_dirs:
        raise ValueError("no run directory given")
    dirs = [pathlib.Path(d) for d in run_dirs]
    runs = [load_run(d, label) for d, label in zip(dirs, run_labels(dirs))]
    fig = build_figure(runs, x)
    out = pathlib.Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_run(run_dir: str | pathlib.Path, out: str | pathlib.Path | None = None, x: str = "tokens") -> pathlib.Path:
    """One run; by default written to RUN_DIR/metrics.png (train.py calls this at the end of a run)."""
    return plot_runs([run_dir], out or pathlib.Path(run_dir) / "metrics.png", x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    ap.add_argument("-o", "--out", "--output", dest="out",
                    help="output PNG (default RUN_DIR/metrics.png; required for several runs)")
    ap.add_argument("--x", choices=X_AXES, default="tokens", help="horizontal axis (default tokens seen)")
    args = ap.parse_args(argv)
    if len(args.run_dirs) > 1 and not args.out:
        print("error: several run directories are compared on one figure: name it with --out FILE.png",
              file=sys.stderr)
        return EXIT_INPUT
    try:
        out = plot_runs(args.run_dirs, args.out or pathlib.Path(args.run_dirs[0]) / "metrics.png", args.x)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
