"""Config validation: every bad numeric or enum value is one line naming key, value and what is allowed."""
import math

import pytest
from omegaconf import OmegaConf

from configs.schema import ModelConfig, TrainConfig
from configs.validate import RULES, ConfigError, validate_config


def default_cfg():
    return OmegaConf.structured(TrainConfig(model=ModelConfig()))


def test_defaults_are_valid():
    validate_config(default_cfg())


def test_every_rule_names_a_real_field():
    cfg = default_cfg()
    missing = [r.key for r in RULES if OmegaConf.select(cfg, r.key, default="__absent__") == "__absent__"]
    assert not missing, f"rules for fields the schema does not have: {missing}"


@pytest.mark.parametrize("key, value, allowed", [
    ("optim.lr", -1e-3, "a finite number > 0"),
    ("optim.lr", math.nan, "a finite number > 0"),
    ("optim.lr", math.inf, "a finite number > 0"),
    ("optim.beta2", 1.0, "in [0, 1)"),
    ("optim.eps", 0.0, "> 0"),
    ("trainer.max_steps", -3, "an integer >= 1"),
    ("trainer.micro_batch_size", 0, "an integer >= 1"),
    ("trainer.dtype", "fp16", "one of auto|fp32|bf16"),
    ("trainer.device", "tpu", "one of auto|cpu|cuda"),
    ("trainer.collective_timeout_s", 0.0, "> 0"),
    ("trainer.keep_last_checkpoints", 0, ">= 1"),
    ("amsp.grad_comm", "fp8", "one of auto|fp32|bf16"),
    ("amsp.spread_window", 0, "an integer >= 1"),
    ("model.compile", "yes", "one of auto|on|off"),
    ("amsp.p", 0, ">= 1"),
    ("amsp.planner.memory_margin", 1.5, "in [0, 1)"),
    ("amsp.planner.replan_min_gain", -0.1, "in [0, 1)"),
    ("logging.wandb.mode", "sometimes", "online|offline|disabled"),
    ("data.split", [0.0, 2.0], "positive train share"),
    ("optim.min_lr_ratio", 1.5, "in [0, 1]"),
])
def test_bad_value_is_one_line_naming_key_value_and_allowed(key, value, allowed):
    cfg = default_cfg()
    OmegaConf.update(cfg, key, value, force_add=False)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{key}=") and allowed in msg, msg


@pytest.mark.parametrize("overrides, words", [
    ({"parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.virtual_stages": 2}, "interleaved schedule needs"),
    ({"parallel.pp": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 1}, "zero_bubble takes any"),
    ({"parallel.pp": 2, "parallel.schedule": "zero_bubble", "amsp.fuse_wgrad": True},
     "fuse_wgrad=true is not allowed with parallel.schedule=zero_bubble"),
    ({"parallel.pp": 2, "parallel.layer_split": [1, 2]}, "summing to model.n_layers"),
    ({"parallel.tp": 3}, "model.n_heads=4 is not divisible"),
    ({"parallel.tp": 2, "data.seq_len": 255}, "set parallel.sequence_parallel=false"),
    ({"parallel.tp": 2, "model.multiple_of": 1, "model.ffn_dim_multiplier": 1.002},
     "the MLP's hidden size 683 .* is not divisible by it"),
    ({"parallel.auto": True, "amsp.plan": "zero3"}, "set amsp.plan=auto"),
    ({"parallel.pp": 2, "model.tie_embeddings": True}, "different stages"),
    # refused by parallelize_llama only once every rank had built the model
    ({"parallel.tp": 2, "model.tie_embeddings": True, "parallel.loss_parallel": False},
     "parallel.loss_parallel=false is not allowed with parallel.tp > 1 and model.tie_embeddings=true"),
    ({"parallel.tp": 2, "model.compile": "on"}, "model.compile=on is not allowed with parallel.tp=2"),
    # the joint planner chooses these: a hand-given value was silently replaced at startup
    ({"parallel.auto": True, "parallel.tp": 2, "parallel.schedule": "gpipe"},
     "parallel.tp=2, parallel.schedule='gpipe' not allowed with parallel.auto=true"),
    ({"parallel.auto": True, "parallel.layer_split": [2, 2]}, "parallel.layer_split=.2, 2. not allowed"),
    ({"parallel.auto": True, "amsp.embed_head_os": 2}, "amsp.embed_head_os=2 not allowed with parallel.auto"),
    # amsp.plan=auto's partitioner chooses the embedding+head degrees: these were ignored
    ({"amsp.embed_head_p": 2, "amsp.embed_head_g": 2}, "amsp.embed_head_p=2, amsp.embed_head_g=2 not allowed "
                                                        "with amsp.plan=auto alone"),
    # without a pipeline train.py never read these: they were silently ignored
    ({"parallel.schedule": "interleaved", "parallel.virtual_stages": 2},
     "parallel.schedule='interleaved', parallel.virtual_stages=2 not allowed with parallel.pp=1: a pipeline "
     "schedule needs parallel.pp > 1"),
    ({"parallel.tp": 2, "parallel.recompute_stages": [True]},
     r"parallel.recompute_stages=\[True\] is not allowed with parallel.pp=1: .*set model.activation_checkpointing"),
])
def test_parallel_settings_checked_against_model_and_batch(overrides, words):
    cfg = default_cfg()
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.n_layers = 4, 2, 4
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=False)
    with pytest.raises(ConfigError, match=words) as err:
        validate_config(cfg)
    assert "\n" not in str(err.value)


def test_pipeline_settings_refused_once_and_kept_for_what_ifs():
    """parallel.auto names them among what the joint planner chooses (not twice); the planner CLI's
    what-if amsp.planner.pp prices the named schedule, so it is not refused there."""
    cfg = default_cfg()
    for key, value in {"parallel.auto": True, "parallel.recompute_stages": [True]}.items():
        OmegaConf.update(cfg, key, value, force_add=False)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "not allowed with parallel.auto=true" in str(err.value) and "parallel.pp=1" not in str(err.value)
    cfg = default_cfg()
    for key, value in {"amsp.planner.pp": 2, "parallel.schedule": "gpipe"}.items():
        OmegaConf.update(cfg, key, value, force_add=False)
    validate_config(cfg, what_if=True)


def test_explicit_plans_keep_their_embedding_and_head_degrees():
    cfg = default_cfg()
    for k, v in {"amsp.p": 1, "amsp.g": 1, "amsp.os": 4, "amsp.embed_head_os": 2}.items():
        OmegaConf.update(cfg, k, v, force_add=False)
    validate_config(cfg)  # amsp.p given: an explicit plan, its embed_head degrees apply
    cfg = default_cfg()
    OmegaConf.update(cfg, "amsp.plan", "zero3", force_add=False)
    OmegaConf.update(cfg, "amsp.embed_head_os", 2, force_add=False)
    validate_config(cfg)


def test_several_problems_reported_together_and_cross_field_rule():
    cfg = default_cfg()
    cfg.trainer.micro_batch_size = 0
    cfg.optim.min_lr = 1.0
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=0 .*; optim.min_lr=1.0 is not allowed: "
                                          r"expected at most optim.lr"):
        validate_config(cfg)


def test_train_py_stops_on_a_bad_value_with_one_line_and_exit_code_2(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "train.py", "trainer.micro_batch_size=0", "optim.lr=-1",
                           f"trainer.output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["config error: optim.lr=-1.0 is not allowed: expected a finite number > 0; "
                     "trainer.micro_batch_size=0 is not allowed: expected an integer >= 1"], proc.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written for a rejected config"


@pytest.mark.parametrize("override, names", [
    ("trainer.max_stepz=3", "Could not override 'trainer.max_stepz'"),
    ("trainer.max_steps=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
    ("model=llama9_1b", "Could not find 'model/llama9_1b' Available options in 'model':"),
    # Hydra's answer to a misspelt key suggests appending it; appended, it was read by nothing
    ("+optim.lrr=1", "optim.lrr is not a setting (misspelt?"),
])
def test_hydra_composition_errors_are_one_line_with_exit_code_2(tmp_path, override, names):
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "train.py", override, f"trainer.output_dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: ") and names in lines[0], lines[0]
    assert not any(tmp_path.iterdir())


def test_a_sequence_longer_than_the_model_takes_is_refused_before_the_run():
    """data.seq_len past model.max_seq_len (the RoPE tables' length) was a Hydra traceback from inside
    train.py after the run directory existed; it is a config problem, named with the fix."""
    cfg = default_cfg()
    cfg.data.seq_len = cfg.model.max_seq_len + 1
    with pytest.raises(ConfigError, match=rf"data.seq_len={cfg.model.max_seq_len + 1} is not allowed: expected at "
                                          rf"most model.max_seq_len={cfg.model.max_seq_len} \(raise"):
        validate_config(cfg)
    cfg.data.seq_len = cfg.model.max_seq_len
    validate_config(cfg)


@pytest.mark.parametrize("change, words", [
    # both name the compute dtype: the contradiction was a ValueError traceback from the planner, after the run
    # directory existed
    ({"amsp": {"precision": "fp32"}, "trainer": {"dtype": "bf16"}}, "amsp.precision=fp32 contradicts trainer.dtype"),
    # re-planning reads the recheck's measurement: without a recheck it was silently never done
    ({"amsp": {"planner": {"replan": True, "recheck_steps": 0}}}, "amsp.planner.replan=true needs a recheck"),
])
def test_settings_that_contradict_each_other_are_refused(change, words):
    cfg = OmegaConf.merge(default_cfg(), change)
    with pytest.raises(ConfigError, match=words):
        validate_config(cfg)


@pytest.mark.parametrize("value", ["full", "selective"])
def test_hand_given_recomputation_refused_with_parallel_auto(value):
    """The joint plan's per-stage recomputation replaced a hand-given model.activation_checkpointing: a run
    asked for full checkpointing trained without it and said nothing."""
    cfg = default_cfg()
    cfg.parallel.auto, cfg.model.activation_checkpointing = True, value
    with pytest.raises(ConfigError, match=f"model.activation_checkpointing={value} not allowed with "
                                          f"parallel.auto=true: the joint planner chooses"):
        validate_config(cfg)
    cfg.model.activation_checkpointing = "none"  # the default passes, as without parallel.auto any value
    validate_config(cfg)
    cfg.parallel.auto, cfg.model.activation_checkpointing = False, value
    validate_config(cfg)
