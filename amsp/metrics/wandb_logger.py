"""Weights & Biases logging, rank 0 only.

`logging.wandb.mode`: online | offline | disabled. Offline runs write under RUN_DIR/wandb/ and can be
uploaded later with `wandb sync`. The run id is exposed (`run_id`) so a checkpoint can store it;
passing it back as `resume_id` continues the same wandb run after a restart.

Steps: metrics are plotted over `train/step` (STEP_METRIC, the trainer's step, in every row), not over
wandb's own `_step`. wandb drops (with a console warning, silent under WANDB_SILENT) a row logged at a
`_step` below the run's current one, and a resumed online run continues after the server's last `_step`:
a run killed after logging steps past its last checkpoint, resumed from that checkpoint, logs those steps
again, and with `log(step=step)` wandb dropped them. Logged with the trainer step as a metric (wandb's
`_step` then only counts rows), every row is kept; the steps between the checkpoint and the kill appear
twice on the step axis (the killed run's rows and the resumed run's, the same values when the resume is
deterministic).

Secrets: wandb reads WANDB_API_KEY from the environment itself; this module never reads, logs or
stores environment variables, and strips any secret-looking key (and any value equal to the API
key) from the config before handing it to wandb, so the saved run config cannot hold a key.
"""
from __future__ import annotations

import logging
import os
import pathlib
import re
from typing import Any, Sequence

log = logging.getLogger(__name__)

MODES = ("online", "offline", "disabled")
STEP_METRIC = "train/step"
# Sections plotted over STEP_METRIC (keys without a section go under train/: log_metrics).
_STEP_SECTIONS = ("train/*", "val/*")
_SECRET_KEY = re.compile(r"(api_?key|secret|password|passwd|credential|(^|_)token$)", re.IGNORECASE)


def scrub_secrets(obj: Any, secret_values: frozenset[str] = frozenset()) -> Any:
    """Copy of a nested dict/list config without secret-looking keys or known secret values."""
    if isinstance(obj, dict):
        return {k: scrub_secrets(v, secret_values) for k, v in obj.items()
                if not (isinstance(k, str) and _SECRET_KEY.search(k))}
    if isinstance(obj, (list, tuple)):
        return [scrub_secrets(v, secret_values) for v in obj]
    if isinstance(obj, str) and obj in secret_values:
        return "<redacted>"
    return obj


class WandbLogger:
    def __init__(self, *, mode: str, run_dir: str | pathlib.Path, config: dict[str, Any], rank: int = 0,
                 project: str = "amsp-llama", entity: str | None = None, name: str | None = None,
                 tags: Sequence[str] = (), group: str | None = None, resume_id: str | None = None):
        if mode not in MODES:
            raise ValueError(f"logging.wandb.mode={mode!r} is not one of {'|'.join(MODES)}")
        self.mode = mode
        self._run = None
        if rank != 0 or mode == "disabled":
            return
        import wandb  # imported only when used: it is slow to import and starts a service process

        key = os.environ.get("WANDB_API_KEY")
        safe_config = scrub_secrets(config, frozenset({key}) if key else frozenset())
        run_dir = pathlib.Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        try:
            self._run = wandb.init(
                project=project, entity=entity, name=name, tags=list(tags) or None, group=group,
                config=safe_config, dir=str(run_dir), mode=mode,
                id=resume_id, resume="allow" if resume_id else None,
            )
        except Exception as e:  # noqa: BLE001 - wandb raises its own types (UsageError, CommError, ...)
            from amsp.errors import InputError

            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise InputError(f"wandb could not start the run in {mode} mode ({type(e).__name__}: {first}); log in "
                             f"(`wandb login` or WANDB_API_KEY), or set logging.wandb.mode=offline (sync later "
                             f"with `wandb sync`) or logging.wandb.mode=disabled") from None
        # On every start, a resumed one too (a run killed before its first log may not have them).
        self._run.define_metric(STEP_METRIC)
        for section in _STEP_SECTIONS:
            self._run.define_metric(section, step_metric=STEP_METRIC)
        log.info("wandb %s run %s (%s) in %s", mode, self._run.id, "resumed" if resume_id else "new",
                 self._run.dir if mode == "offline" else self._run.url)

    @property
    def active(self) -> bool:
        return self._run is not None

    @property
    def run_id(self) -> str | None:
        """The wandb run id to store in checkpoints (None when disabled or not rank 0)."""
        return self._run.id if self._run is not None else None

    def update_config(self, entries: dict[str, Any]) -> None:
        """Add entries known only after wandb.init (the chosen plan) to the run config, scrubbed like
        the initial config. A resumed run may change them (another world size, another plan)."""
        if self._run is None:
            return
        key = os.environ.get("WANDB_API_KEY")
        self._run.config.update(scrub_secrets(entries, frozenset({key}) if key else frozenset()),
                                allow_val_change=True)

    def log_metrics(self, record: dict[str, Any], step: int) -> None:
        """Numbers of `record` at trainer step `step` (logged as STEP_METRIC, the axis they are plotted
        over); plain keys go under train/ so panels group together, keys that already name a section
        ("val/loss") are kept as they are. None is dropped."""
        if isinstance(step, bool) or not isinstance(step, int):  # checked disabled too: a caller's bug
            raise TypeError(f"log_metrics: step must be the trainer step (an int), got {step!r}")
        if self._run is None:
            return
        data = {(k if "/" in k else f"train/{k}"): v for k, v in record.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        data[STEP_METRIC] = step
        # No step=: wandb's own _step only counts rows, so a step logged again after a resume is kept
        # (module docstring).
        self._run.log(data)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Log a table (e.g. the planner's ranked plans) under `name`."""
        if self._run is None:
            return
        for row in rows:
            if len(row) != len(columns):
                raise ValueError(f"table {name!r}: row {list(row)} has {len(row)} cells, expected "
                                 f"{len(columns)} ({', '.join(columns)})")
        self._run.log({name: self._wandb.Table(columns=list(columns), rows=[list(r) for r in rows])})

    def finish(self, exit_code: int = 0) -> None:
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None
