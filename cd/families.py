"""Which model families CD understands: tiny configs of each, and what `find_pairs` makes of them.

    python -m cd --families          # the CD columns; scripts/cd_families.py adds quantization's

Each timm family is built from its timm name with a tiny config (32 px, width 32, 1-2 blocks per stage), on
the CPU in milliseconds and without downloads; the blocks and pairs are those of the full-size model
(the same classes, fewer of them). Needs timm; the rows of transformers', MMDetection's and torchvision's models
need those libraries (`pip install .[hf]`; mmdet), and say so when they are missing.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from collections import Counter
from typing import Callable

from torch import nn

from .pairs import ROLES, find_pairs
from .verify import UnsupportedModelError

_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)
_SWIN = dict(img_size=32, patch_size=2, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
             num_classes=3)

# family -> (timm name, tiny-config overrides)
FAMILIES: dict[str, tuple[str, dict]] = {
    "vit": ("vit_tiny_patch16_224", _VIT),
    "deit (distilled)": ("deit_tiny_distilled_patch16_224", _VIT),
    "deit3": ("deit3_small_patch16_224", _VIT),
    "dinov2": ("vit_small_patch14_dinov2", _VIT),
    "dinov2 + registers": ("vit_small_patch14_reg4_dinov2", _VIT),
    "swin": ("swin_tiny_patch4_window7_224", _SWIN),
    "swinv2": ("swinv2_tiny_window8_256", _SWIN),
    "eva02": ("eva02_tiny_patch14_224", _VIT),
    "beit": ("beit_base_patch16_224", _VIT),
    "cait": ("cait_xxs24_224", dict(_VIT, depth=1)),
    "xcit": ("xcit_nano_12_p16_224", dict(_VIT, depth=1)),
    "SwiGLU ViT (aimv2)": ("aimv2_large_patch14_224", _VIT),
    "convnext": ("convnext_atto", dict(num_classes=3)),
}


def _gpt2() -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0))


def _nanogpt() -> nn.Module:
    from .family_nanogpt import NanoGPTShaped

    return NanoGPTShaped()


def _hf_vit() -> nn.Module:
    import transformers

    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
        patch_size=8, num_labels=3))


def _llama(kv_heads: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
            intermediate_size=64, vocab_size=64, max_position_embeddings=16))
    return build


def _mmdet_swin() -> nn.Module:
    import torch

    model = import_mmdet_swin()(pretrain_img_size=32, embed_dims=32, depths=(2, 2), num_heads=(2, 4),
                                window_size=4, patch_size=2, strides=(2, 2), out_indices=(0, 1))
    model.example_input = lambda: torch.zeros(1, 3, 32, 32)  # the size of an image (mmdet's Swin has none)
    return model


def _tv_vit() -> nn.Module:
    import torchvision

    # its input size is read off `image_size` and `conv_proj` (cd.verify.example_input)
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=32, mlp_dim=64, num_classes=3)


def _tv_swin() -> nn.Module:
    import torch
    import torchvision

    model = torchvision.models.SwinTransformer(patch_size=[2, 2], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                               window_size=[4, 4], num_classes=3)
    model.example_input = lambda: torch.zeros(1, 3, 32, 32)
    return model


# family -> (model as the table names it, tiny builder): other libraries' Transformers (LAYOUTS in cd/pairs.py)
OTHER_FAMILIES: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "GPT-2 (transformers)": ("transformers `GPT2LMHeadModel`", _gpt2),
    "GPT-2, nanoGPT-style (nn.Linear c_attn)": ("`cd.family_nanogpt.NanoGPTShaped` (nanoGPT's `GPT`, tiny)", _nanogpt),
    "ViT (transformers)": ("transformers `ViTForImageClassification`", _hf_vit),
    "Llama, multi-head attention (transformers)": ("transformers `LlamaForCausalLM`", _llama(4)),
    "Llama, grouped-query attention (transformers)": ("transformers `LlamaForCausalLM`", _llama(2)),
    "Swin (MMDetection)": ("mmdet `SwinTransformer` (backbone)", _mmdet_swin),
    "ViT (torchvision)": ("torchvision `VisionTransformer`", _tv_vit),
    "Swin (torchvision)": ("torchvision `SwinTransformer`", _tv_swin),
}


def build_family(family: str) -> nn.Module:
    """The tiny model of `family` (random weights), in eval mode."""
    if family in OTHER_FAMILIES:
        model = OTHER_FAMILIES[family][1]()
        model.eval()  # (mmdet's Swin's train() returns None)
        return model
    import timm  # optional dependency of cd: only this module needs it

    name, kwargs = FAMILIES[family]
    return timm.create_model(name, pretrained=False, **kwargs).eval()


def describe_pairs(model: nn.Module) -> str:
    """Pairs per block by role, e.g. 'Block (x2): qkv, proj, fc1, fc2', or 'refused: <reason>'; for a
    model refused for its gated MLPs, also what `gated_mlp=True` finds."""
    try:
        return _pairs_by_block(model, gated_mlp=False)
    except UnsupportedModelError as e:
        refused = "refused: " + str(e).split(". ")[0]
    try:
        return f"{refused}. With cd.gated_mlp=true: {_pairs_by_block(model, gated_mlp=True)}"
    except (UnsupportedModelError, ValueError):  # ValueError: a model with no gated MLP refuses the switch itself
        return refused


def _pairs_by_block(model: nn.Module, gated_mlp: bool) -> str:
    pairs = find_pairs(model, gated_mlp=gated_mlp)
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    per_block: dict[str, Counter] = {}
    for p in pairs:
        per_block.setdefault(p.block, Counter())[p.role] += 1
    by_type: dict[tuple[str, str], int] = Counter()
    for block, roles in per_block.items():
        text = ", ".join(f"{r} x{roles[r]}" if roles[r] > 1 else r for r in ROLES if roles[r])
        by_type[(types[block], text)] += 1
    return "; ".join(f"{t} (x{n}): {text}" for (t, text), n in by_type.items())


def family_table(columns: dict[str, Callable[[nn.Module], str]] | None = None) -> str:
    """A markdown table: family, model, CD pairs, then one column per extra `columns` entry (timm families;
    the other libraries' rows read "not run" there). A library that is not installed is named in its rows."""
    columns = columns or {}
    lines = ["| family | model | CD pairs per block, by role | " + " | ".join(columns) + " |"
             if columns else "| family | model | CD pairs per block, by role |"]
    lines.append("|" + "---|" * (3 + len(columns)))
    rows = [(family, f"timm `{name}`", True) for family, (name, _) in FAMILIES.items()]
    rows += [(family, label, False) for family, (label, _) in OTHER_FAMILIES.items()]
    for family, label, timm_model in rows:
        try:
            model = build_family(family)
        except ImportError as e:
            cells = [family, label, f"not checked: {e.name or e} is not installed"] + ["not run"] * len(columns)
        else:
            cells = [family, label, describe_pairs(model)] + [
                fn(model) if timm_model else "not run" for fn in columns.values()]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


class _NoCompiledOps(types.ModuleType):
    """Stands in for mmcv's compiled ops (`mmcv._ext`) under mmcv-lite: every op raises when called."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def op(*args, **kwargs):
            raise RuntimeError(f"mmcv op {name} needs mmcv's compiled ops (full mmcv, not mmcv-lite)")
        return op


def import_mmdet_swin() -> type:
    """MMDetection's Swin backbone class (importing mmdet also registers its models).

    mmdet imports mmcv's compiled ops when it is imported. mmcv-lite, the pure-Python build that the tests
    install (full mmcv builds its ops from source, for about 20 minutes here), has none: then a stand-in
    `mmcv._ext` whose every op raises is registered first. The Swin backbone calls none of them, so it builds and
    runs as MMDetection's own code. With full mmcv nothing is replaced.
    """
    try:
        importlib.import_module("mmcv._ext")
    except ImportError:
        stub = _NoCompiledOps("mmcv._ext")
        stub.__spec__ = importlib.machinery.ModuleSpec("mmcv._ext", None)  # looked up by pkgutil
        sys.modules.setdefault("mmcv._ext", stub)
    from mmdet.models.backbones.swin import SwinTransformer

    return SwinTransformer
