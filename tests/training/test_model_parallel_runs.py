"""train.py end to end with model parallelism: a run at (tp 2, pp 2) on 4 ranks trains the same losses as
a single process, and its checkpoint resumes in a single process, continuing the same losses."""
import pytest

from amsp.errors import EXIT_INPUT
from tests.training.runs import losses, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two torchrun launches and two single runs: ~1 min


def test_tp2_pp2_run_matches_single_process_and_resumes_without_model_parallelism(tmp_path):
    straight = tmp_path / "straight"
    train(straight, "trainer.max_steps=8", "trainer.checkpoint_interval=0", "amsp.plan=ddp")
    want = losses(straight)
    run = tmp_path / "tp2pp2"
    proc = train(run, "trainer.max_steps=4", "trainer.checkpoint_interval=0", "amsp.plan=ddp", "parallel.tp=2",
                 "parallel.pp=2", nproc=4)
    assert "mesh pp=2 x dp=1 x tp=2" in proc.stdout + proc.stderr
    got = losses(run)
    for step in range(1, 5):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    proc = train(run, "trainer.max_steps=8", "trainer.checkpoint_interval=0", "amsp.plan=ddp")
    assert "resumed from checkpoint" in proc.stdout and "at step 4" in proc.stdout
    # the layout it was written under: the plan's degrees were those of a data-parallel group of one rank
    assert ("written by plan ddp (p/g/os = 1/1/1) on 4 ranks, tp 2 pp 2: the plan is each stage's data-parallel "
            "group's)") in proc.stdout, proc.stdout[-3000:]
    resumed = losses(run)
    for step in range(5, 9):
        assert abs(resumed[step] - want[step]) <= 1e-5 * abs(want[step]), (step, resumed[step], want[step])


def test_parallel_auto_prices_measured_tp_units_and_trains_its_choice(tmp_path):
    """parallel.auto on 4 ranks posing as 2 nodes of 2: startup probes the links, times the TP units on real
    TP groups, plans, and the run trains under the chosen (tp, pp) with its plan written down."""
    run = tmp_path / "auto"
    proc = train(run, "trainer.max_steps=3", "trainer.checkpoint_interval=0", "parallel.auto=true",
                 "amsp.ranks_per_node=2", "amsp.planner.probe_budget_s=1",
                 f"amsp.planner.cache_dir={tmp_path / 'cache'}", nproc=4)  # measured here, not read from a cache
    out = proc.stdout + proc.stderr
    assert "bandwidth probe:" in out and "tensor-parallel profile: tp 2:" in out, out[-3000:]
    plan = (run / "plan.txt").read_text()
    assert "joint planner (compute:" in plan and "why:" in plan
    first = plan.splitlines()[plan.splitlines().index(next(line for line in plan.splitlines()
                                                             if line.lstrip().startswith("rank"))) + 1].split()
    tp, pp = int(first[1]), int(first[2])
    assert ("model parallelism: mesh" in out) == ((tp, pp) != (1, 1))
    assert len(losses(run)) == 3
    # A resume that is refused (another sequence length) leaves the run's plan.txt as it was.
    proc = train(run, "trainer.max_steps=4", "parallel.auto=true", "data.seq_len=64",
                 f"amsp.planner.cache_dir={tmp_path / 'cache'}", check=False)
    assert proc.returncode == EXIT_INPUT and "seq_len" in proc.stderr, proc.stderr[-3000:]
    assert (run / "plan.txt").read_text() == plan
