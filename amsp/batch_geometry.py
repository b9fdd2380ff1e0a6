"""The global batch of an optimizer step, in whole micro-batches on every data-parallel rank.

train.py and the partitioner (amsp/planner/from_config.py) both size the step from here, so the
plan is costed for the batch the run actually takes.

The configured global batch (trainer.global_batch_size samples, or trainer.global_batch_tokens /
data.seq_len) must split into micro_batch_size x data-parallel ranks x accumulation steps. A fixed
number cannot do that for every world size (8 x N GPUs for N = 1..64 would need a multiple of
lcm(1..64)), so with trainer.round_global_batch=true (the default) a batch that does not split is
rounded to the nearest whole number of micro-batches per rank (at least one) and the change is
logged once as a warning; false makes it an error instead, for runs that must match a recipe exactly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from configs.validate import ConfigError  # a ValueError: callers that catch ValueError still do

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchGeometry:
    global_batch: int  # samples per optimizer step, across all data-parallel ranks
    micro_batch: int  # samples per forward/backward on one rank
    accumulation: int  # micro-batches per rank per step
    requested: int  # the configured global batch in samples, before any rounding

    @property
    def rounded(self) -> bool:
        return self.global_batch != self.requested


def requested_global_batch(cfg: DictConfig) -> int:
    """Samples per step as configured: trainer.global_batch_tokens / data.seq_len when set."""
    t = cfg.trainer
    if t.global_batch_tokens:
        if t.global_batch_tokens % cfg.data.seq_len:
            raise ConfigError(f"trainer.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
                             f"data.seq_len={cfg.data.seq_len}")
        return t.global_batch_tokens // cfg.data.seq_len
    return t.global_batch_size


def batch_geometry(cfg: DictConfig, dp_world: int, *, announce: bool = True) -> BatchGeometry:
    """The step's batch on `dp_world` data-parallel ranks; warns (announce) when it was rounded."""
    requested, mbs = requested_global_batch(cfg), cfg.trainer.micro_batch_size
    t = cfg.trainer
    # global_batch_size always has a value (16 by default), so one given beside global_batch_tokens cannot be told
    # from the default: the one that wins is said when they disagree, rather than refused
    if announce and t.global_batch_tokens and requested != t.global_batch_size:
        log.info("trainer.global_batch_tokens=%d (%d samples of data.seq_len=%d) replaces trainer.global_batch_size=%d",
                 t.global_batch_tokens, requested, cfg.data.seq_len, t.global_batch_size)
    unit = mbs * dp_world  # one micro-batch on every rank
    if requested % unit == 0:
        return BatchGeometry(requested, mbs, requested // unit, requested)
    if not OmegaConf.select(cfg, "trainer.round_global_batch", default=True):
        raise ConfigError(f"global batch {requested} samples is not divisible by micro_batch_size={mbs} x "
                         f"data-parallel ranks={dp_world} (trainer.round_global_batch=true rounds it)")
    accumulation = max(1, round(requested / unit))
    geometry = BatchGeometry(accumulation * unit, mbs, accumulation, requested)
    if announce:
        log.warning("global batch %d samples does not split into micro-batches of %d on %d ranks: using %d "
                    "(%d micro-batch(es) per rank per step); set trainer.global_batch_size or "
                    "trainer.micro_batch_size to choose, or trainer.round_global_batch=false to make this an error",
                    requested, mbs, dp_world, geometry.global_batch, accumulation)
    return geometry
