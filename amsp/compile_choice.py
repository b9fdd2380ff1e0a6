"""model.compile=auto on CUDA: the transformer blocks are compiled only where that is measured to win.

Compiling is not free (tens of seconds at startup on a cold cache, recompilation when a shape changes)
and it does not always win: on one H100 at the GPU-path issue's shape (BENCHMARKS.md, "GPU path on one
H100") compiled blocks ran at the eager blocks' speed (41,473 against 41,554 tokens/s), the heavy ops
of a block being single kernels already (cuDNN attention, the fused RMSNorm / SwiGLU / loss). So before
planning, rank 0 times one block's forward + backward at the run's micro-batch shape and dtype, eager
and compiled, and the blocks are compiled only when that is at least MIN_GAIN faster; every rank takes
rank 0's choice (amsp.control). The timings and the choice are logged and cached beside the compute
profiles (same key), so a restarted job does not compile a block again to decide.

Where nothing is measured: on CPU auto stays off (compiling a block takes about a minute on a small
machine, and CPU runs are short tries and tests), and with parallel.tp / parallel.pp named > 1 it stays
off (amsp/build.py compiles no model-parallel blocks). A choice of "on" leaves model.compile at auto
(which compiles only without model parallelism, so the joint planner may still pick tp or pp > 1); a
choice of "off" sets it to off.
"""
from __future__ import annotations

import logging
import math
import pathlib
from dataclasses import asdict, dataclass

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

# Compiled blocks are kept only this much faster than eager ones: on a tie, eager blocks start sooner,
# never recompile and keep the eager kernels' memory accounting.
MIN_GAIN = 0.03


@dataclass(frozen=True)
class CompileChoice:
    eager_s: float  # one block, forward + backward, one micro-batch at the run's shape
    compiled_s: float  # inf: compiling the block failed (`failure` says how)
    source: str  # "measured on <device>" or "cache PATH (measured on <device>)"
    failure: str | None = None

    @property
    def compile(self) -> bool:
        return compiled_wins(self.eager_s, self.compiled_s)

    def describe(self) -> str:
        if self.failure is not None:
            return (f"compiling one block failed ({self.failure}): eager blocks (one block forward + backward "
                    f"{self.eager_s * 1e3:.2f} ms; {self.source})")
        gain = 1 - self.compiled_s / self.eager_s if self.eager_s > 0 else 0.0
        return (f"one block forward + backward {self.eager_s * 1e3:.2f} ms eager, {self.compiled_s * 1e3:.2f} ms "
                f"compiled ({gain:+.1%}; compiled is kept at >= {MIN_GAIN:.0%} faster): "
                f"{'compiled' if self.compile else 'eager'} blocks ({self.source})")


def compiled_wins(eager_s: float, compiled_s: float) -> bool:
    return compiled_s <= eager_s * (1 - MIN_GAIN)


def block_step_seconds(model_cfg, seq_len: int, micro_batch: int, dtype_name: str, device, compiled: bool,
                       repeats: int = 5) -> float:
    """Median seconds of one block's forward + backward, as a training step runs it (autograd on, a
    fresh graph each call); a compiled block is compiled by its first call, outside the timing."""
    from amsp.planner.compute_profile import _sync, median_time, one_block_inputs

    model, _, x, cos, sin, grad = one_block_inputs(model_cfg, seq_len, micro_batch, dtype_name, device, compiled)
    block = model.layers[0]

    def step():
        block(x, cos, sin).backward(grad)

    step()  # compilation (compiled) or allocation, outside median_time's warm-up that sizes its samples
    _sync(device)
    return median_time(step, device, repeats)


def measure_choice(model_cfg, seq_len: int, micro_batch: int, dtype_name: str, device,
                   cache_dir: pathlib.Path | None = None, use_cache: bool = True) -> CompileChoice:
    """Eager against compiled for one block on this process's device (single process), cached."""
    import torch

    from amsp.planner.cache_file import read_shared, write_atomic
    from amsp.planner.compute_profile import cache_key, default_cache_dir, device_name

    device = torch.device(device)
    key = cache_key(model_cfg, seq_len, micro_batch, dtype_name, "none", device, 1, None)
    path = (cache_dir or default_cache_dir()) / f"compile-choice-{key}.json"
    got = read_shared(path, "choice", use_cache, 0, False, "compile choice")
    if got is not None:
        try:
            return cached_choice(got, path)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("model.compile=auto: cached choice %s unusable (%s); measuring again", path, e)
    log.info("model.compile=auto: timing one block (dim %d, micro-batch %d x %d, %s) forward + backward on %s, "
             "eager and compiled", model_cfg.dim, micro_batch, seq_len, dtype_name, device_name(device))
    eager = block_step_seconds(model_cfg, seq_len, micro_batch, dtype_name, device, compiled=False)
    where = f"measured on {device_name(device)}"
    try:
        compiled = block_step_seconds(model_cfg, seq_len, micro_batch, dtype_name, device, compiled=True)
    except Exception as e:  # noqa: BLE001 - inductor, triton or a graph break: eager is what runs; not cached,
        # so the next start tries again (a missing compiler may be installed by then)
        log.warning("model.compile=auto: compiling one block failed, so the blocks run eagerly: %s: %s",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return CompileChoice(eager, math.inf, where, failure=f"{type(e).__name__}")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the one-block models are gone before the engine allocates
    choice = CompileChoice(eager, compiled, where)
    write_atomic(path, {"key": key, "choice": asdict(choice)})
    return choice


def cached_choice(got: dict, path: pathlib.Path) -> CompileChoice:
    times = [got["eager_s"], got["compiled_s"]]
    if not all(isinstance(t, (int, float)) and t > 0 for t in times):
        raise ValueError(f"timings must be positive seconds, got {times}")
    return CompileChoice(*times, f"cache {path} ({got['source']})")


def resolve_auto_compile(cfg: DictConfig, denv, device) -> DictConfig:
    """cfg with model.compile decided for model.compile=auto on CUDA (rank 0 measures, every rank gets
    its choice; collective when the world has several ranks); any other setting, device or a named
    tp / pp > 1: cfg unchanged."""
    import torch

    from amsp import control
    from amsp.planner.from_config import planner_config
    from amsp.planner.startup import timing_dtype
    from configs.schema import to_llama_config

    device = torch.device(device)
    tp, pp = (int(OmegaConf.select(cfg, f"parallel.{k}", default=1)) for k in ("tp", "pp"))
    if cfg.model.compile != "auto" or device.type != "cuda" or tp * pp > 1:
        return cfg
    if OmegaConf.select(cfg, "amsp.fuse_wgrad") is True:  # nothing to measure: blocks stay eager with it
        from amsp.wgrad_fusion import COMPILE_OFF_WITH_FUSION

        log.info("model.compile=auto: %s", COMPILE_OFF_WITH_FUSION)
        return OmegaConf.merge(cfg, {"model": {"compile": "off"}})
    p = planner_config(cfg)
    model = to_llama_config(cfg.model)

    def decide():
        choice = measure_choice(model, cfg.data.seq_len, cfg.trainer.micro_batch_size, timing_dtype(cfg, device),
                                device, pathlib.Path(p.cache_dir) if p.cache_dir else None, p.probe_cache)
        log.info("model.compile=auto: %s", choice.describe())
        return choice.compile

    compile_blocks = control.decided_by_rank0(decide, denv.rank) if denv.world_size > 1 else decide()
    return cfg if compile_blocks else OmegaConf.merge(cfg, {"model": {"compile": "off"}})
