"""Per-preset training recipes (configs/optim/recipe/<model>.yaml) and batch geometry on 8 x N GPUs."""
from __future__ import annotations

import functools
import pathlib

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from amsp.batch_geometry import batch_geometry
from amsp.optim import lr_floor
from configs.schema import register_configs
from configs.validate import validate_config
from models.llama.config import PRESETS

ROOT = pathlib.Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)  # compositions are read-only here; each takes ~0.5 s
def composed(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


# (peak lr, warmup steps) from the papers cited in each recipe file.
PUBLISHED = {
    "llama1_7b": (3e-4, 2000), "llama1_13b": (3e-4, 2000), "llama1_30b": (1.5e-4, 2000), "llama1_65b": (1.5e-4, 2000),
    "llama2_7b": (3e-4, 2000), "llama2_13b": (3e-4, 2000), "llama2_70b": (1.5e-4, 2000),
    "llama3_8b": (3e-4, 2000), "llama3_70b": (1.5e-4, 2000), "llama3_1_8b": (3e-4, 2000),
    "debug": (1e-3, 20), "tiny": (1e-3, 20),
}


def test_every_preset_has_a_recipe():
    files = {p.stem for p in (ROOT / "configs" / "optim" / "recipe").glob("*.yaml")}
    assert files == set(PRESETS), "a model preset without configs/optim/recipe/<name>.yaml cannot be composed"
    assert set(PUBLISHED) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_recipe_sets_the_published_schedule(name):
    o = composed(f"model={name}").optim
    lr, warmup = PUBLISHED[name]
    assert (o.lr, o.warmup_steps) == (pytest.approx(lr), warmup)
    assert lr_floor(o.lr, o.min_lr, o.min_lr_ratio) == pytest.approx(lr / 10)  # cosine to 10% of the peak
    if name.startswith("llama"):
        assert (o.beta1, o.beta2, o.weight_decay, o.grad_clip) == (0.9, 0.95, 0.1, 1.0)


def test_command_line_overrides_win_over_the_recipe():
    cfg = composed("model=llama2_7b", "optim.lr=1e-4", "optim.warmup_steps=10", "trainer.micro_batch_size=2")
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.trainer.micro_batch_size) == (1e-4, 10, 2)
    assert cfg.optim.eps == 1e-5  # the rest of the recipe stays
    # the floor follows the overridden peak (10%), so a lower lr needs no min_lr override
    assert lr_floor(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.min_lr_ratio) == pytest.approx(1e-5)
    validate_config(cfg)
    low = composed("model=llama2_7b", "optim.lr=1e-5")
    validate_config(low)
    assert lr_floor(low.optim.lr, low.optim.min_lr, low.optim.min_lr_ratio) == pytest.approx(1e-6)
    # an absolute floor given on the command line wins over the recipe's ratio
    assert lr_floor(1e-4, composed("model=llama2_7b", "optim.min_lr=2e-6").optim.min_lr, 0.1) == 2e-6


@pytest.mark.parametrize("model", ["debug", "tiny"])
def test_the_cpu_models_floor_follows_their_lr_and_ratio(model):
    """debug and tiny had an absolute min_lr 1e-4 from their recipe: optim.lr=5e-5 was refused for a min_lr the
    user never set, and optim.min_lr_ratio did nothing."""
    low = composed(f"model={model}", "optim.lr=5e-5")
    validate_config(low)
    assert lr_floor(low.optim.lr, low.optim.min_lr, low.optim.min_lr_ratio) == pytest.approx(5e-6)
    o = composed(f"model={model}", "optim.min_lr_ratio=0.05").optim
    assert lr_floor(o.lr, o.min_lr, o.min_lr_ratio) == pytest.approx(5e-5)


def test_cfg_job_prints_the_presets_lr():
    # What `python train.py model=llama2_7b --cfg job` shows: a plain value, not an interpolation.
    text = OmegaConf.to_yaml(composed("model=llama2_7b"))
    assert "lr: 0.0003" in text and "warmup_steps: 2000" in text


@pytest.mark.parametrize("name", ["tiny", "debug", "llama2_7b", "llama3_70b"])
def test_default_batch_works_on_every_8_x_n_gpu_world(name):
    cfg = composed(f"model={name}")
    for n in range(1, 65):
        g = batch_geometry(cfg, 8 * n, announce=False)
        assert g.global_batch % (g.micro_batch * 8 * n) == 0 and g.accumulation >= 1
    if name.startswith("llama"):  # one sequence per micro-batch: 16 samples split exactly on 8 and 16 GPUs
        assert not batch_geometry(cfg, 16, announce=False).rounded


def test_batch_rounding_is_to_the_nearest_whole_micro_batch_and_can_be_an_error():
    cfg = composed("trainer.global_batch_size=100", "trainer.micro_batch_size=2")
    g = batch_geometry(cfg, 8, announce=False)
    assert (g.global_batch, g.accumulation, g.requested) == (96, 6, 100) and g.rounded
    assert batch_geometry(cfg, 64, announce=False).global_batch == 128  # at least one micro-batch per rank
    strict = composed("trainer.global_batch_size=100", "trainer.micro_batch_size=2", "trainer.round_global_batch=false")
    with pytest.raises(ValueError, match="not divisible"):
        batch_geometry(strict, 8)
    assert not batch_geometry(strict, 2).rounded


def test_a_warmup_the_run_never_finishes_is_said():
    """llama2_7b's 2000 warmup steps in the default 100-step run reach 5% of the peak and never decay: said
    at startup (it was silent), as is a warmup that leaves no decay; a sound schedule says nothing."""
    from amsp.optim import WarmupCosine

    (short,) = WarmupCosine(3e-4, 3e-5, warmup_steps=2000, decay_steps=100).shape_warnings(max_steps=100)
    assert "optim.warmup_steps=2000 > trainer.max_steps=100" in short and "(5% of optim.lr=0.0003)" in short
    (flat,) = WarmupCosine(1e-3, 1e-4, warmup_steps=50, decay_steps=40).shape_warnings(max_steps=60)
    assert "no cosine decay" in flat
    assert WarmupCosine(1e-3, 1e-4, warmup_steps=20, decay_steps=100).shape_warnings(max_steps=100) == []
