"""Model construction on timm (ViT, DeiT, Swin and small variants) and GPT-2 (models/gpt.py); knows
nothing of cd/ or quant/.

    from models import build_model
    model = build_model(cfg.model)
"""
from .factory import ModelError, build_model, describe, input_size, is_language_model, model_input_size, model_label
from .pretrained import load_pretrained
from .variants import VARIANTS

__all__ = ["build_model", "describe", "input_size", "is_language_model", "load_pretrained", "model_input_size",
           "model_label", "ModelError", "VARIANTS"]
