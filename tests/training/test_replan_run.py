"""Re-planning in a real run: a wrong prior (bandwidths 10x too high, no probe) picks a plan, the
recheck measures, refits and switches through a checkpoint; the losses equal an uninterrupted run of
the same plan sequence (the first plan, stop, resume with the second) within the cross-plan
tolerance of test_continuation.py. A named plan is only reported on."""
import json

import pytest

from tests.training.runs import losses, train

pytestmark = pytest.mark.distributed

WRONG_PRIOR = ["amsp.planner.probe=false", "cluster.intra_bandwidth_gbs=20", "cluster.intra_latency_us=5",
               "trainer.checkpoint_interval=0"]
STEPS = 10


def _explicit(degrees: dict) -> list[str]:
    return [f"amsp.{k}={v}" for k, v in degrees.items()]


# Not marked slow (about 20 s): the switch run end to end found crashes (a checkpoint pinning the buffers
# the switch frees; ranks disagreeing on an asynchronous checkpoint) that the unit tests of its parts missed.
def test_wrong_prior_switches_plan_with_the_same_losses(tmp_path):
    run = tmp_path / "replan"
    # The recheck times the links the startup did not (amsp.planner.recheck_probe, on by default), which
    # takes up the prior's 10x error, and refits the rest; the refit alone is test_replan.py's.
    # Whether the refitted gain passes the default 5% depends on gloo timings of a debug model on the
    # machine (on a shared 2-core host it lands near it: 2.2% on 28 Nov); any predicted gain switches here,
    # so the switch and its losses are checked on every host (the 5% rule: test_replan.py's decide cases).
    proc = train(run, f"trainer.max_steps={STEPS}", "amsp.planner.recheck_steps=3", "amsp.planner.replan=true",
                 "amsp.planner.replan_min_gain=0", *WRONG_PRIOR, nproc=2)
    record = json.loads((run / "replan.json").read_text())[-1]
    assert "planner recheck after 3 steps" in proc.stdout
    assert record["measured"]["steps"] == 3 and record["links_probed_at_recheck"], record
    assert record["switch"], record
    k = record["switched_at_step"]
    assert k == 4 and f"switching from {record['from']} to {record['to']} at step {k}" in proc.stdout
    replanned = losses(run)

    ref = tmp_path / "reference"  # the same plan sequence, uninterrupted by any recheck
    train(ref, f"trainer.max_steps={k}", "amsp.planner.recheck_steps=0", *WRONG_PRIOR,
          *_explicit(record["from_degrees"]), nproc=2)
    train(ref, f"trainer.max_steps={STEPS}", "amsp.planner.recheck_steps=0", *WRONG_PRIOR,
          *_explicit(record["to_degrees"]), nproc=2)
    reference = losses(ref)
    assert sorted(replanned) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(replanned[step] - reference[step]) <= 1e-6 * abs(reference[step]), (step, replanned, reference)


def test_named_plan_is_only_reported(tmp_path):
    run = tmp_path / "named"
    proc = train(run, "trainer.max_steps=3", "amsp.plan=zero1", "amsp.planner.recheck_steps=2",
                 "amsp.planner.replan=true", *WRONG_PRIOR)
    record = json.loads((run / "replan.json").read_text())[-1]
    assert not record["switch"] and record["user_named"] and "named by the user" in record["reason"]
    assert "switching" not in proc.stdout
    assert not record["links_probed_at_recheck"], "a named plan is only reported on: nothing to re-measure"


# Slow (the suite's time budget): the default run keeps the re-planning switch itself
# (test_wrong_prior_switches_plan_with_the_same_losses).
@pytest.mark.slow
def test_recheck_times_the_links_the_startup_did_not(tmp_path):
    """probe=false at startup: the recheck measures the links (every rank takes part: the run goes on
    and ends) and refits from them; with recheck_probe=false it refits from the step time alone."""
    for probe, want in (("true", True), ("false", False)):
        run = tmp_path / f"recheck_probe_{probe}"
        proc = train(run, "trainer.max_steps=4", "amsp.planner.recheck_steps=2", "amsp.planner.replan=false",
                     f"amsp.planner.recheck_probe={probe}", "amsp.planner.probe_budget_s=0.5",
                     "amsp.planner.probe_cache=false", *WRONG_PRIOR, nproc=2)
        record = json.loads((run / "replan.json").read_text())[-1]
        assert record["links_probed_at_recheck"] is want, record
        assert ("links measured (probe)" in proc.stdout) is want
        assert sorted(losses(run)) == [1, 2, 3, 4]


# Slow (the suite's time budget): the default run keeps the switch itself
# (test_wrong_prior_switches_plan_with_the_same_losses); this adds the async periodic checkpoint under it.
@pytest.mark.slow
def test_switch_at_an_async_periodic_checkpoint_keeps_every_rank_together(tmp_path):
    """The switch through a periodic checkpoint written in the background: only rank 0 publishes it (in
    its writer thread), so each rank looking for it itself could disagree, one half of the world keeping
    the old engine, and the run hung. Rank 0 answers for all: the run switches and ends."""
    run = tmp_path / "async"
    proc = train(run, "trainer.max_steps=12", "amsp.planner.recheck_steps=3", "amsp.planner.replan=true",
                 "trainer.async_checkpoint=true", "trainer.checkpoint_interval=5", "amsp.planner.probe=false",
                 "cluster.intra_bandwidth_gbs=20", "cluster.intra_latency_us=5", "amsp.planner.replan_min_gain=0",
                 nproc=2, timeout=300)
    assert "no checkpoint at step" not in proc.stdout + proc.stderr
    assert sorted(losses(run)) == list(range(1, 13))
    record = json.loads((run / "replan.json").read_text())[-1]
    assert record["switch"], record
    assert f"switching from {record['from']} to {record['to']} at step 5" in proc.stdout


# Slow (the suite's time budget): the default run keeps the re-planning switch itself
# (test_wrong_prior_switches_plan_with_the_same_losses).
@pytest.mark.slow
def test_a_cached_compute_profile_the_run_contradicts_is_removed(tmp_path, monkeypatch):
    """A compute profile cached while the machine was busy (here: the cached times made 10x longer) is
    found out by the recheck and removed; the run goes on, and the next startup measures afresh."""
    monkeypatch.setenv("AMSP_CACHE_DIR", str(tmp_path / "cache"))
    common = ("trainer.max_steps=3", "amsp.planner.replan=false")
    # The runs that only write the cache (first) or measure it afresh (third) do not recheck: on a shared
    # machine their own steps can be 1.5x off a profile measured a moment before, and that recheck would
    # remove the file these steps are about.
    train(tmp_path / "first", *common, "amsp.planner.recheck_steps=0")
    (path,) = (tmp_path / "cache" / "compute").glob("compute-*.json")
    data = json.loads(path.read_text())
    for k in ("block_forward_s", "block_backward_s", "head_forward_backward_s", "embedding_s"):
        data["profile"][k] *= 10
    path.write_text(json.dumps(data))
    proc = train(tmp_path / "second", *common, "amsp.planner.recheck_steps=2")
    assert "compute profile: cached" in proc.stdout and f"removed {path}" in proc.stdout, proc.stdout[-3000:]
    assert not path.exists()
    record = json.loads((tmp_path / "second" / "replan.json").read_text())[-1]
    assert record["stale_compute_profile_removed"] == str(path) and record["refit"]["compute_scale"] < 1 / 1.5
    assert sorted(losses(tmp_path / "second")) == [1, 2, 3]
    proc = train(tmp_path / "third", *common, "amsp.planner.recheck_steps=0")
    assert "compute profile (" in proc.stdout and path.exists()  # measured afresh, and cached again


# Slow (the suite's time budget): the default run keeps the re-planning switch itself
# (test_wrong_prior_switches_plan_with_the_same_losses).
@pytest.mark.slow
def test_a_cached_link_measurement_the_run_contradicts_is_removed(tmp_path, monkeypatch):
    """The same for the collective probe's cache: links cached 100x faster than they are are found out by
    the recheck's communication refit and the file is removed, so the next startup probes again."""
    monkeypatch.setenv("AMSP_CACHE_DIR", str(tmp_path / "cache"))
    common = ("trainer.max_steps=3", "amsp.planner.replan=false", "amsp.planner.probe_budget_s=0.5",
              "trainer.checkpoint_interval=0")
    train(tmp_path / "first", *common, "amsp.planner.recheck_steps=0", nproc=2)  # writes the cache, as above
    (path,) = (tmp_path / "cache" / "probe").glob("probe-*.json")
    data = json.loads(path.read_text())
    data["points"] = {k: [[size, gbs * 100] for size, gbs in pts] for k, pts in data["points"].items()}
    path.write_text(json.dumps(data))
    proc = train(tmp_path / "second", *common, "amsp.planner.recheck_steps=2", nproc=2)
    assert f"bandwidths from cache {path}" in proc.stdout and f"removed {path}" in proc.stdout, proc.stdout[-3000:]
    assert not path.exists()
    record = json.loads((tmp_path / "second" / "replan.json").read_text())[-1]
    assert record["stale_probe_removed"] == str(path) and record["refit"]["comm_scale"] >= 1.5, record
