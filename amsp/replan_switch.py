"""Re-planning during training (amsp.planner.recheck_steps, amsp.planner.replan): measure, refit,
decide on rank 0, and swap the engine for the new plan at the next checkpoint.

After `recheck_steps` steps of this process the run compares the median step time (the process's first
step left out), the median exposed communication (amsp.collectives' waits) and the peak memory with the
planner's prediction for the running plan, logs both and the error, refits the cost model's constants
(amsp/planner/replan.py) and re-solves. When the startup did not probe the links, the recheck times them
first (amsp.planner.recheck_probe): one communication scale fitted to a step time keeps the prior's
ratio between intra- and inter-node links, which may be what is wrong. The measurements are the largest
over the ranks (the slowest rank sets the step); rank 0 decides and broadcasts (amsp.control), so every
rank agrees. With replan=true and a plan the planner chose, a plan predicted >= 5% faster replaces it at
the next checkpoint: the checkpoint is written, the engine is rebuilt with the new plan and loads it,
the same path as a resume (checkpoints reshard across plans). RUN_DIR/replan.json records the old and
new plans, the predicted and measured numbers and the refit. A plan the user named is never replaced:
the recheck reports only. One recheck per process: a resumed run rechecks again.
"""
from __future__ import annotations

import contextlib
import json
import logging
import pathlib
from dataclasses import asdict
from typing import Callable

import torch
from omegaconf import OmegaConf

from amsp import control
from amsp.metrics.memory import anon_peak_bytes, anon_rss_bytes, release_freed_heap
from amsp.planner import replan as rp
from amsp.planner.allocator import margin_for

log = logging.getLogger(__name__)
_GIB = 2**30


class Replanner:
    """One recheck per process; rank 0 decides, every rank follows."""

    def __init__(self, cfg, denv, device: torch.device, planned, plan, run_dir: pathlib.Path, joint: bool = False,
                 joint_step_s: float | None = None):
        p = OmegaConf.select(cfg, "amsp.planner")
        self.recheck_steps = int(p.recheck_steps)
        self.replan = bool(p.replan)
        self.cfg, self.denv, self.device, self.run_dir = cfg, denv, torch.device(device), run_dir
        self.planned = planned  # startup.PlanOutcome when the planner chose; None: the user named the plan
        self.joint = joint  # a stage's share of the joint planner's plan (parallel.auto): reported, never switched
        self.joint_step_s = joint_step_s  # the joint planner's predicted step (its JointPlan.step_s)
        self.user_named = planned is None and not joint
        self.plan = plan
        # On CPU the peak is the process's anonymous memory above what it held just before the engine was
        # built (mark_engine_start): the runtime, the data pipeline and its loader are not the model's.
        self.baseline_bytes = 0
        self.mark_engine_start()  # until train.py marks the engine's start: what is held now
        self.step_times: list[float] = []
        self.exposed: list[float] = []
        self.done = False
        self.pending = None  # the plan to switch to at the next checkpoint
        self.reason = None  # why (the recheck's decision), for the run config after the switch

    @property
    def enabled(self) -> bool:
        return self.recheck_steps > 0

    def mark_engine_start(self) -> None:
        """Called just before the first engine is built: the CPU baseline the measured peak is taken above."""
        if self.device.type == "cpu":
            release_freed_heap()  # what the startup freed is not the runtime's (memory.release_freed_heap)
            self.baseline_bytes = anon_rss_bytes()

    @contextlib.contextmanager
    def beside_the_model(self):
        """Memory allocated inside this block after the engine's start (the wandb client, started once the
        checkpoint has told its run id) is the runtime's: on CPU it joins the baseline."""
        before = anon_rss_bytes() if self.device.type == "cpu" else 0
        try:
            yield
        finally:
            if self.device.type == "cpu":
                self.baseline_bytes += max(0, anon_rss_bytes() - before)

    # ---- per step ----
    def observe(self, timings: dict, comm_exposed_s: float) -> None:
        """Collective on the step that fills the window (every rank calls it every step)."""
        if not self.enabled or self.done:
            return
        self.step_times.append(float(timings["step"]))
        self.exposed.append(float(comm_exposed_s))
        if len(self.step_times) >= self.recheck_steps + 1:  # + the first step, which is left out
            self.done = True
            self.recheck()

    def recheck(self) -> None:
        probed = self._probe_links()  # collective, before rank 0 decides
        step_s = rp.window_median(self.step_times)
        exposed_s = rp.window_median(self.exposed)
        peak, held = self._peaks()
        if self.denv.world_size > 1:
            step_s, exposed_s, peak, held = control.all_reduce_max_floats([step_s, exposed_s, float(peak), float(held)])
        measured = rp.Measured(step_s, exposed_s, float(peak), len(self.step_times) - 1, float(held))
        record = self._decide(measured, probed) if self.denv.rank == 0 else None
        if self.denv.world_size > 1:
            record = control.broadcast_object(record, src=0)
        if "error" in record:
            log.warning("planner recheck failed on rank 0: %s; training goes on with plan %s", record["error"],
                        self.plan)
            return
        if record["switch"]:
            self.pending = record["new_plan_object"]
            self.reason = record["reason"]

    def _peaks(self) -> tuple[float, float]:
        """(tensor peak, peak the device held) since the last reset: on CUDA the caching allocator's
        allocated and reserved peaks; on CPU both the anonymous peak above the engine's start, glibc's
        retained free blocks included (the process holds them)."""
        if self.device.type == "cuda":
            d = self.device
            return float(torch.cuda.max_memory_allocated(d)), float(torch.cuda.max_memory_reserved(d))
        peak = float(max(0, anon_peak_bytes() - self.baseline_bytes))
        return peak, peak

    @staticmethod
    def _allocator_note(measured: rp.Measured) -> str:
        """CUDA: the caching allocator's reserved peak beside the tensors' (CPU: the peak is what the process
        held, glibc's kept free blocks included; what part of it they were at the peak is not knowable)."""
        if measured.held_bytes in (None, measured.peak_bytes):
            return ""
        return f", {measured.held_bytes / _GIB:.3f} GiB reserved by the caching allocator"

    def _probe_links(self):
        """The collective probe's (points, source) when the links were never measured this run (startup
        probe off) and amsp.planner.recheck_probe is on; None otherwise. Collective: every rank decides
        alike from the config and the world size."""
        from amsp.planner.startup import ranks_per_node

        p = OmegaConf.select(self.cfg, "amsp.planner")
        if p.probe or not p.recheck_probe or self.user_named or self.joint or self.denv.world_size < 2:
            return None
        from amsp.planner.probe import probe_points, probe_sizes
        from amsp.topology import Topology

        topo = Topology(self.denv.world_size, ranks_per_node(self.cfg, self.denv.local_world_size))
        if self.denv.rank == 0:
            log.info("planner recheck: timing the links (amsp.planner.probe=false at startup; "
                     "amsp.planner.recheck_probe=true)")
        return probe_points(topo, self.denv.rank, self.device, pathlib.Path(p.cache_dir) if p.cache_dir else None,
                            p.probe_cache, probe_sizes(p.probe_max_mib * 2**20), p.probe_budget_s)

    def _decide(self, measured: rp.Measured, probed=None) -> dict:
        try:
            return self._decide_or_raise(measured, probed)
        except Exception as e:  # noqa: BLE001 - reported; the other ranks wait on rank 0's answer, and the run
            # must not die (or hang) of an advisory recheck
            return {"error": f"{type(e).__name__}: {e}"}

    def _decide_or_raise(self, measured: rp.Measured, probed=None) -> dict:
        if self.joint:
            return self._joint_report(measured)
        from amsp.planner.cost_model import CostModel
        from amsp.planner.probe import apply_points
        from amsp.planner.solve import plan_cluster
        from amsp.startup_memory import planner_inputs

        workload, cluster, options = planner_inputs(self.cfg, self.denv, self.device,
                                                    getattr(self.planned, "cluster", None),
                                                    getattr(self.planned, "options", None))
        prior = CostModel(workload, cluster, options).evaluate(self.plan)
        if probed is not None:  # the links as measured now; the refit then scales what is left
            cluster = apply_points(cluster, *probed)
            log.info("planner recheck: links measured (%s):\n%s", probed[1], cluster.describe())
        fit = rp.refit(workload, cluster, options, self.plan, measured)
        cluster2, options2 = rp.refitted_inputs(cluster, options, fit)
        current = CostModel(workload, cluster2, options2).evaluate(self.plan)
        best = plan_cluster(workload, cluster2, options2, top_k=1, with_presets=False).chosen
        decision = rp.decide(current, best, self.user_named, joint=self.joint,
                             min_gain=float(self.cfg.amsp.planner.replan_min_gain))
        switch = decision.switch and self.replan
        why = decision.reason if decision.switch == switch else (
            f"{decision.reason}, but amsp.planner.replan=false: report only")
        err_t = rp.relative_error(prior.step_time_s, measured.step_s)
        err_m = rp.relative_error(prior.memory_total - prior.memory.get("reserved", 0), measured.peak_bytes)
        log.info("planner recheck after %d steps: step time measured %.4f s, predicted %.4f s (error %s); exposed "
                 "communication measured %.4f s, predicted %.4f s; peak memory measured %.3f GiB, predicted %.3f GiB "
                 "of tensors (error %s)%s; refit: compute x%.3g, communication x%.3g, allocator margin %.0f%% -> "
                 "%.0f%%",
                 measured.steps, measured.step_s, prior.step_time_s, _pct(err_t), measured.exposed_comm_s,
                 rp.comm_exposed_s(prior), measured.peak_bytes / _GIB,
                 (prior.memory_total - prior.memory.get("reserved", 0)) / _GIB, _pct(err_m),
                 self._allocator_note(measured), fit.compute_scale,
                 fit.comm_scale, 100 * margin_for(options.memory_margin, cluster.device), 100 * options2.memory_margin)
        removed, removed_probe = _forget_stale_caches(options, cluster, fit)
        log.info("planner recheck: %s; refitted prediction %.4f s for %s, %.4f s for %s -> %s", why,
                 current.step_time_s, current.plan, best.step_time_s, best.plan,
                 f"switching to {best.plan} at the next checkpoint" if switch else f"keeping {self.plan}")
        record = {"switch": switch, "reason": why, "user_named": self.user_named, "replan": self.replan,
                  "old_plan": str(self.plan), "new_plan": str(best.plan) if switch else None,
                  "measured": asdict(measured),
                  "predicted_prior": _numbers(prior), "predicted_refit": _numbers(current),
                  "best_refit": _numbers(best), "step_time_error": err_t, "memory_error": err_m,
                  "refit": asdict(fit), "links_probed_at_recheck": probed is not None,
                  "stale_compute_profile_removed": removed, "stale_probe_removed": removed_probe}
        self._write(record)
        return {**record, "new_plan_object": best.plan if switch else None}

    def _joint_report(self, measured: rp.Measured) -> dict:
        """A joint plan (parallel.auto) is compared with the joint planner's own prediction (the winner's
        JointPlan.step_s): the data-parallel cost model prices another workload (one
        stage's share, its own compute and link model), so its error and refit were meaningless (-48.8%,
        communication x28) and the refit cleared valid caches. No refit, no replan: the joint plan is never
        switched (rp.decide), and re-pricing it needs the joint search."""
        predicted = self.joint_step_s
        err_t = rp.relative_error(predicted, measured.step_s) if predicted is not None else None
        log.info("planner recheck after %d steps (joint plan, parallel.auto): step time measured %.4f s, the joint "
                 "planner's table predicted %s (error %s); no refit and no replan for a joint plan",
                 measured.steps, measured.step_s, "n/a" if predicted is None else f"{predicted:.4f} s", _pct(err_t))
        record = {"switch": False, "reason": "joint plan: compared with the joint planner's table, no refit",
                  "user_named": False, "replan": self.replan, "joint": True, "old_plan": str(self.plan),
                  "new_plan": None, "measured": asdict(measured), "predicted_joint_step_s": predicted,
                  "step_time_error": err_t}
        self._write(record)
        return {**record, "new_plan_object": None}

    def _write(self, record: dict) -> None:
        path = self.run_dir / "replan.json"
        history = json.loads(path.read_text()) if path.exists() else []
        history.append(record)
        path.write_text(json.dumps(history, indent=2, default=str) + "\n")

    # ---- the switch ----
    def switch_due(self, step: int) -> bool:
        """A pending switch happens at the next checkpoint (every step when checkpoints are off), never
        after the last step."""
        interval = self.cfg.trainer.checkpoint_interval
        return self.pending is not None and step != self.cfg.trainer.max_steps and (
            not interval or step % interval == 0)

    def switch(self, engine, step: int, save: Callable[[int], None], ckpt, build: Callable, load: Callable):
        """Checkpoint (unless the loop just wrote one at this step), rebuild with the pending plan,
        load the checkpoint. Collective. Returns the new engine."""
        interval = self.cfg.trainer.checkpoint_interval
        if not (interval and step % interval == 0):
            save(step)
        ckpt.wait()
        path = ckpt.root / ckpt.step_dir_name(step)
        new_plan, self.pending = self.pending, None
        # Rank 0 publishes the checkpoint (its writer's rename; with trainer.async_checkpoint in a thread that
        # only rank 0's wait() joins), so it alone can tell whether it exists; every rank follows its answer.
        # Each rank looking for itself, another rank could look before the rename, keep the old engine, and
        # the two halves of the world hang in different collectives.
        published = control.decided_by_rank0(lambda: (path / "meta.json").exists(), self.denv.rank)
        if not published:  # a pretend world or non-finite weights wrote nothing
            log.warning("planner: no checkpoint at step %d to switch plans through; keeping %s", step, engine.plan)
            return engine
        log.info("planner: switching from %s to %s at step %d through checkpoint %s", engine.plan, new_plan, step,
                 path)
        old = engine.plan
        # The old engine's memory goes back before the new one is allocated (the caller, its pipeline
        # runner and the NaN injector still reference it): both at once would need two sets of model
        # states, and a plan near the device's memory would fail at the switch. The checkpoint just
        # written holds everything, so a failed build loses nothing.
        engine.release()
        del engine
        try:
            new = build(new_plan)
        except Exception as e:
            raise RuntimeError(f"planner: building the engine for {new_plan} at the plan switch failed ({e}); the "
                               f"state of step {step} is in {path}: resume from it (trainer.resume=true) with "
                               f"the old plan named, {_overrides(old)}") from e
        load(path, new)
        self.plan = new_plan
        if self.denv.rank == 0:
            self._annotate_switch(step, old, new_plan, path)
        return new

    def _annotate_switch(self, step: int, old, new, path: pathlib.Path) -> None:
        file = self.run_dir / "replan.json"
        history = json.loads(file.read_text()) if file.exists() else [{}]
        history[-1].update({"switched_at_step": step, "checkpoint": str(path), "from": str(old), "to": str(new),
                            "from_degrees": _degrees(old), "to_degrees": _degrees(new),
                            "checkpoint_meta_crc32": _meta_crc(path)})
        file.write_text(json.dumps(history, indent=2, default=str) + "\n")


def plan_after_switch(run_dir: pathlib.Path, topo, world: int):
    """(plan, why, step switched at) when this run resumes past a plan switch: RUN_DIR/replan.json records one and the
    latest checkpoint was written at or after it, on as many ranks. The startup re-plans from its prior
    (the constants the recheck found wrong), so without this a resumed run went back to the plan it had
    left and paid another recheck window and checkpoint to switch again. None otherwise (also when the
    recorded plan no longer fits the world's shape: the startup's choice then stands, logged)."""
    from amsp.checkpoint import STEP_PREFIX
    from amsp.plan import Degrees, PlanError, make_plan

    try:
        history = json.loads((run_dir / "replan.json").read_text())
        name = (run_dir / "checkpoints" / "latest").read_text().strip()
    except (OSError, ValueError):
        return None
    switches = [r for r in history if isinstance(r, dict) and "switched_at_step" in r]
    if not switches or not name.startswith(STEP_PREFIX):
        return None
    last = switches[-1]
    try:
        latest_step = int(name[len(STEP_PREFIX):])
        meta = json.loads((run_dir / "checkpoints" / name / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if latest_step < int(last["switched_at_step"]):
        return None
    # Only the run that made the switch resumes it: a replan.json left by an earlier run (a fresh start in the
    # same directory) changed a run that never switched, with a false reason. Its checkpoints after the switch
    # have the plan switched to; the switch's own checkpoint (the old plan's) is known by its meta.json.
    if latest_step == int(last["switched_at_step"]) and "checkpoint_meta_crc32" in last:
        ours = _meta_crc(run_dir / "checkpoints" / name) == last["checkpoint_meta_crc32"]
    else:  # a record without the CRC (older runs): the switch's own checkpoint has the plan switched from
        ours = _plan_shape(meta.get("plan")) == _plan_shape(
            last.get("from") if latest_step == int(last["switched_at_step"]) else last.get("to"))
    if not ours:
        log.info("planner: %s records a switch to %s at step %s, but the latest checkpoint %s was written by "
                 "plan %s: not this run's switch, so the startup's plan stands", run_dir / "replan.json",
                 last.get("to"), last["switched_at_step"], name, meta.get("plan"))
        return None
    if meta.get("world_size") != world:
        log.info("planner: the run switched to %s at step %s on %s ranks; this launch has %d, so the startup's "
                 "plan stands", last.get("to"), last["switched_at_step"], meta.get("world_size"), world)
        return None
    d = last["to_degrees"]
    try:
        # named "auto" as at the switch: the planner chose it ("custom" read as a plan the user named)
        plan = make_plan("auto", topo.world, topo.ranks_per_node, blocks=Degrees(d["p"], d["g"], d["os"]),
                         embed_head=Degrees(d["embed_head_p"], d["embed_head_g"], d["embed_head_os"]))
    except (PlanError, KeyError, TypeError) as e:
        log.warning("planner: cannot resume the plan switched to at step %s (%s); the startup's plan stands",
                    last["switched_at_step"], e)
        return None
    return plan, (f"the run switched to it at step {last['switched_at_step']} ({last.get('reason', 'recheck')}; "
                  f"{run_dir / 'replan.json'})"), int(last["switched_at_step"])


def _meta_crc(step_dir: pathlib.Path) -> int | None:
    """CRC32 of a checkpoint's meta.json (its elapsed time makes it one run's): names the switch's checkpoint."""
    import zlib

    try:
        return zlib.crc32((step_dir / "meta.json").read_bytes())
    except OSError:
        return None


def _plan_shape(text) -> str | None:
    """A plan's text without its name ("auto (p/g/os = 2/2/2)" -> "(p/g/os = 2/2/2)"): a resumed switched plan is
    named as at the switch, but the degrees are what the checkpoint's layout depends on."""
    if not isinstance(text, str):
        return None
    return text[text.find(" ("):] if " (" in text else text


def _numbers(cost) -> dict:
    return {"plan": str(cost.plan), "step_time_s": cost.step_time_s, "compute_s": cost.compute_s,
            "exposed_s": dict(cost.exposed_s), "memory_bytes": dict(cost.memory), "memory_total": cost.memory_total}


def _degrees(plan) -> dict:
    """The amsp.* overrides that name `plan` explicitly (to rerun it, or to continue it by hand)."""
    b, e = plan.blocks, plan.embed_head
    return {"p": b.p, "g": b.g, "os": b.os, "embed_head_p": e.p, "embed_head_g": e.g, "embed_head_os": e.os}


def _overrides(plan) -> str:
    return " ".join(f"amsp.{k}={v}" for k, v in _degrees(plan).items())


def _forget_stale_caches(options, cluster, fit) -> tuple[str | None, str | None]:
    """The cached compute profile and link measurement this run's refit puts STALE_FACTOR or more off are
    removed (measured on a busy machine, typically), so the next startup measures them again instead of
    planning every later run from them. Returns the removed paths."""
    from amsp.planner.cache_file import STALE_FACTOR, forget_if_stale
    from amsp.planner.probe import cached_probe

    gone = [forget_if_stale(f, fit.compute_scale) for f in ([] if options.compute is None else
                                                           options.compute.cache_files())]
    removed = ", ".join(f for f in gone if f) or None
    if removed:
        log.warning("planner recheck: this run's compute is x%.3g the compute profile's, %g or more times off: the "
                    "profile does not describe this machine as it runs now (timed while other work shared it?); "
                    "removed %s so the next startup measures afresh", fit.compute_scale, STALE_FACTOR, removed)
    removed_probe = forget_if_stale(cached_probe(cluster.source), fit.comm_scale)
    if removed_probe:
        log.warning("planner recheck: this run's communication is x%.3g the cached link measurement's, %g or more "
                    "times off; removed %s so the next startup probes afresh", fit.comm_scale, STALE_FACTOR,
                    removed_probe)
    return removed, removed_probe


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"
