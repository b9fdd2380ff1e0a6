"""Out-of-memory predicted by the joint planner against train.py runs under a per-rank memory cap (CPU).

Each (tp, pp, AMSP degrees, micro-batch) configuration of a ~100M-parameter model runs train.py on 4
ranks for 2 steps, every rank inside its own cgroup-v1 memory group limited to the cap (this script
is the rank's entry point: it joins its group, then runs train.py in the same process). A run whose
rank the kernel's OOM killer ended (the group's `oom_kill` count) is an out-of-memory run. The
prediction is the joint planner's memory model (its tightest stage, amsp/planner/joint/stage_cost.py,
with the allocator margin of the ranks' glibc setting: RANK_ENV, amsp/planner/allocator.py) with the
runtime outside the tensors as the reserve (the anonymous memory of a debug-sized run of the same
launcher, measured first): the configuration fits when that is within the cap, the rule the planner
applies to the device memory. The split is the one train.py runs for a hand-named parallel.pp
(amsp/parallel/pipeline.py split_layers).
--fidelity runs every configuration uncapped instead and compares each rank's anonymous peak above its
anonymous memory before the build (what a cap kills for; the resident set's is reported beside it)
with its stage's predicted tensors (no margin, no reserve); the training steps and the final
checkpoint's save are reported apart. Every configuration runs under each of several caps (by default
the quartiles and the median of the predicted peaks: one cap at the median put three predictions
within 2 MiB of it on 26 Nov, and one such run decided the precision of ten). Reports precision and
recall of "out of memory" over all (configuration, cap) runs and per cap (issue 16: both >= 0.95) and,
for the runs that lived, their peak resident set (train.py's VmHWM, which also counts shared library
pages the group is not charged for).
A group's own usage counter is no peak here: it fills with reclaimable page cache up to the cap.

    python scripts/bench/joint_memory_caps.py --json /tmp/jm/caps.json            # needs root (cgroup v1)
    python scripts/bench/joint_memory_caps.py --cap-mib 1400,1200 --limit 4
    python scripts/bench/joint_memory_caps.py --fidelity --json /tmp/jm/fidelity.json   # no cgroups needed
    python scripts/bench/joint_memory_caps.py --reprice /tmp/jm/fidelity.json   # the same runs, this model
    python scripts/bench/joint_memory_caps.py --reprice-caps /tmp/jm/caps.json  # the same outcomes, this model
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_memory_fidelity import vm_kib  # noqa: E402
from torchrun_cmd import torchrun_cmd  # noqa: E402

CGROUP = "/sys/fs/cgroup/memory"
MIB = 2**20
MODEL = ["model=tiny", "model.dim=768", "model.n_layers=8", "model.n_heads=12", "model.n_kv_heads=4",
         "model.vocab_size=32000", "model.max_seq_len=256", "data.seq_len=256", "trainer.global_batch_size=8"]
# Every rank's environment. glibc serves blocks over 64 KiB by mmap and trims at once, so a freed tensor's
# pages go back (as bench_memory_fidelity.py does): with glibc's defaults it keeps them, and a zero3 run
# whose tensors need ~1.1 GiB was OOM-killed under a 1.4 GiB cap. At 1 MiB the tensor-parallel runs'
# sub-MiB activation slices (T x dim / tp fp32) stayed on the heap: tp 2, 1/1/1 kept 150 MiB after its
# first step that 64 KiB returns (18 MiB). The planner's margin for this setting is the tensors' page
# tables alone, 1/512 (amsp/planner/allocator.py); the predictions use it.
RANK_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "MALLOC_TRIM_THRESHOLD_": "0"}
CONFIGS = [(1, 1, d, 1) for d in ((1, 1, 1), (1, 1, 4), (1, 4, 4), (4, 4, 4))] + [
    (1, 1, (1, 1, 1), 2), (1, 1, (2, 2, 2), 2), (1, 1, (4, 4, 4), 2), (2, 1, (1, 1, 1), 2), (2, 1, (2, 2, 2), 2),
    (1, 2, (1, 1, 1), 2), (2, 2, (1, 1, 1), 2), (1, 4, (1, 1, 1), 2)] + [
    # added 2026-11-25 (indices 12-19): one boundary run decides the precision of 12, so more plans
    (1, 1, (1, 2, 2), 1), (1, 1, (2, 2, 4), 1), (1, 1, (1, 1, 2), 2), (1, 1, (2, 4, 4), 2),
    (2, 1, (1, 1, 2), 2), (2, 1, (1, 2, 2), 2), (1, 2, (2, 2, 2), 2), (1, 2, (1, 1, 2), 2)]


def mark_build_start(out_path: str, anon_join_kib: int) -> None:
    """Fidelity mode: the resident set just before the model is built becomes the base, VmHWM restarts
    there and is read at exit (train.py's own per-step resets are switched off), so the peak above
    the base is what the build, the steps and the pipeline added: tensors plus what the runtime grew.
    anon_join_kib: the anonymous memory where a capped rank joins its group (rank_shim)."""
    import atexit

    import amsp.build
    import amsp.metrics.memory as memory
    import amsp.parallel.setup as setup
    import amsp.train_state as train_state

    state = {}

    def mark():
        if not state:
            state.update(base_kib=vm_kib("VmRSS"), anon_kib=vm_kib("RssAnon"), file_kib=vm_kib("RssFile"))
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def wrap(mod, name):
        inner = getattr(mod, name)

        def wrapped(*a, **k):
            mark()
            return inner(*a, **k)
        setattr(mod, name, wrapped)

    wrap(amsp.build, "engine_from_config")
    wrap(setup, "model_parts")
    memory.reset_cpu_peak = lambda: None
    # the training steps' peak apart from the final checkpoint's (its staging is host memory)
    inner_save = train_state.save_training_state

    def save(*a, **k):
        state.setdefault("before_save_kib", vm_kib("VmHWM"))
        state.setdefault("file_at_save_kib", vm_kib("RssFile"))
        return inner_save(*a, **k)
    train_state.save_training_state = save

    def report():
        if state:
            json.dump({"base_mib": state["base_kib"] / 1024, "hwm_mib": vm_kib("VmHWM") / 1024,
                       "anon_join_mib": anon_join_kib / 1024,
                       "anon_base_mib": state["anon_kib"] / 1024, "file_base_mib": state["file_kib"] / 1024,
                       "file_steps_mib": state.get("file_at_save_kib", 0) / 1024,
                       "steps_hwm_mib": state.get("before_save_kib", 0) / 1024}, open(out_path, "w"))
    atexit.register(report)


def load_parallel_runtime() -> None:
    """Every run loads the parallel runtime's modules before anything else (torch.distributed.pipelining
    alone adds 29 MiB of resident code and data when a pipelined run imports it): they are part of the
    runtime the reserve measures, the same in every run, not the model's tensors the fidelity mode
    compares with its base. A capped rank loads them after joining its group."""
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401


# rank_shim's cap for a run measured inside memory groups without a limit (runtime_reserve): what the
# groups are charged for, kernel memory included, beside the fidelity mode's peaks
MEASURED_IN_GROUPS = -1


def rank_shim(cap_mib: int, tag_dir: str, argv: list[str]) -> None:
    """This rank's own memory group at the cap, then train.py in this process. cap 0: no group, the
    peak above the build measured (the fidelity mode); MEASURED_IN_GROUPS: both, the group unlimited.
    A group is charged only for the pages touched after the join: the interpreter's ~8 MiB of
    anonymous memory from before it stays with the parent group, so the measured runs record the
    anonymous memory at the same point (runtime_reserve leaves it out)."""
    rank = os.environ.get("RANK", "0")
    if cap_mib != 0:
        group = os.path.join(CGROUP, f"amspb-cap-{os.getpid()}")
        os.makedirs(group, exist_ok=True)
        if cap_mib > 0:
            with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
                f.write(str(cap_mib * MIB))
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        with open(os.path.join(tag_dir, f"rank{rank}"), "w") as f:
            f.write(group)
    anon_join_kib = vm_kib("RssAnon")
    load_parallel_runtime()  # inside the group: charged to it, as the reserve counts it
    if cap_mib <= 0:
        mark_build_start(os.path.join(tag_dir, f"peak{rank}.json"), anon_join_kib)
    sys.argv = ["train.py", *argv]
    os.chdir(ROOT)
    runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")


def read_groups(tag_dir: str) -> list[dict]:
    """Per rank: OOM kills, peak bytes and peak kernel memory of its group (cgroup v1 charges a group's
    page tables, socket buffers and slab against its limit); the groups are removed."""
    out = []
    for name in sorted(os.listdir(tag_dir)):
        if not name.startswith("rank"):
            continue
        group = open(os.path.join(tag_dir, name)).read().strip()
        oom = dict(line.split() for line in open(os.path.join(group, "memory.oom_control")))
        peak = int(open(os.path.join(group, "memory.max_usage_in_bytes")).read())
        kmem = int(open(os.path.join(group, "memory.kmem.max_usage_in_bytes")).read())
        out.append({"rank": name, "oom_kills": int(oom.get("oom_kill", 0)), "peak_bytes": peak,
                    "kmem_peak_bytes": kmem})
        for _ in range(50):  # the group empties once its processes are reaped
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)
    return out


def run(tp: int, pp: int, deg, mbs: int, cap_mib: int, extra: list[str], workdir: str, prefix: str = "",
        tag_dir: str | None = None) -> dict:
    """cap_mib 0: no memory groups (the fidelity mode's uncapped run); MEASURED_IN_GROUPS: unlimited ones."""
    name = f"{prefix}tp{tp}pp{pp}_{'-'.join(map(str, deg))}_mbs{mbs}"
    tag_dir = tag_dir or tempfile.mkdtemp(dir=workdir)
    args = [*extra, f"parallel.tp={tp}", f"parallel.pp={pp}", f"amsp.p={deg[0]}", f"amsp.g={deg[1]}",
            f"amsp.os={deg[2]}", "amsp.plan=custom", f"trainer.micro_batch_size={mbs}", "trainer.max_steps=2",
            "trainer.val_samples=0", "trainer.checkpoint_interval=0", "logging.wandb.mode=disabled",
            "logging.plot=false", f"trainer.output_dir={workdir}", f"trainer.run_name={name}",
            "amsp.ranks_per_node=2", "amsp.planner.recheck_steps=0"]
    cmd = torchrun_cmd(4, [os.path.abspath(__file__), "--rank-shim", str(cap_mib), "--tag-dir", tag_dir, "--", *args],
                       workdir)
    env = {**os.environ, **RANK_ENV}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    groups = read_groups(tag_dir)
    if cap_mib <= 0:
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed ({proc.returncode}): {(proc.stderr + proc.stdout)[-1500:]}")
        return {"groups": groups}
    oom = any(g["oom_kills"] for g in groups)
    peak = None
    metrics = os.path.join(workdir, name, "metrics.jsonl")
    if not oom and os.path.exists(metrics):  # VmHWM, the largest rank's (shared library pages included)
        peak = max(json.loads(x).get("memory_peak_bytes") or 0 for x in open(metrics)) / MIB
    if proc.returncode != 0 and not oom:
        tail = [line for line in (proc.stderr + proc.stdout).splitlines() if "Error" in line or "error" in line][:6]
        raise SystemExit(f"{name} failed without an OOM kill ({proc.returncode}): {tail}")
    return {"oom": oom, "charged_mib": max(g["peak_bytes"] for g in groups) / MIB, "peak_rss_mib": peak,
            "groups": groups}


def anon_growth_mib(got: dict) -> float:
    """A rank's anonymous peak over the training steps above its anonymous memory before the build:
    the resident peak less the file-backed pages (code first run, the memory-mapped shards read),
    which the kernel reclaims under a cap instead of killing (read at the steps' end: a few MiB short
    if file pages were mapped after the peak; 13-16 MiB of them arrive during the steps here)."""
    return (got["steps_hwm_mib"] - got["file_steps_mib"]) - (got["base_mib"] - got["file_base_mib"])


def peaks_above_build(tp: int, pp: int, deg, mbs: int, extra: list[str],
                      workdir: str) -> list[tuple[float, float, float]]:
    """Uncapped run: each rank's peak resident set above its resident set before the build (MiB), over
    the training steps and over the whole run (the final checkpoint's save included), and the steps'
    anonymous peak above the anonymous memory before the build (anon_growth_mib)."""
    tag_dir = tempfile.mkdtemp(dir=workdir)
    run(tp, pp, deg, mbs, 0, extra, workdir, prefix="fid_", tag_dir=tag_dir)
    out = []
    for r in range(4):
        got = json.load(open(os.path.join(tag_dir, f"peak{r}.json")))
        out.append((got["steps_hwm_mib"] - got["base_mib"], got["hwm_mib"] - got["base_mib"], anon_growth_mib(got)))
    return out


def runtime_reserve(workdir: str, runs: int = 3) -> float:
    """MiB the runtime holds outside the model's tensors, per rank: a debug-sized run of the same launcher,
    its anonymous resident memory before the build (torch, process groups, data) plus the anonymous
    memory its steps added, less what the rank held where a capped one joins its group (the group is
    not charged for it: 8 MiB, until 28 Nov counted), plus the kernel memory its group was charged
    (page tables, socket buffers, slab: 6-14 MiB per rank on 28 Nov, until then not counted), the
    largest rank; the median of `runs` launches (one launch in a few reads ~150 MiB high: 436 and 423 MiB
    against 277-279 in nine others on 25 Nov). Of user memory, the anonymous only: the kernel reclaims
    page cache and shared library pages under a cap before it kills (a group's charged peak, page cache
    included, read 294 and 645 MiB on two runs). Until 26 Nov the steps' growth was the resident set's,
    which counted the 13-16 MiB of file pages the steps map."""
    seen = []
    for i in range(runs):  # a run directory of its own each: the same name would resume the previous launch
        tag_dir = tempfile.mkdtemp(dir=workdir)
        got = run(1, 1, (1, 1, 1), 1, MEASURED_IN_GROUPS, ["model=debug", "data.seq_len=64",
                                                           "trainer.global_batch_size=8"],
                  workdir, prefix=f"runtime{i}_", tag_dir=tag_dir)
        kmem = {g["rank"]: g["kmem_peak_bytes"] / MIB for g in got["groups"]}
        ranks = [json.load(open(os.path.join(tag_dir, f"peak{r}.json"))) for r in range(4)]
        seen.append(max(g["anon_base_mib"] - g["anon_join_mib"] + anon_growth_mib(g) + kmem[f"rank{r}"]
                        for r, g in enumerate(ranks)))
    print(f"runtime reserve per launch: {', '.join(f'{x:.0f}' for x in seen)} MiB", file=sys.stderr)
    return statistics.median(seen)


def stage_peaks(tp: int, pp: int, deg, mbs: int, reserve_bytes: float, extra: list[str]) -> float:
    """The largest stage's predicted bytes (reserve and margin included) with no memory limit."""
    return max(c.memory_bytes for c in stage_choices(tp, pp, deg, mbs, reserve_bytes, extra))


def stage_choices(tp: int, pp: int, deg, mbs: int, reserve_bytes: float, extra: list[str]) -> list:
    """The joint planner's per-stage choice (memory and its parts) for this configuration."""
    from amsp.parallel.pipeline import split_layers
    from amsp.plan import Degrees
    from amsp.planner.__main__ import compose_config
    from amsp.planner.allocator import margin_for
    from amsp.planner.from_config import cluster_spec
    from amsp.planner.joint.hetero import from_spec
    from amsp.planner.joint.search import _Candidate, split_bounds
    from amsp.planner.joint.stage_cost import Setting
    from amsp.planner.startup import kernels_for_model
    from amsp.schedule import Precision
    from configs.schema import to_llama_config

    cfg = compose_config([*extra, "cluster.device_memory_gib=1024"])
    spec = cluster_spec(cfg, nodes=2, ranks_per_node=2, local_ranks=4, device="cpu")
    model = to_llama_config(cfg.model)
    dp = 4 // (tp * pp)
    B = int(cfg.trainer.global_batch_size) // (dp * mbs)
    # the margin of the allocator the ranks run with (RANK_ENV: glibc returning freed blocks)
    s = Setting(model, int(cfg.data.seq_len), Precision.named("fp32"), tp, pp, dp, mbs, B, {},
                memory_margin=margin_for(None, "cpu", RANK_ENV), reserved_bytes=reserve_bytes,
                kernels=kernels_for_model(model, "cpu", "fp32"))
    cand = _Candidate(s, from_spec(spec))
    # the split the run uses: train.py's default for a hand-named parallel.pp (amsp/parallel/pipeline.py)
    bounds = split_bounds([len(layers) for layers in split_layers(model.n_layers, pp)])
    return cand.evaluate(bounds, Degrees(*deg), False)[1]


def fidelity(configs, json_path: str | None, t0: float) -> int:
    """Per configuration and stage: predicted tensor peak and its parts against the measured peak above
    the build (the largest rank of the stage)."""
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, c in enumerate(configs):
            tp, pp = c[0], c[1]
            choices = stage_choices(*c, 0.0, MODEL)
            measured = peaks_above_build(*c, MODEL, work)
            per_stage = 4 // pp
            for st, ch in enumerate(choices):
                parts = {k: v / MIB for k, v in ch.memory_parts.items() if k != "reserve"}
                pred = sum(parts.values())
                ranks = measured[st * per_stage:(st + 1) * per_stage]
                rss, with_save, got = (max(r[k] for r in ranks) for k in range(3))
                rows.append({"tp": tp, "pp": pp, "degrees": c[2], "mbs": c[3], "stage": st, "predicted_mib": pred,
                             "parts_mib": parts, "measured_mib": got, "rss_mib": rss, "with_save_mib": with_save,
                             "ranks_mib": measured})
                print(f"[{i + 1}/{len(configs)} {time.time() - t0:.0f}s] {c} stage {st}: predicted {pred:.0f} MiB "
                      f"({', '.join(f'{k} {v:.0f}' for k, v in parts.items())}), measured {got:.0f} MiB anonymous "
                      f"({(pred - got) / got:+.1%}), resident {rss:.0f} MiB ({(pred - rss) / rss:+.1%}); "
                      f"{with_save:.0f} MiB resident with the final save", file=sys.stderr)
    if json_path:
        json.dump({"rows": rows, "wall_s": time.time() - t0}, open(json_path, "w"), indent=1)
    return 0


def reprice(path: str) -> int:
    """A --fidelity run's measurements priced again by the memory model of this checkout (the
    measurements do not depend on the planner): per stage, predicted against measured, then the mean
    and worst errors."""
    rows = json.load(open(path))["rows"]
    choices, errors = {}, []
    for r in rows:  # runs before 26 Nov measured the resident set only: their "measured_mib"
        c = (r["tp"], r["pp"], tuple(r["degrees"]), r["mbs"])
        if c not in choices:
            choices[c] = stage_choices(*c, 0.0, MODEL)
        parts = {k: v / MIB for k, v in choices[c][r["stage"]].memory_parts.items() if k != "reserve"}
        pred, got = sum(parts.values()), r["measured_mib"]
        errors.append((pred - got) / got)
        shown = ", ".join(f"{k} {v:.0f}" for k, v in parts.items())
        print(f"{c} stage {r['stage']}: predicted {pred:.0f} MiB ({shown}), measured {got:.0f} MiB ({errors[-1]:+.1%})")
    print(f"{len(errors)} stages: mean |error| {statistics.mean(abs(e) for e in errors):.1%}, worst "
          f"{min(errors):+.1%} / {max(errors):+.1%}, within 10%: {sum(abs(e) <= 0.10 for e in errors)}")
    return 0


def reprice_caps(path: str, reserve_mib: float | None) -> int:
    """A caps run's outcomes (each configuration OOM-killed or not under each cap: facts that do not
    depend on the planner) decided again by this checkout's memory model with a reserve measured now
    (or given): precision and recall over all runs and per cap."""
    rows = json.load(open(path))["rows"]
    if reserve_mib is None:
        with tempfile.TemporaryDirectory() as work:
            reserve_mib = runtime_reserve(work)
    peaks = {}
    for r in rows:
        c = (r["tp"], r["pp"], tuple(r["degrees"]), r["mbs"])
        if c not in peaks:
            peaks[c] = stage_peaks(*c, reserve_mib * MIB, MODEL) / MIB
        r["predicted_mib"], r["predicted_fits"] = peaks[c], peaks[c] <= r["cap_mib"]
        if r["predicted_fits"] == r["oom"] or abs(peaks[c] - r["cap_mib"]) < 25:
            print(f"cap {r['cap_mib']}: {c} predicted {peaks[c]:.1f} MiB "
                  f"({'fits' if r['predicted_fits'] else 'OOM'}), ran {'OOM' if r['oom'] else 'lived'}")
    print(json.dumps({"reserve_mib": reserve_mib, **decisions_by_cap(rows)}, indent=1))
    return 0


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of sorted xs, linear between neighbours (q 0.5: the median)."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def decisions(rows: list[dict]) -> dict:
    """Precision and recall of "out of memory" over these (configuration, cap) runs."""
    hit = sum(r["oom"] and not r["predicted_fits"] for r in rows)
    false_alarm = sum(not r["oom"] and not r["predicted_fits"] for r in rows)
    missed = sum(r["oom"] and r["predicted_fits"] for r in rows)
    return {"runs": len(rows), "oom_runs": sum(r["oom"] for r in rows), "false_alarms": false_alarm,
            "missed": missed, "precision": hit / (hit + false_alarm) if hit + false_alarm else float("nan"),
            "recall": hit / (hit + missed) if hit + missed else float("nan")}


def decisions_by_cap(rows: list[dict]) -> dict:
    """decisions() over all runs and per cap."""
    caps = sorted({r["cap_mib"] for r in rows})
    return {"all_caps": decisions(rows),
            "per_cap": {str(cap): decisions([r for r in rows if r["cap_mib"] == cap]) for cap in caps}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap-mib", help="comma-separated per-rank caps in MiB (default: --quantiles)")
    ap.add_argument("--quantiles", default="0.25,0.5,0.75",
                    help="caps at these quantiles of the predicted peaks, every configuration under each")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--only", help="comma-separated configuration indices (0-based) to run")
    ap.add_argument("--json")
    ap.add_argument("--fidelity", action="store_true",
                    help="no caps: each rank's peak above its pre-build resident set against its stage's "
                         "predicted tensors (no margin, no reserve)")
    ap.add_argument("--reprice", metavar="JSON", help="price a --fidelity run's measurements again (no runs)")
    ap.add_argument("--reprice-caps", metavar="JSON",
                    help="decide a caps run's outcomes again with this model and a reserve measured now")
    ap.add_argument("--reserve-mib", type=float, help="with --reprice-caps: this reserve instead of measuring one")
    ap.add_argument("--rank-shim", type=int, help=argparse.SUPPRESS)  # internal: one capped rank
    ap.add_argument("--tag-dir", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_shim is not None:
        rank_shim(a.rank_shim, a.tag_dir, a.rest)
        return 0
    if a.reprice:
        return reprice(a.reprice)
    if not os.access(CGROUP, os.W_OK):
        raise SystemExit(f"{CGROUP} is not writable: needs root and a cgroup-v1 memory controller")
    if a.reprice_caps:
        return reprice_caps(a.reprice_caps, a.reserve_mib)
    t0 = time.time()
    configs = CONFIGS[:a.limit] if a.limit else CONFIGS
    if a.only:
        configs = [CONFIGS[int(i)] for i in a.only.split(",")]
    if a.fidelity:
        return fidelity(configs, a.json, t0)
    with tempfile.TemporaryDirectory() as work:
        reserve_mib = runtime_reserve(work)
        peaks = {c: stage_peaks(*c, reserve_mib * MIB, MODEL) / MIB for c in configs}
        caps = [int(x) for x in a.cap_mib.split(",")] if a.cap_mib else \
            [int(quantile(sorted(peaks.values()), float(q))) for q in a.quantiles.split(",")]
        print(f"runtime reserve {reserve_mib:.0f} MiB per rank; caps {caps} MiB per rank", file=sys.stderr)
        rows = []
        for cap in caps:
            for i, c in enumerate(configs):
                fits = peaks[c] <= cap
                got = run(*c, cap, MODEL, work, prefix=f"cap{cap}_")
                rows.append({"cap_mib": cap, "tp": c[0], "pp": c[1], "degrees": c[2], "mbs": c[3],
                             "predicted_mib": peaks[c], "predicted_fits": fits, "oom": got["oom"],
                             "peak_rss_mib": got["peak_rss_mib"]})
                print(f"[cap {cap}: {i + 1}/{len(configs)} {time.time() - t0:.0f}s] {c}: predicted {peaks[c]:.0f} "
                      f"MiB ({'fits' if fits else 'OOM'}), run {'OOM' if got['oom'] else 'lived'} at "
                      f"peak RSS {got['peak_rss_mib'] or 0:.0f} MiB", file=sys.stderr)
    summary = {"caps_mib": caps, "reserve_mib": reserve_mib, "configs": len(configs),
               **decisions_by_cap(rows),
               "lived": [(r["cap_mib"], r["tp"], r["pp"], r["degrees"], r["mbs"], round(r["predicted_mib"]),
                          round(r["peak_rss_mib"])) for r in rows if not r["oom"] and r["peak_rss_mib"]],
               "wall_s": time.time() - t0}
    print(json.dumps(summary, indent=1))
    if a.json:
        json.dump({"summary": summary, "rows": rows}, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
