from .config import PRESETS, LlamaConfig, RopeScaling, get_preset
from .flops import flops_per_token

# The model code (and torch) loads on first use, so the config alone (the planner's CLI, Hydra
# schemas) imports in milliseconds.
_MODEL_NAMES = ("IGNORE_INDEX", "Llama", "build_model", "lm_loss")


def __getattr__(name):
    if name in _MODEL_NAMES:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["PRESETS", "LlamaConfig", "RopeScaling", "get_preset", "flops_per_token", "IGNORE_INDEX",
           "Llama", "build_model", "lm_loss"]
