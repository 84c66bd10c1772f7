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


def same_state(a: dict, b: dict) -> bool:
    """Two state dicts hold the same keys and bit-identical values (a pipeline's options that change nothing)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def perturb_norms(model: nn.Module, seed: int = 2) -> nn.Module:
    """Give every LayerNorm non-trivial affine parameters
    (fresh timm inits are 1 / 0, which hides fold bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) * 2.0 + 0.2)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return model


def digits_config(model_name: str, *overrides: str):
    """The digits demo config (RGB 32 px, eval transform = resize + normalize)
    for a models/variants.py name."""
    import os

    from configs import load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_config([os.path.join(root, "configs", "demo", "vit_digits.yaml")],
                       [f"model.name={model_name}", "model.drop_path=0.0", *overrides])


def train_on_digits(model_name: str, steps: int = 300, lr: float = 3e-3, seed: int = 0):
    """A models/variants.py model trained on digits with a plain AdamW loop (seconds on one thread).

    Trains on the eval-transform tensors of the train split (no augmentation: fast and deterministic).

    Returns:
        (model in eval mode, cfg, val images [360, 3, 32, 32], val labels [360]).
    """
    import torch.nn.functional as F

    from data import build_dataset
    from models import build_model

    cfg = digits_config(model_name)
    train = build_dataset(cfg.data, "train", 32, 10, train_transform=False)
    val = build_dataset(cfg.data, "val", 32, 10, train_transform=False)
    x = torch.stack([train[i][0] for i in range(len(train))])
    y = torch.tensor(train.targets)
    xv = torch.stack([val[i][0] for i in range(len(val))])
    yv = torch.tensor(val.targets)
    torch.manual_seed(seed)
    model = build_model(cfg.model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster, and CI machines are shared
    try:
        for _ in range(steps):
            idx = torch.randint(len(y), (64,), generator=g)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), cfg, xv, yv


def top1(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return 100.0 * (model(x).argmax(1) == y).float().mean().item()


class ImageFeed:
    """A `quant.units.SampleFeed` of images of different sizes, one per batch, as a detector's: `run` calls
    `model.forward_image(image)` when the model has it (a toy detector's RPN), else `model(image)`."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def run(self, model, i):
        forward = getattr(model, "forward_image", model)
        return forward(self.images[i])

    def rpn_outputs(self, model, i):
        return model.forward_image(self.images[i])


def unread_samples(count: int, seed: int) -> list:
    """A PipelineData.detector_samples provider for a GPLQ run that ends in stage 1: QwT's stage-2 images are drawn
    before stage 1 (draw_detector_samples holds them to the count asked) and never read."""
    return [None] * count
