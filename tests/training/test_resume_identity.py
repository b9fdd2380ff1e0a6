"""What a resume must not change silently: the model (even where the tensor shapes agree), the learning-rate
schedule (a longer trainer.max_steps moved the decay horizon: the lr jumped back up) and the sample order's
seed. Each is refused unless trainer.allow_resume_changes names it, where that is allowed at all; checkpoints
written before these were recorded resume unchecked (data/resume_check.py)."""
import json
import logging
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import yaml

from amsp.errors import InputError
from amsp.optim import WarmupCosine
from data.resume_check import check_model_before_load, check_resume, run_identity
from models.llama.config import LlamaConfig, RopeScaling
from tests.training.runs import train

DEBUG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32)


def saved_checkpoint(tmp_path, **model) -> str:
    """A step directory holding only the config.yaml a trainer checkpoint carries (the model node)."""
    ck = tmp_path / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    node = {"name": "debug", **asdict(LlamaConfig(**{**DEBUG, **model}))}
    (ck / "config.yaml").write_text(yaml.safe_dump({"model": node}))
    return str(ck)


def fake_data():
    tok = SimpleNamespace(fingerprint=lambda: "ab" * 32, model_file="/t/tok.model", vocab_size=512)
    return SimpleNamespace(tokenizer=tok, sources=[(1.0, "/d/a")], sizes=[(10, 1000)],
                           split={"split": [98, 2], "split_seed": 1234})


def identity(seed=1234, decay=4, lr=1e-3):
    return run_identity(32, fake_data(), 512, data_seed=seed, schedule=WarmupCosine(lr, 1e-4, 1, decay))


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_same_shaped_model_change_is_refused_even_when_model_changes_are_allowed(tmp_path):
    ck = saved_checkpoint(tmp_path)
    for allowed in ([], ["model"]):
        with pytest.raises(InputError) as e:
            check_model_before_load(ck, LlamaConfig(**{**DEBUG, "n_heads": 8, "n_kv_heads": 4}), allowed)
        assert str(e.value) == (
            f"cannot resume from {ck}: model.n_heads 4 -> 8, model.n_kv_heads 2 -> 4 since it was written (its "
            "weights were trained for its model: training on would give them another meaning, even where the "
            "tensor shapes agree). Set model.n_heads=4 model.n_kv_heads=2, or start a new run (another "
            "trainer.run_name)")


def test_numeric_model_change_is_refused_unless_allowed_and_kernel_choices_are_free(tmp_path, caplog):
    ck = saved_checkpoint(tmp_path, attention="flash_attn", fused="on")
    with pytest.raises(InputError) as e:
        check_model_before_load(ck, LlamaConfig(**DEBUG, rope_theta=500000.0), [])
    assert str(e.value).endswith("model.rope_theta 10000.0 -> 500000.0 since it was written (same shapes, but the "
                                 "trained weights compute another function). Restore it with "
                                 "model.rope_theta=10000.0, or allow it with trainer.allow_resume_changes=[model]")
    with pytest.raises(InputError, match=r"model.norm_eps 1e-05 -> 1e-06"):
        check_model_before_load(ck, LlamaConfig(**DEBUG, norm_eps=1e-6), ["data"])
    with pytest.raises(InputError, match=r"model.rope_scaling.factor 0.0 -> 8.0.*model.rope_scaling.factor=0.0"):
        check_model_before_load(ck, LlamaConfig(**DEBUG, rope_scaling=RopeScaling(factor=8.0)), [])
    caplog.set_level(logging.INFO)
    check_model_before_load(ck, LlamaConfig(**DEBUG, rope_theta=500000.0), ["model"])
    assert warnings_of(caplog) == [f"resuming from {ck} with a change allowed by trainer.allow_resume_changes: "
                                   "model.rope_theta 10000.0 -> 500000.0"]
    caplog.clear()  # other kernels and recomputation compute the same function: nothing to say
    check_model_before_load(ck, LlamaConfig(**DEBUG, attention="sdpa", norm="torch", fused="off",
                                            activation_checkpointing="full"), [])
    assert warnings_of(caplog) == []


def test_a_longer_max_steps_is_refused_naming_the_lr_jump_and_the_way_to_extend(caplog):
    old, longer = identity(decay=4), identity(decay=8)  # decay horizon = trainer.max_steps 4 -> 8
    with pytest.raises(InputError) as e:
        check_resume(old, longer, [], "CK", 16, step=4)
    assert str(e.value) == (
        "cannot resume from CK: learning-rate schedule: the decay horizon (optim.decay_steps, else "
        "trainer.max_steps) 4 -> 8; the lr of step 5 (the first resumed) goes from 0.0001 (old schedule) to "
        "0.00065 (new); to extend the run on the old schedule set optim.decay_steps=4. Restore the old value(s), "
        "or allow it with trainer.allow_resume_changes=[schedule]")
    with pytest.raises(InputError, match=r"optim.lr 0.001 -> 0.002.*allow_resume_changes=\[schedule\]$"):
        check_resume(old, identity(lr=2e-3), ["data"], "CK", 16, step=2)  # mid-decay (at step 4 both are floored)
    caplog.set_level(logging.INFO)
    assert check_resume(old, longer, ["schedule"], "CK", 16, step=4) == 16
    assert len(warnings_of(caplog)) == 1 and "goes from 0.0001 (old schedule) to 0.00065 (new)" in \
        warnings_of(caplog)[0]
    caplog.clear()  # the old horizon kept (optim.decay_steps=4 with trainer.max_steps=8): the same schedule
    assert check_resume(old, identity(decay=4), [], "CK", 16, step=4) == 16 and warnings_of(caplog) == []


def test_a_longer_horizon_inside_the_warmup_is_said_not_refused(caplog):
    """A short run still warming up (warmup 20 > max_steps 4, as the Slurm e2e job's) extended to 6 steps: the lr
    of the resumed step is the same on both schedules, so there is no jump to refuse; the change is said."""
    warm = lambda decay: run_identity(32, fake_data(), 512, data_seed=1234,  # noqa: E731
                                      schedule=WarmupCosine(1e-3, 1e-4, 20, decay))
    caplog.set_level(logging.INFO)
    assert check_resume(warm(4), warm(6), [], "CK", 16, step=4) == 16 and warnings_of(caplog) == []
    assert "4 -> 6; the lr of step 5 (the first resumed) goes from 0.00025 (old schedule) to 0.00025 (new)" in \
        caplog.text and "no jump at the resumed step" in caplog.text


def test_another_sample_order_seed_is_a_data_change(caplog):
    with pytest.raises(InputError) as e:
        check_resume(identity(seed=1234), identity(seed=999), [], "CK", 16, step=4)
    assert str(e.value) == (
        "cannot resume from CK: sample order seed (data.seed, else trainer.seed) 1234 -> 999 since it was written "
        "(its data position of 16 samples means other data now). Restore the old value(s), or allow it with "
        "trainer.allow_resume_changes=[data]")
    with pytest.raises(InputError, match=r"1234 -> 999 since.*learning-rate schedule.*=\[data,schedule\]$"):
        check_resume(identity(seed=1234), identity(seed=999, decay=8), [], "CK", 16, step=4)
    assert check_resume(identity(seed=1234), identity(seed=999), ["data"], "CK", 16, step=4) == 16
    assert "1234 -> 999 (data position kept at 16 samples of the new stream)" in warnings_of(caplog)[0]


def test_checkpoints_from_before_the_records_resume_unchecked(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    old = {k: v for k, v in identity().items() if k not in ("data_seed", "lr_schedule")}
    assert check_resume(old, identity(seed=999, decay=8), [], "CK", 16, step=4) == 16
    assert warnings_of(caplog) == []
    assert ("resuming from CK: the sample order seed and the learning-rate schedule not checked (recorded only by "
            "checkpoints written since)") in caplog.messages
    bare = tmp_path / "bare"
    bare.mkdir()  # no config.yaml: the model is not compared
    check_model_before_load(bare, LlamaConfig(**DEBUG), [])
    assert any("the model config was not compared" in m for m in caplog.messages)


@pytest.mark.distributed  # two train.py runs of the debug model (a few seconds each)
def test_train_records_the_schedule_and_seed_and_refuses_a_resume_that_changes_them(tmp_path):
    run = tmp_path / "r"
    common = ["trainer.checkpoint_interval=2", "optim.decay_steps=null", "optim.warmup_steps=1"]
    train(run, "trainer.max_steps=2", *common)
    ck = run / "checkpoints" / "step_00000002"
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["data_seed"] == 1234 and meta["lr_schedule"] == {"lr": meta["lr_schedule"]["lr"], "min_lr":
                                                                 meta["lr_schedule"]["min_lr"], "warmup_steps": 1,
                                                                 "decay_steps": 2}
    # The trainer's own config.yaml is what the model check reads: 8 heads of 8 are refused before any load.
    with pytest.raises(InputError, match=r"model.n_heads 4 -> 8, model.n_kv_heads 2 -> 4 since"):
        check_model_before_load(ck, LlamaConfig(**{**DEBUG, "vocab_size": 8192, "n_heads": 8, "n_kv_heads": 4}), [])
    before = {p: p.read_bytes() for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()}
    proc = train(run, "trainer.max_steps=4", "trainer.seed=999", *common, check=False)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("input error: ")]
    assert len(line) == 1 and "sample order seed (data.seed, else trainer.seed) 1234 -> 999" in line[0] and \
        "the decay horizon (optim.decay_steps, else trainer.max_steps) 2 -> 4" in line[0] and \
        line[0].endswith("trainer.allow_resume_changes=[data,schedule]"), proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()} == before
