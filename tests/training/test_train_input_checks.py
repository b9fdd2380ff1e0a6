"""train.py's input checks and run-directory care: bad values end as one line and exit 2, a refused resume
leaves the run directory as it was, a fresh start keeps an earlier run's logs aside, Ctrl-C saves."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from amsp.errors import EXIT_INPUT, InputError, classify
from tests.training.runs import BASE, ROOT, records, train


def _cfg(**values):
    from configs.schema import ModelConfig, TrainConfig

    cfg = OmegaConf.structured(TrainConfig(model=ModelConfig()))
    for key, value in values.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize("values, said", [
    ({"trainer.global_batch_size": 10, "trainer.micro_batch_size": 4, "trainer.round_global_batch": False},
     "global batch 10 samples is not divisible"),
    ({"trainer.global_batch_tokens": 1000}, "trainer.global_batch_tokens=1000 is not a multiple"),
])
def test_a_batch_that_does_not_split_is_a_config_error(values, said):
    from amsp.batch_geometry import batch_geometry

    with pytest.raises(ValueError, match=said) as e:
        batch_geometry(_cfg(**values), 1, announce=False)
    assert classify(e.value) == (EXIT_INPUT, "config error")


def test_cuda_asked_for_without_cuda_is_an_input_error(monkeypatch):
    from amsp.launch import DistEnv
    from train import pick_device_and_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    denv = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")
    with pytest.raises(InputError, match="trainer.device=cuda but CUDA is not available"):
        pick_device_and_dtype(_cfg(**{"trainer.device": "cuda"}), denv)


def test_explicit_degrees_with_a_preset_name_are_ambiguous():
    from amsp.plan import PlanError, plan_from_settings

    with pytest.raises(PlanError, match=r"amsp.plan=zero3 and explicit degrees amsp.p/g/os=1/1/1") as e:
        plan_from_settings("zero3", 2, 2, blocks=(1, 1, 1))
    assert classify(e.value)[0] == EXIT_INPUT
    for name in ("auto", "custom"):  # the values that name no degrees of their own
        assert plan_from_settings(name, 2, 2, blocks=(1, 1, 2)).name == "custom"
    assert str(plan_from_settings("zero3", 2, 2, embed_head=(1, 1, 2)).blocks) == "2/2/2"


def test_sigint_is_a_preemption_and_a_second_one_aborts(monkeypatch):
    from amsp.resilience import PreemptionHandler

    assert signal.SIGINT in PreemptionHandler.SIGNALS  # else the kill below stops pytest itself
    # Python's own Ctrl-C handler before training, as in a fresh train.py (an earlier test in this process,
    # the netns cluster's, may have left its own), restored for the tests after this one.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    handler = PreemptionHandler()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's and torchrun's copy of one Ctrl-C
        assert handler.agreed_signal() == signal.SIGINT
        monkeypatch.setattr(handler, "SAME_CTRL_C_S", 0.0)
        time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        handler.hand_over(signal.SIGINT)  # SIGINT's default handler would raise KeyboardInterrupt here
    finally:
        handler.restore()
        restored = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, before)
    assert restored is signal.default_int_handler


def _step_files(run):
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


# Slow (the suite's time budget): resume refusals stay covered in the default run by test_input_faults'
# seq_len/vocab case.
@pytest.mark.slow
def test_refused_resumes_leave_the_run_directory_and_fresh_starts_keep_old_logs(tmp_path):
    run = tmp_path / "runs" / "r"
    train(run, "trainer.max_steps=2")
    kept = {n: (run / n).read_bytes() for n in ("config.yaml", "plan.txt", "metrics.jsonl", "tokenizer.model")}
    for change, said in (("data.seq_len=64", "seq_len"),  # the data position's meaning changed
                         ("model.n_layers=1", "model.n_layers 2 -> 1")):  # another model: refused before loading
        proc = train(run, change, "trainer.max_steps=4", check=False)
        assert proc.returncode == EXIT_INPUT and said in proc.stderr, proc.stderr[-3000:]
        assert "resumed from checkpoint" not in proc.stdout
        assert {n: (run / n).read_bytes() for n in kept} == kept, change
        assert _step_files(run) == ["step_00000002"]
    # A fresh start refused for its trainer.init_from (here: this run's own weights, into another model) leaves
    # the checkpoints where a resume finds them (they were moved aside first, then the refusal said that the
    # run directory held no checkpoint).
    proc = train(run, "trainer.resume=false", f"trainer.init_from={run}", "model.n_layers=3", check=False)
    assert proc.returncode == EXIT_INPUT and "neither a Hugging Face" not in proc.stderr, proc.stderr[-3000:]
    assert _step_files(run) == ["step_00000002"] and not list((run / "checkpoints").glob("superseded-*"))
    # A checkpoint past max_steps: nothing to train, said; data.valid_samples=0: validation is off, said.
    proc = train(run, "trainer.max_steps=1", "data.valid_samples=0", "trainer.val_samples=16")
    assert "checkpoint step 2 >= trainer.max_steps=1: nothing to train" in proc.stdout, proc.stdout[-3000:]
    assert "validation is off: data.valid_samples=0" in proc.stdout
    # A fresh start: the earlier run's rows are moved aside, not appended to.
    proc = train(run, "trainer.max_steps=1", "trainer.resume=false")
    assert [r["step"] for r in records(run)] == [1]
    old = list(run.glob("metrics.jsonl.*.old"))
    assert len(old) == 1 and old[0].read_bytes() == kept["metrics.jsonl"], sorted(p.name for p in run.iterdir())
    assert "kept aside" in proc.stdout


def test_ctrl_c_saves_a_checkpoint_and_exits_as_sigterm_does(tmp_path):
    run = tmp_path / "runs" / "r"
    args = [f"trainer.output_dir={run.parent}", f"trainer.run_name={run.name}", *BASE, "trainer.max_steps=1000",
            "trainer.checkpoint_interval=0"]
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + 300
            while "| loss " not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert rc == 0, text[-3000:]  # as for SIGTERM: a clean stop with its checkpoint
    assert "received SIGINT: saving checkpoint" in text and "Traceback" not in text, text[-3000:]
    assert len(_step_files(run)) == 1 and (run / "checkpoints" / "latest").exists()
