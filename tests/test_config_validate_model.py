"""model.* values are checked with the rest of the config: one line naming the key, before any state."""
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from configs.schema import ModelConfig, TrainConfig
from configs.validate import ConfigError, validate_config
from models.llama.config import get_preset


def debug_cfg(**model):
    cfg = OmegaConf.structured(TrainConfig(model=ModelConfig(**vars(get_preset("debug")), name="debug")))
    for key, value in model.items():
        OmegaConf.update(cfg, f"model.{key}", value)
    return cfg


def test_debug_model_is_valid():
    validate_config(debug_cfg())


@pytest.mark.parametrize("key, value, said", [
    ("n_heads", 3, "model.dim=64 is not divisible by model.n_heads=3"),
    ("activation_checkpointing", "bogus", "model.activation_checkpointing='bogus' is not one of"),
    ("n_kv_heads", 0, "model.n_kv_heads=0 is not allowed"),
    ("n_kv_heads", 3, "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
    ("multiple_of", 0, "model.multiple_of=0 is not allowed: expected an integer >= 1"),
    ("dim", -64, "model.dim=-64 is not allowed: expected an integer >= 1"),
    ("n_heads", 0, "model.n_heads=0 is not allowed"),
    ("n_layers", 0, "model.n_layers=0 is not allowed"),
    ("vocab_size", 0, "model.vocab_size=0 is not allowed"),
    ("rope_theta", 0.0, "model.rope_theta=0.0 is not allowed: expected a finite number > 0"),
    ("norm_eps", -1.0, "model.norm_eps=-1.0 is not allowed: expected a finite number > 0"),
    ("norm_eps", float("nan"), "model.norm_eps=nan is not allowed"),
    ("ffn_dim_multiplier", 0.0, "model.ffn_dim_multiplier=0.0 is not allowed"),
    ("dim", 20, "must be even for rotary embeddings"),
])
def test_bad_model_value_is_one_line_naming_the_key(key, value, said):
    with pytest.raises(ConfigError) as e:
        validate_config(debug_cfg(**{key: value}))
    assert said in str(e.value) and "\n" not in str(e.value)


def test_validate_model_does_not_import_torch():
    code = "import sys, configs.validate; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
