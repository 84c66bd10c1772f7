"""Model construction on timm (ViT, DeiT, Swin and small variants); knows nothing of cd/ or quant/.

    from models import build_model
    model = build_model(cfg.model)
"""
from .factory import ModelError, build_model, describe, input_size, model_label
from .pretrained import load_pretrained
from .variants import VARIANTS

__all__ = ["build_model", "describe", "input_size", "load_pretrained", "model_label", "ModelError",
           "VARIANTS"]
