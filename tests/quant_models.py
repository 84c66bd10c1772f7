"""Tiny timm models and inputs shared by the quant/ tests (CPU, seconds)."""
from __future__ import annotations

import timm
import torch
from torch import nn


def tiny_vit(seed: int = 0, depth: int = 2, **kwargs) -> nn.Module:
    """ViT with 16 patch tokens + cls, width 48, 3 heads (timm's fused-SDPA Attention)."""
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=48, depth=depth,
                             num_heads=3, num_classes=10, **kwargs).eval()


def tiny_swin(seed: int = 0) -> nn.Module:
    """Swin with two stages (16x16 then 8x8 tokens, window 4, shifted windows in odd blocks, PatchMerging)."""
    torch.manual_seed(seed)
    return timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4,
                             embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10).eval()


def images(n: int = 8, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g)


def perturb_norms(model: nn.Module, seed: int = 2) -> nn.Module:
    """Give every LayerNorm non-trivial affine parameters (fresh timm inits are 1 / 0, which hides fold bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) * 2.0 + 0.2)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return model
