"""Whether a model's feature width leaves GPLQ's PCA settings anything to choose.

The teacher PCA keeps the smallest multiple of `pca_multiple` components that reaches `pca_variance`, at least one
multiple and at most the width D of the penultimate features (pca.py `components_from_moments`). Where D is no more
than `pca_multiple`, that count is D whatever the target (vit_nano: width 32, multiple 32, "PCA 32 dims (100.0%
variance)"): the PCA loss is then a plain feature MSE. A setting the caller chose that leads there is refused before
any work (`GPLQPipeline.check_model_options`, which evaluate.py reaches through quant.plan.check_model_converts): a
chosen `pca_multiple` (the cause, whatever `pca_variance` says), else a chosen `pca_variance` (with the default
multiple).

Chosen means a value other than the default: the check sees the options as a dataclass, which cannot say whether
its default was named (as pca_images.py for a dataclass). So the default pca_multiple (32) is never refused: on
features no wider than it (vit_nano's 32) it keeps every component, as it always has, and the default settings
take any model.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from configs.quant import GPLQOptions

DEFAULT_PCA_VARIANCE = GPLQOptions().pca_variance
DEFAULT_PCA_MULTIPLE = GPLQOptions().pca_multiple


def feature_width(model: nn.Module) -> Optional[int]:
    """The width of timm's pre-logits features (what pca.py `penultimate` returns), or None for a model that does not
    say it (the PCA then caps its count at whatever width it meets)."""
    width = getattr(model, "head_hidden_size", None) or getattr(model, "num_features", None)
    return width if isinstance(width, int) and width > 0 else None


def pca_settings_unread(model: nn.Module, options: GPLQOptions) -> Optional[str]:
    """The refusal of a chosen `options.pca_multiple` (or, with the default multiple, `options.pca_variance`) where
    `model`'s feature width makes the PCA keep every component whatever the target; None where the target is read,
    the PCA is never fitted (no update, or no PCA loss), the width is unknown or both settings are the defaults."""
    if options.pca_weight == 0 or options.steps == 0:
        return None
    width = feature_width(model)
    if width is None or width > options.pca_multiple:
        return None
    if options.pca_multiple != DEFAULT_PCA_MULTIPLE:
        default = (f"the default {DEFAULT_PCA_MULTIPLE}" if width > DEFAULT_PCA_MULTIPLE else
                   f"the default {DEFAULT_PCA_MULTIPLE}, which keeps all {width} too but is not refused: the "
                   "method's own setting")
        return (f"quant.gplq.pca_multiple={options.pca_multiple} keeps every component: the model's penultimate "
                f"features have {width} dims, no more than it, so the teacher PCA keeps all {width} whatever "
                f"quant.gplq.pca_variance={options.pca_variance} asks, and its loss is a plain feature MSE; give "
                f"quant.gplq.pca_multiple below {width}, or drop it for {default}")
    if options.pca_variance == DEFAULT_PCA_VARIANCE:
        return None
    return (f"quant.gplq.pca_variance={options.pca_variance} would be ignored: the model's penultimate features have "
            f"{width} dims, no more than quant.gplq.pca_multiple={options.pca_multiple}, so the teacher PCA keeps all "
            f"{width} whatever the explained-variance target; drop it (the default {DEFAULT_PCA_VARIANCE} passes), or "
            f"give quant.gplq.pca_multiple below {width}")
