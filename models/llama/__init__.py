from .config import PRESETS, LlamaConfig, RopeScaling, get_preset
from .flops import flops_per_token
from .model import IGNORE_INDEX, Llama, build_model, lm_loss

__all__ = ["PRESETS", "LlamaConfig", "RopeScaling", "get_preset", "flops_per_token", "IGNORE_INDEX",
           "Llama", "build_model", "lm_loss"]
