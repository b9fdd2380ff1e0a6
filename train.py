"""LLaMA pretraining entry point.

    python train.py model=tiny trainer.max_steps=200
    torchrun --nproc_per_node 4 train.py amsp.plan=zero3

Reads top to bottom: distributed init, run directory and config, model, optimizer and schedule,
data, then the loop (micro-batches with gradient accumulation, one optimizer step, a log line).
"""
from __future__ import annotations

import filecmp
import json
import logging
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from amsp import control
from amsp.checkpoint import CheckpointManager
from amsp.compile import compile_seconds
from amsp.errors import (EXIT_FAULT, EXIT_INPUT, FaultError, InputError, RunError, disk_full, disk_full_message,
                         one_line_errors, record_exit_code)
from amsp.exit_gc import skip_shutdown_gc_passes
from amsp.init_from import init_weights_from
from amsp.launch import DistEnv, init_distributed, log_backend_choices
from amsp.metrics import MetricsLogger, StepTimer, resolve_peak
from amsp.metrics.logger import append_row, drop_rows_after, model_parallel_comm_note
from amsp.metrics.plan_config import log_plan, log_switch
from amsp.metrics.wandb_logger import WandbLogger
from amsp.build import describe_node_override, engine_from_config, plan_from_config, topology_from
from amsp.compile_choice import resolve_auto_compile
from amsp.optim import WarmupCosine, lr_floor
from amsp.parallel.joint_startup import joint_plan_for_run, stage_plan
from amsp.parallel.pipeline import check_micro_batches
from amsp.parallel.setup import mesh_from_config, model_parts, pipeline_runner
from amsp.planner import plan_for_run
from amsp.replan_switch import Replanner, plan_after_switch
from amsp.startup_memory import build_or_explain_oom
from amsp.batch_geometry import batch_geometry
from amsp.resilience import Heartbeat, NaNInjector, PreemptionHandler, SkipGuard, TooManySkippedSteps, die_now
from amsp.train_state import load_training_state, save_training_state
from configs.schema import register_configs, to_llama_config
from configs.sweep import gives_run_name, job_run_name, swept_keys
from configs.validate import validate_config
from data.loader import MicroBatchLoader, validation_batches, validation_rounds
from data.pipeline import build_data
from data.resume_check import check_model_before_load, check_resume, check_vocab_before_load, run_identity
from models.llama import flops_per_token

log = logging.getLogger("train")
register_configs()


def setup_logging(level: str, rank: int) -> None:
    # Only rank 0 talks at INFO; other ranks report warnings and errors, tagged with their rank.
    logging.basicConfig(level=getattr(logging, level.upper()) if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)


def pick_device_and_dtype(cfg: DictConfig, denv: DistEnv) -> tuple[torch.device, torch.dtype]:
    want = cfg.trainer.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        # the command asks for what this machine lacks: rerunning it fails the same way (exit 2, no requeue)
        raise InputError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu")
    device = torch.device(want, denv.local_rank) if want == "cuda" else torch.device("cpu")
    # CPUs here run bf16 matmuls at under half the fp32 rate, so CPU defaults to fp32.
    name = cfg.trainer.dtype if cfg.trainer.dtype != "auto" else ("bf16" if want == "cuda" else "fp32")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"trainer.dtype={name!r} is not one of auto|fp32|bf16")
    return device, dtypes[name]


def name_sweep_job(cfg: DictConfig, announce: bool) -> None:
    """A job of a multirun sweep that gives no trainer.run_name gets one of its own (configs/sweep.py)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or gives_run_name(list(hc.overrides.task)):
        return
    task = list(hc.overrides.task)
    cfg.trainer.run_name = job_run_name(str(cfg.trainer.run_name), task, hc.job.override_dirname,
                                        swept_keys(sys.argv[1:]))
    if announce:
        log.info("multirun job %s: trainer.run_name=%s (its own run directory; set trainer.run_name to choose)",
                 hc.job.num, cfg.trainer.run_name)


def resolve_run_dir(cfg: DictConfig) -> pathlib.Path:
    # Derived from the config alone, so every rank agrees without talking.
    return pathlib.Path(cfg.trainer.output_dir) / str(cfg.trainer.run_name)


def set_threads(cfg: DictConfig, denv: DistEnv) -> None:
    n = cfg.trainer.threads or max(1, (os.cpu_count() or 1) // max(1, denv.local_world_size))
    torch.set_num_threads(n)


def require_kernels(model_cfg) -> None:
    """The attention and norm kernels the config names exist here (flash_attn, Transformer Engine), checked
    before anything is measured or built: a missing one is an input error (one line, exit 2), not a
    traceback from inside the planner's compute measurement."""
    from models.llama.backends import resolve_attention, resolve_norm

    try:
        resolve_attention(model_cfg.attention)
        resolve_norm(model_cfg.norm)
    except RuntimeError as e:
        raise InputError(str(e)) from None


def make_wandb(cfg: DictConfig, run_dir: pathlib.Path, rank: int, resume_id: str | None) -> WandbLogger:
    w = cfg.logging.wandb
    return WandbLogger(mode=w.mode, run_dir=run_dir, config=OmegaConf.to_container(cfg, resolve=True), rank=rank,
                       project=w.project, entity=w.entity, name=w.name, tags=list(w.tags), group=w.group,
                       resume_id=resume_id)


def make_metrics(cfg: DictConfig, denv: DistEnv, run_dir: pathlib.Path, device: torch.device,
                 dtype: torch.dtype, tokens_per_step: int, fpt: float, sink: WandbLogger) -> MetricsLogger:
    # Only rank 0 reports MFU, so only it measures (or looks up) the peak.
    cluster_tflops = cfg.cluster.peak_tflops if "cluster" in cfg else None
    peak = resolve_peak(device, dtype, cfg.logging.peak_tflops, cluster_tflops) if denv.is_main else None
    if peak is not None:
        log.info("MFU peak: %.4g TFLOP/s per device (%s)", peak.flops / 1e12, peak.source)
    # cfg.parallel is the layout as run (after a joint plan): its TP/PP bytes are not in the line's count
    if denv.is_main and (note := model_parallel_comm_note(cfg.parallel.tp, cfg.parallel.pp)):
        log.info("%s", note)
    return MetricsLogger(run_dir, rank=denv.rank, world_size=denv.world_size, total_steps=cfg.trainer.max_steps,
                         tokens_per_step=tokens_per_step, flops_per_token=fpt, device=device, peak=peak,
                         sink=sink)


@hydra.main(version_base=None, config_path="configs", config_name="train")
@record  # torchrun's error file for a rank that dies of a bug (inside hydra.main, which would report it first)
def main(cfg: DictConfig) -> None:
    # Known failures end as one line and an exit code that says input (2) or fault (3): amsp/errors.py.
    with one_line_errors(OmegaConf.select(cfg, "logging.level")):
        run(cfg)


def log_startup_time(device: torch.device, started: float, built_s: float, compile_s: float) -> None:
    """Model construction to the end of the first step, once. Its one synchronisation is on the first
    step only (the device runs behind the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total = time.perf_counter() - started
    compiled = f"; torch.compile {compile_s:.1f} s of it, {total - compile_s:.1f} s without" if compile_s else ""
    log.info("startup: %.1f s from model construction to the end of the first step (engine built in %.1f s%s)",
             total, built_s, compiled)


def run(cfg: DictConfig) -> None:
    validate_config(cfg)  # before any process group, file or model state exists
    # trainer.device=cpu on a GPU node: the data plane must be gloo, or CPU tensors would meet NCCL.
    denv = init_distributed(backend="gloo" if cfg.trainer.device == "cpu" else None,
                            timeout_s=cfg.trainer.collective_timeout_s)
    setup_logging(cfg.logging.level, denv.rank)
    log_backend_choices(denv)
    if denv.is_main and (emulated := describe_node_override(cfg.amsp, denv)):
        log.info("%s", emulated)
    set_threads(cfg, denv)
    name_sweep_job(cfg, announce=denv.is_main)
    run_dir = resolve_run_dir(cfg)
    # The run directory's lock first: a second live run into it is refused before it writes anything
    # there (its config.yaml replaced the live run's) or builds a model beside it.
    ckpt = CheckpointManager(run_dir, keep_last=cfg.trainer.keep_last_checkpoints,
                             async_save=cfg.trainer.async_checkpoint, lock=True)
    # A Slurm requeue runs the same command again: trainer.resume=false there would throw away its own progress.
    resume = cfg.trainer.resume or ckpt.requeue_of_recorded_job()
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    unwritable = None
    if denv.is_main:
        try:
            check_writable(run_dir)
        except OSError as e:  # read-only file system, no permission, a file where a folder should be
            where = e.filename or run_dir
            unwritable = FaultError(f"cannot write the run directory {run_dir}: {disk_full_message(e, where)}") \
                if disk_full(e) else InputError(f"cannot write the run directory {run_dir} ({e.strerror or e}): "
                                                f"set trainer.output_dir / trainer.run_name to a writable place")
        else:
            log.info("resolved config:\n%s", resolved)
            log.info("run directory: %s", run_dir.resolve())
            t = cfg.trainer
            log.info("checkpoints: %s, keep the last %d; %s", f"every {t.checkpoint_interval} steps and at the end"
                     if t.checkpoint_interval else "at the end only", t.keep_last_checkpoints,
                     "asynchronous (a background thread writes a snapshot while training goes on)"
                     if t.async_checkpoint else "synchronous (training waits for each save)")
    failed = control.all_reduce_max_int(unwritable.exit_code if unwritable else 0)  # every rank stops, with one code
    if failed:
        raise unwritable or (FaultError if failed == EXIT_FAULT else InputError)(
            f"rank 0 cannot write the run directory {run_dir}")

    device, dtype = pick_device_and_dtype(cfg, denv)
    model_cfg = to_llama_config(cfg.model)
    require_kernels(model_cfg)
    seq_len = cfg.data.seq_len  # <= model.max_seq_len: configs/validate.py
    # model.compile=auto on CUDA: blocks compiled only if one measured block runs faster so (amsp/compile_choice.py);
    # decided before the planners, which price the blocks as they will run.
    cfg = resolve_auto_compile(cfg, denv, device)
    # parallel.auto: the joint planner picks tp, pp, the layer split, the micro-batch size, per-stage
    # recomputation and each stage's AMSP degrees; the run proceeds as if they had been given by hand.
    # The planners' tables go to RUN_DIR/plan.txt with the run's other files, once the start goes ahead
    # (write_run_files): a refused resume, or a start wandb refuses, leaves the directory as it was.
    joint, planned_table = None, None
    if cfg.parallel.auto:
        cfg, joint, planned_table = joint_plan_for_run(cfg, denv, device, None)
    # RUN_DIR/config.yaml, written once the run goes ahead (write_run_files): the config as run, so taken
    # after the joint plan (its tp, pp, layer split, micro-batch size) and model.compile=auto are applied.
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    # Model parallelism (parallel.tp / parallel.pp): the mesh owns every group; the batch splits over the
    # DP groups only (a TP group and a pipeline read the same samples). None: data parallelism alone.
    mesh = mesh_from_config(cfg, denv)
    dp_rank, dp_world = mesh.data_shard(denv.rank) if mesh is not None else (denv.rank, denv.world_size)
    geometry = batch_geometry(cfg, dp_world, announce=denv.is_main)  # rounded to whole micro-batches
    gbs, accum = geometry.global_batch, geometry.accumulation
    mbs = cfg.trainer.micro_batch_size
    if mesh is not None and mesh.pp > 1:  # the schedule's needs of the micro-batch count, before any build
        check_micro_batches(cfg.parallel.schedule, accum, mesh.pp)
    # An explicit plan (a preset, or amsp.p/g/os) needs nothing of the data: its rules are checked here, before
    # the data build (tens of seconds for a corpus and its tokenizer), as is the node size on every rank.
    topology = topology_from(cfg.amsp, denv) if mesh is None else mesh.dp_topology(denv.rank)
    explicit = joint is None and not (cfg.amsp.plan == "auto" and cfg.amsp.p is None)
    plan = plan_from_config(cfg.amsp, topology) if explicit else None  # the partitioner's comes after the data
    # Data next, as soon as the batch is known: a problem with files or the tokenizer surfaces before the
    # partitioner's probes and compute timing (tens of seconds) and before any model state exists.
    data = build_data(cfg.data, seq_len=seq_len, seed=cfg.trainer.seed if cfg.data.seed is None else cfg.data.seed,
                      train_samples=cfg.trainer.max_steps * gbs, model_vocab_size=model_cfg.vocab_size)
    log.info("unigram entropy of the training tokens: %.4f nats (the loss of a model that knows only token "
             "frequencies)", data.unigram_entropy)
    # The sharding plan is chosen (amsp.plan=auto: the partitioner, amsp/planner; probe, ILP, table in
    # RUN_DIR/plan.txt) after the data, which the partitioner sees; an explicit plan was checked above.
    planned, switched = None, None
    if joint is not None:
        plan = stage_plan(joint, mesh, denv.rank)
    elif not explicit:
        planned = plan_for_run(cfg, denv, device, None)
        plan, planned_table = planned.plan, planned.table
        # A resumed run continues on the plan its recheck switched to (RUN_DIR/replan.json), not the prior's.
        switched = control.decided_by_rank0(
            lambda: plan_after_switch(run_dir, topology_from(cfg.amsp, denv), denv.world_size), denv.rank) \
            if resume else None
        if switched is not None:
            if denv.is_main:
                log.info("planner: resuming with plan %s instead of the startup's %s: %s", switched[0], plan,
                         switched[1])
            plan = switched[0]
    # After amsp.planner.recheck_steps steps: measured vs predicted, refit, maybe a better plan (amsp/replan_switch.py).
    replanner = Replanner(cfg, denv, device, planned, plan, run_dir, joint=joint is not None,
                          joint_step_s=joint.step_s if joint is not None else None)
    # Checkpoints carry the config with the tokenizer they were trained with (a copy in the run
    # directory), so an export needs nothing but the run directory.
    tokenizer_copy = run_dir / data.tokenizer.copy_name  # tokenizer.model | tokenizer.json | tokenizer.tiktoken
    resolved = OmegaConf.to_yaml(OmegaConf.merge(cfg, {"data": {"tokenizer": str(tokenizer_copy.resolve())}}),
                                 resolve=True)
    # Pinned batches on CUDA: the engine's copy to the device then does not block the host.
    train_loader = MicroBatchLoader(data.train, gbs, mbs, dp_rank, dp_world, prefetch=cfg.data.prefetch,
                                    pin_device=device)
    check_validation_geometry(data.valid, cfg.trainer.val_samples, mbs, dp_world, announce=denv.is_main)
    warn_no_validation_set(cfg, data.valid, announce=denv.is_main)

    # The AMSP engine builds the model on the meta device and initialises only this rank's shards;
    # the plan is validated (rules named) before anything is allocated.
    # Out of memory here is one line with the planner's prediction for the plan (amsp/startup_memory.py).
    # With model parallelism each build starts from a fresh meta model made tensor-parallel and cut to this
    # rank's stage (amsp/parallel/setup.py); the DeviceMesh DTensor needs is made once (collective).
    device_mesh = mesh.device_mesh(device.type) if mesh is not None and mesh.tp > 1 else None

    def build_engine(p):  # at startup and at a plan switch
        def build():
            parts = None if mesh is None else model_parts(model_cfg, cfg.parallel, mesh, denv.rank, device,
                                                          device_mesh, seq_len=seq_len)
            return engine_from_config(cfg.amsp, cfg.optim, cfg.trainer.dtype, model_cfg, denv, device,
                                      cfg.trainer.seed, plan=p, compile=cfg.model.compile, mesh=mesh, parts=parts)

        return build_or_explain_oom(build, cfg, denv, device, p)

    construction_started, compiled_before = time.perf_counter(), compile_seconds()
    replanner.mark_engine_start()  # the recheck's CPU memory baseline: after the data, before the model
    engine = build_engine(plan)
    engine_built_s = time.perf_counter() - construction_started
    # Pipeline parallelism: the schedule runs a step's micro-batches through this rank's stage(s).
    runner = pipeline_runner(engine, mesh, denv.rank, cfg.parallel, accum, seq_len, mbs)
    dtype = engine.compute_dtype
    n_params = model_cfg.num_params()
    fpt = flops_per_token(model_cfg, seq_len)
    log.info("model %s: %.2fM parameters, %.3g FLOPs/token at seq_len %d; global batch %d samples "
             "(%d micro-batches of %d per rank)", cfg.model.name, n_params / 1e6, fpt, seq_len, gbs, accum, mbs)

    o = cfg.optim
    schedule = WarmupCosine(o.lr, lr_floor(o.lr, o.min_lr, o.min_lr_ratio), o.warmup_steps,
                            o.decay_steps or cfg.trainer.max_steps)
    for warning in schedule.shape_warnings(cfg.trainer.max_steps) if denv.is_main else ():
        log.warning("%s", warning)

    # Resume: the latest checkpoint of this run directory, whatever plan or world size wrote it.
    # A damaged checkpoint falls back to the newest verified older one.
    start_step, skipped_total, wandb_id = 0, 0, None

    def load_checkpoint(path: pathlib.Path) -> dict:
        check_vocab_before_load(path, model_cfg.vocab_size)  # another embedding size cannot load at all
        # Same shapes are not the same model (8 heads of 8 vs 4 of 16): its config.yaml is compared first.
        check_model_before_load(path, model_cfg, list(cfg.trainer.allow_resume_changes), denv.is_main)
        return load_training_state(ckpt, path, engine)

    # A fallback's renames wait for the checks below (finish_fallback): a refused resume leaves the directory as it was.
    loaded = ckpt.load_latest(load_checkpoint, defer_set_aside=True) if resume else None
    latest, meta = loaded if loaded is not None else (None, None)
    # trainer.init_from: pretrained weights in place of the random init, unless this run resumes (amsp/init_from.py).
    init_weights_from(engine, cfg.trainer.init_from, model_cfg, resumed_from=latest, rank=denv.rank)
    if not resume:  # a fresh start: another run's checkpoints here are kept, out of its way
        ckpt.set_aside_all("trainer.resume=false")  # after init_from, which may refuse (or read them)
    if latest is not None:
        start_step, skipped_total, wandb_id = meta["step"], meta.get("skipped_steps", 0), meta.get("wandb_run_id")
        train_loader.load_state_dict({"consumed_samples": meta["consumed_samples"]})
    # What the data position means (seq_len, tokenizer, sources) is recorded with every checkpoint; a
    # resume that changes it is refused unless trainer.allow_resume_changes names it (data/resume_check.py).
    # The sample order's seed and the lr schedule too: another seed reshuffles, another horizon makes the lr jump.
    identity = run_identity(seq_len, data, model_cfg.vocab_size, schedule=schedule,
                            data_seed=cfg.trainer.seed if cfg.data.seed is None else cfg.data.seed)
    if latest is not None:
        consumed = check_resume(meta, identity, list(cfg.trainer.allow_resume_changes), latest,
                                meta["consumed_samples"], denv.is_main, step=start_step)
        needed = consumed + (cfg.trainer.max_steps - start_step) * gbs
        rebuild = needed > len(data.train)  # the converted position lies past the samples built: build more
        if rebuild:
            data = build_data(cfg.data, seq_len=seq_len, seed=cfg.trainer.seed if cfg.data.seed is None else
                              cfg.data.seed, train_samples=needed, model_vocab_size=model_cfg.vocab_size)
            train_loader.source = data.train
        if rebuild or consumed != meta["consumed_samples"]:
            train_loader.load_state_dict({"consumed_samples": consumed})
        # Only now, every check passed: a refused resume has said nothing of resuming and written nothing.
        ckpt.finish_fallback()  # the damaged checkpoints renamed, `latest` at the one loaded
        log.info("resumed from checkpoint %s at step %d (%d samples consumed, written by plan %s on %d ranks%s)",
                 latest, start_step, meta["consumed_samples"], meta.get("plan"), meta.get("world_size"),
                 written_layout(meta))
        if start_step >= cfg.trainer.max_steps:
            log.warning("checkpoint step %d >= trainer.max_steps=%d: nothing to train", start_step,
                        cfg.trainer.max_steps)

    tokens_per_step = gbs * seq_len
    # Rank 0 starts wandb; a failure there (not logged in, no network) stops every rank with its one line.
    wandb_run, problem = None, None
    try:
        with replanner.beside_the_model():  # the wandb client's memory is not the model's (the recheck's CPU peak)
            wandb_run = make_wandb(cfg, run_dir, denv.rank, resume_id=wandb_id)
    except InputError as e:
        problem = str(e)
    problem = control.broadcast_object(problem, src=0) if denv.world_size > 1 else problem
    if problem:
        raise InputError(problem)
    if denv.is_main:  # only now: a start refused by wandb (not logged in, no network) has written nothing here
        write_run_files(run_dir, config_yaml, data.tokenizer.model_file, tokenizer_copy,
                        planned_table)
        if latest is None:  # a fresh start: an earlier run's rows here are not this run's steps
            # replan.json too: an earlier run's plan switch is not this run's (plan_after_switch would resume it)
            set_aside_logs(run_dir, ("metrics.jsonl", "validation.jsonl", "replan.json"))
            ckpt.record_job()  # the Slurm job that starts this run: its requeues resume it, resume=false or not
    # The plan in the run config (degrees, and the planner's prediction) and the planner's ranked table.
    if switched is None:
        log_plan(wandb_run, engine.plan, cfg.amsp.plan, planned)
    else:  # the plan the recheck switched to before this resume, and the startup's choice it replaces
        log_switch(wandb_run, engine.plan, planned.plan, cfg.amsp.plan, switched[2], switched[1])
    metrics = make_metrics(cfg, denv, run_dir, device, dtype, tokens_per_step, fpt, wandb_run)
    if latest is not None:  # elapsed_s continues from the checkpoint's instead of restarting at 0
        metrics.restore_checkpoint_state(meta, latest)
    if latest is not None and denv.is_main:  # rows of steps this run logs again would appear twice
        metrics.drop_after(start_step)
        drop_rows_after(run_dir / "validation.jsonl", start_step)
    timer = StepTimer(device)  # CUDA: events on the current stream, one wait per step
    preemption = PreemptionHandler()
    # Liveness: a thread per rank bumps a counter in the rendezvous store; a rank whose counter stops
    # is named when a collective fails (or by the watchdog, wherever this rank is blocked): exit 3.
    heartbeat = Heartbeat(denv.rank, denv.world_size, cfg.trainer.collective_timeout_s,
                          clock_skew_s=cfg.debug.clock_skew_s if denv.rank == cfg.debug.clock_skew_rank else 0.0)
    skips = SkipGuard(cfg.trainer.max_consecutive_skips, total=skipped_total)
    nan_injector = NaNInjector(engine.model, list(cfg.debug.nan_loss_at_steps))

    def save(step: int, final: bool = False) -> None:  # final: NaN/Inf weights are a FaultError
        meta = {"consumed_samples": train_loader.state_dict()["consumed_samples"], "skipped_steps": skips.total,
                "consecutive_skips": skips.consecutive,  # pruning keeps the checkpoint before a run of skips
                "wandb_run_id": wandb_run.run_id, "plan": str(engine.plan), "world_size": denv.world_size,
                "tp": 1 if mesh is None else mesh.tp, "pp": 1 if mesh is None else mesh.pp, **identity,
                **metrics.checkpoint_state()}
        save_training_state(ckpt, engine, step, meta, resolved, final=final)

    def validate(step: int) -> None:
        if data.valid is None or cfg.trainer.val_samples <= 0:
            return
        loss = evaluate(runner or engine, validation_batches(data.valid, mbs, dp_rank, dp_world,
                                                             cfg.trainer.val_samples, pin_device=device))
        if denv.is_main:
            log.info("step %d: validation loss %.4f", step, loss)
            append_row(run_dir / "validation.jsonl", json.dumps({"step": step, "val_loss": loss}) + "\n")
            wandb_run.log_metrics({"val/loss": loss}, step=step)

    step, signum = start_step, 0
    # The logged loss is the mean over the steps since the last log line (as the times and tokens/s beside
    # it), skipped steps excluded; summed on the device, reduced over ranks once per log line.
    interval_loss, interval_held = torch.zeros((), device=device), 0
    try:
        for step in range(start_step + 1, cfg.trainer.max_steps + 1):  # 1-based: step N is the Nth update
            heartbeat.beat(step)
            nan_injector.current = step
            timer.start_step()
            lr = schedule(step - 1)
            loss_sum, xs, ys = torch.zeros((), device=device), [], []
            for micro in range(accum):
                x, y = next(train_loader)
                timer.lap("data_wait")
                if step == cfg.debug.die_at_step and denv.rank == cfg.debug.die_rank and micro == accum - 1:
                    die_now(f"fault injection: rank {denv.rank} exits abruptly in step {step}", code=137)
                if step == cfg.debug.stop_at_step and denv.rank == cfg.debug.stop_rank and micro == accum - 1:
                    log.warning("fault injection: rank %d stops itself (SIGSTOP) in step %d", denv.rank, step)
                    os.kill(os.getpid(), signal.SIGSTOP)
                if runner is None:
                    loss_sum += engine.forward_backward(x, y, micro, accum)
                    timer.lap("forward_backward")
                else:
                    xs.append(x)
                    ys.append(y)
            losses_held = accum  # micro-batch losses this rank holds (a pipeline: its last stage only)
            if runner is not None:
                total, losses_held = runner.train_step(xs, ys)
                loss_sum += total
                timer.lap("forward_backward")
            result = engine.step(lr)  # gradient sync, sharded AdamW with global-norm clipping, spread
            timer.lap("optimizer")
            if step == start_step + 1:  # the "construction to first step", compilation named apart
                log_startup_time(device, construction_started, engine_built_s, compile_seconds() - compiled_before)
            skips.record(result.skipped, step, result.grad_norm)
            if not result.skipped:
                interval_loss += loss_sum
                interval_held += losses_held

            timings, comm = timer.end_step(), engine.comm_stats()
            metrics.record_step(timings, comm=comm.as_metrics())
            replanner.observe(timings, comm.exposed_s)
            if step % cfg.trainer.log_interval == 0 or step == cfg.trainer.max_steps:
                # The mean over ranks is needed only here: one control-plane value per log step.
                total, held = control.all_reduce_sum_floats([interval_loss.item(), float(interval_held)])
                loss = total / held if held else float("nan")  # every step of the interval was skipped
                interval_loss.zero_()
                interval_held = 0
                metrics.log(step, loss=loss, lr=lr, grad_norm=result.grad_norm, skipped_steps=skips.total,
                            tokens_seen=train_loader.state_dict()["consumed_samples"] * seq_len)
            if skips.exhausted:
                save(step)  # skipped updates changed nothing: this is the last good state
                ckpt.wait()
                raise TooManySkippedSteps(
                    f"{skips.consecutive} consecutive steps had a non-finite loss or gradient (last: step {step}); "
                    f"stopping. The last good state is saved in {ckpt.root}; lower optim.lr or check the data.")
            signum = preemption.agreed_signal()
            if signum:
                log.info("%s received %s: saving checkpoint at step %d and exiting%s", preemption.describe_receivers(),
                         signal.Signals(signum).name, step,
                         " (Ctrl-C again: exit at once, without it)" if signum == signal.SIGINT else "")
                save(step)
                break
            if cfg.trainer.checkpoint_interval and step % cfg.trainer.checkpoint_interval == 0 \
                    and step != cfg.trainer.max_steps:
                save(step)
            if replanner.switch_due(step):  # a plan predicted >= 5% faster: through a checkpoint, as a resume
                old_plan = engine.plan
                engine = replanner.switch(engine, step, save, ckpt, build=build_engine,
                                          load=lambda path, e: load_training_state(ckpt, path, e))
                if engine.plan is not old_plan:
                    log_switch(wandb_run, engine.plan, old_plan, cfg.amsp.plan, step, replanner.reason)
                nan_injector = NaNInjector(engine.model, list(cfg.debug.nan_loss_at_steps))
                runner = pipeline_runner(engine, mesh, denv.rank, cfg.parallel, accum, seq_len, mbs)
            if cfg.trainer.val_interval and step % cfg.trainer.val_interval == 0:
                validate(step)
        else:
            if step > start_step:
                save(step, final=True)
            # The final validation, unless the loop just ran it for this step or nothing was trained
            # (a rerun of a finished run: its validation was written when it finished).
            if step > start_step and not (cfg.trainer.val_interval and step % cfg.trainer.val_interval == 0):
                validate(step)
        ckpt.wait()
    except (TooManySkippedSteps, RunError, KeyboardInterrupt):
        raise
    except Exception as e:  # a collective failed or timed out: a peer died or hangs
        if denv.world_size > 1:
            heartbeat.fail(step, e)  # names the rank(s) whose heartbeat stopped; exits 3 (or 1: a bug) at once
        raise
    finally:
        # On purpose: peers will not blame this rank. close() also waits for the heartbeat's I/O thread to leave
        # the store: a daemon thread inside a store call at interpreter exit aborts the process (SIGABRT).
        heartbeat.close("left" if sys.exc_info()[0] else "done")
        train_loader.close()  # the prefetch thread, likewise: no daemon thread in torch code at exit
        preemption.restore()

    wandb_run.finish()
    if denv.is_main and cfg.logging.plot:
        # imported here: matplotlib costs every rank ~0.6 s of start-up CPU, and only rank 0 plots
        from amsp.metrics.plot import plot_run

        log.info("metrics plot: %s", plot_run(run_dir))
    if dist.is_initialized():
        dist.destroy_process_group()
    if signum:  # stopped by a signal, checkpoint written: submitit's own handler (if any) requeues the job
        preemption.hand_over(signum)


def check_writable(run_dir: pathlib.Path) -> None:
    """Make the run directory and a file in it, removed at once: an unwritable place is named before any
    work, while the run's own files are written only once it goes ahead (write_run_files)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
        pass


def write_run_files(run_dir: pathlib.Path, config_yaml: str, tokenizer_file, tokenizer_copy: pathlib.Path,
                    plan_table: str | None) -> None:
    """Rank 0, once the start goes ahead (a resume's checks passed, wandb started): the run's config, the
    planner's table (None: no planner ran), and the tokenizer copy that checkpoints' exports use (copied only
    when it differs). Each file is written beside its place and renamed onto it: a write that fails (a full
    disk) leaves the earlier file whole, where writing in place left a 0-byte config.yaml."""

    def replace(path: pathlib.Path, write) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
        except OSError as e:
            if disk_full(e):  # a failed write() names no file: name the one being written
                raise FaultError(f"cannot write the run's files: {disk_full_message(e, path)}") from None
            raise
        finally:
            tmp.unlink(missing_ok=True)

    replace(run_dir / "config.yaml", lambda p: p.write_text(config_yaml))
    if plan_table is not None:
        replace(run_dir / "plan.txt", lambda p: p.write_text(plan_table + "\n"))
    if not (tokenizer_copy.exists() and filecmp.cmp(tokenizer_file, tokenizer_copy, shallow=False)):
        replace(tokenizer_copy, lambda p: shutil.copyfile(tokenizer_file, p))


def set_aside_logs(run_dir: pathlib.Path, names: tuple[str, ...]) -> None:
    """Rename an earlier run's logs to NAME.<UTC time>.old (kept, never deleted), so a fresh start's rows are
    not appended to them (a resume trims them to its checkpoint instead: drop_after)."""
    old = [run_dir / n for n in names if (run_dir / n).exists()]
    if not old:
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for path in old:
        dest, k = path.with_name(f"{path.name}.{stamp}.old"), 1
        while dest.exists():  # two fresh starts within a second
            k += 1
            dest = path.with_name(f"{path.name}.{stamp}.{k}.old")
        os.replace(path, dest)
        moved.append(f"{path.name} -> {dest.name}")
    log.warning("fresh start: the earlier run's logs in %s are kept aside: %s", run_dir, ", ".join(moved))


def warn_no_validation_set(cfg: DictConfig, valid, announce: bool) -> None:
    """data.valid_samples=0 builds no validation set, so trainer.val_samples has nothing to evaluate: said as
    data/pipeline.py says it for an empty validation split, not left to look like validation runs."""
    if announce and valid is None and cfg.trainer.val_samples > 0 and cfg.data.valid_samples == 0:
        log.warning("validation is off: data.valid_samples=0 builds no validation set (trainer.val_samples=%d "
                    "asks for a pass; set data.valid_samples > 0, or trainer.val_samples=0)", cfg.trainer.val_samples)


def check_validation_geometry(valid, val_samples: int, mbs: int, dp_world: int, announce: bool) -> None:
    """Validation covers whole rounds of micro_batch_size x data-parallel ranks: a request smaller than one
    round would evaluate nothing and log NaN every time, so it is an input error before the build."""
    if valid is None or val_samples <= 0:
        return
    rounds, per_round = validation_rounds(len(valid), mbs, dp_world, val_samples)
    if rounds == 0:
        if len(valid) < per_round:
            fix = (f"the validation set has {len(valid)} samples: raise data.valid_samples (and "
                   f"trainer.val_samples) to >= {per_round}, lower the micro-batch size,")
        else:
            fix = f"trainer.val_samples={val_samples} is less: set trainer.val_samples >= {per_round}"
        raise InputError(f"validation runs whole rounds of trainer.micro_batch_size x data-parallel ranks = {mbs} x "
                         f"{dp_world} = {per_round} samples and {fix} or set trainer.val_samples=0 to skip it")
    if announce:
        used = rounds * per_round
        left = min(val_samples, len(valid)) - used
        log.info("validation: %d samples per pass (%d rounds of %d)%s", used, rounds, per_round,
                 f", {left} requested samples left out (not a whole round)" if left else "")


@torch.no_grad()
def evaluate(engine, batches) -> float:
    """Mean loss over this rank's validation batches, averaged over ranks (forward only). `engine`: the
    AMSP engine (it copies each batch to its device), or a pipeline runner (the losses are on the last
    stage's ranks). The losses are summed on the device and read once, not once per batch."""
    total, count = 0.0, 0
    if hasattr(engine, "evaluate_batches"):  # a pipeline runner: micro-batches go through the schedule
        total, count = engine.evaluate_batches(batches)
    else:
        on_device = None
        for x, y in batches:
            loss = engine.evaluate(x, y)
            on_device = loss if on_device is None else on_device + loss
            count += 1
        total = 0.0 if on_device is None else float(on_device.item())
    total, count = control.all_reduce_sum_floats([total, count])  # CPU values: the control plane
    return total / count if count > 0 else float("nan")


def written_layout(meta: dict) -> str:
    """', tp 2 pp 2' for a checkpoint written under model parallelism (the plan's degrees are then those of
    each rank's data-parallel group); '' otherwise and for checkpoints from before the keys existed."""
    tp, pp = int(meta.get("tp", 1)), int(meta.get("pp", 1))
    return f", tp {tp} pp {pp}: the plan is each stage's data-parallel group's" if tp * pp > 1 else ""


def precheck_overrides(args: list[str]) -> None:
    """Compose the config once with the command line's overrides before Hydra runs the job, so a
    mistyped key, a wrongly typed value or an unknown preset ends as one line with the input exit
    code (2) instead of Hydra's multi-line report and exit 1. Command lines with Hydra's own
    flags or hydra.* / hydra/ overrides (sweeps, launchers) are left to Hydra."""
    if any(a.startswith("-") or a.lstrip("+~").startswith("hydra") for a in args):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(pathlib.Path(__file__).resolve().parent / "configs"),
                                   version_base=None):
            compose(config_name="train", overrides=args)
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if e.__cause__ is not None and str(e.__cause__) not in str(e) else None
        text = " ".join(f"{e} {cause or ''}".split())
        rank = os.environ.get("RANK")
        if rank in (None, "0"):  # the same line on every rank; rank 0's says it (rank-0 logging, as elsewhere)
            sys.stderr.write(f"config error: {text}\n")
        record_exit_code(EXIT_INPUT)
        sys.exit(EXIT_INPUT)


if __name__ == "__main__":
    skip_shutdown_gc_passes()
    precheck_overrides(sys.argv[1:])
    main()
