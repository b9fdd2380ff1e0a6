"""A Hydra multirun sweep (`train.py -m optim.lr=1e-4,3e-4`) runs one job per point. Every job of a sweep
whose trainer.run_name is the default (`${model.name}`) would share one run directory, and a run resumes
from the checkpoint it finds there: the second job resumed the first one's finished run, trained nothing
and exited 0. Such a job gets a run name of its own instead: `<run name>-<key=value,...>` of the swept
keys (from the command line), or of all the job's overrides (Hydra's `hydra.job.override_dirname`) where
the command line is not the sweep's (a launcher that runs jobs in other processes). The same point gets
the same name whenever the sweep is run again, so a requeued or rerun job resumes its own run. A run name
given in the overrides is the user's and is kept."""
from __future__ import annotations

import hashlib

MAX_NAME = 120  # a file name must stay under 255 bytes; keep room for humans too


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def gives_run_name(task_overrides: list[str]) -> bool:
    """Whether the job's overrides set trainer.run_name (as `trainer.run_name=...`, `+...` or `++...`)."""
    return any(_key(o) == "trainer.run_name" for o in task_overrides)


def swept_keys(argv: list[str]) -> set[str]:
    """The keys a command line sweeps (`k=a,b`, `k=range(...)`, `k=choice(...)`); empty when it sweeps none
    or is not a Hydra command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if "=" in a and not a.startswith("-") and not _key(a).startswith("hydra")]
    try:
        return {o.key_or_group for o in OverridesParser.create().parse_overrides(args) if o.is_sweep_override()}
    except Exception:  # noqa: BLE001 - not a command line Hydra parsed: fall back to all the job's overrides
        return set()


def job_run_name(base: str, task_overrides: list[str], override_dirname: str, swept: set[str]) -> str:
    """`base-<swept key=value,...>` (or `base-<override_dirname>`), path separators replaced; a long one is
    cut and kept unique by a hash of the whole."""
    points = [o.lstrip("+") for o in task_overrides if _key(o) in swept]
    suffix = ",".join(sorted(points)) if points else override_dirname
    if not suffix:
        return base
    name = f"{base}-{suffix}".replace("/", "_").replace("\\", "_")
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[:MAX_NAME - 11]}-{digest}"
    return name
