"""Swin blocks whose LayerNorm fold would change the float function: windows padded after norm1.

timm's `SwinTransformerBlock._attn` zero-pads the norm1 output to whole windows (F.pad, before attn.qkv) when a
stage's token grid is not a multiple of its window. The RepQ-ViT fold (reparam.fold_layernorm) makes the
LayerNorm emit y'_c = y_c / r_c - b_c, so a padded zero in y' stands for y_c = r_c b_c, not for 0: the padded
tokens' keys and values change, and with them the attention of the real tokens in those windows. At a model's
input size the grids are fixed, so such a model is refused before any work (`check_fold_windows`); every
shipped geometry (32 px Swin variants with windows of 4, Swin-T at 224 with windows of 7) is whole windows.

SmoothQuant's migration (reparam.migrate_scales) divides by the scales only and maps 0 to 0: padding keeps it
exact. MMDetection's Swin (`ShiftWindowMSA`) pads the same way, at every image's own grid, so a detector's
geometry is not known before its images; its fold is left as the official detection code does it (see
quant/README.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from timm.models.swin_transformer import SwinTransformerBlock
from torch import nn

from models.modules import fqn_matches

from .reparam import REPQ_FOLD_SITES, FoldSite


@dataclass(frozen=True)
class PaddedWindows:
    """A Swin block whose folded norm1 output is zero-padded from `grid` to whole `window`s."""

    block: str  # FQN of the SwinTransformerBlock
    grid: Tuple[int, int]  # its token grid (H, W) at the model's input size
    window: Tuple[int, int]

    @property
    def padded(self) -> Tuple[int, int]:
        return tuple(-(-g // w) * w for g, w in zip(self.grid, self.window))


def padded_fold_windows(model: nn.Module, sites: Sequence[FoldSite] = REPQ_FOLD_SITES) -> List[PaddedWindows]:
    """The timm Swin blocks (in module order) whose norm1 is a fold site in `sites` and whose token grid at the
    model's input size (the block's `input_resolution`) is not a multiple of its window."""
    # only norm1 feeds the padded windows (norm2 -> fc1 sees the unpadded tokens, and PatchMerging pads before its
    # norm); the blocks are found by name and type alone, not through find_fold_sites, which looks up every site's
    # layers: a model whose blocks lack one (a SwiGLU MLP has no fc1) is the conversion's to refuse, in its words
    parents = tuple(site.parent for site in sites if site.norm == "norm1")
    found = []
    for block_name, block in model.named_modules():
        if not isinstance(block, SwinTransformerBlock) or not fqn_matches(block_name, parents):
            continue
        grid, window = tuple(block.input_resolution), tuple(block.window_size)
        if any(g % w for g, w in zip(grid, window)):
            found.append(PaddedWindows(block_name, grid, window))
    return found


def _stage(model: nn.Module, block: str) -> Tuple[str, Optional[int]]:
    """(name, downsampling factor) of the stage holding `block`, from timm's feature_info; else (block, None)."""
    for info in getattr(model, "feature_info", None) or ():
        if block.startswith(f"{info['module']}."):
            return info["module"], info["reduction"]
    return block, None


def _whole_windows_size(model: nn.Module, padded: Sequence[PaddedWindows]) -> Optional[int]:
    """The least common multiple of (stage downsampling x window) over the blocks that pad: an input side that is a
    multiple of it gives each of them whole windows. None where a stage's factor is unknown."""
    multiple = 1
    for entry in padded:
        factor = _stage(model, entry.block)[1]
        if factor is None:
            return None
        for window in entry.window:
            multiple = math.lcm(multiple, factor * window)
    return multiple


def _grid(shape: Sequence[int]) -> str:
    return " x ".join(str(s) for s in shape)


def check_fold_windows(model: nn.Module, pipeline: str, other_fix: Optional[str] = None,
                       sites: Sequence[FoldSite] = REPQ_FOLD_SITES) -> None:
    """Refuse a Swin whose folded norm1 output would be zero-padded at the model's input size (module doc).

    Args:
        model: the float model, before conversion (or a converted one: the blocks stay timm's).
        pipeline: the pipeline's name, for the message.
        other_fix: the pipeline's way around the fold (an option that turns it off), named after the input size.
        sites: the fold sites the pipeline folds.

    Raises:
        ValueError: one line naming the input size, the first padded stage's grid and windows, and the fix.
    """
    padded = padded_fold_windows(model, sites)
    if not padded:
        return
    first = padded[0]
    stage = _stage(model, first.block)[0]
    others = {}
    for entry in padded[1:]:
        name = _stage(model, entry.block)[0]
        if name != stage and name not in others:
            others[name] = f"{name}: {_grid(entry.grid)} -> {_grid(entry.padded)}"
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    where = f"an input of {_grid(size)} pixels (model.img_size)" if size is not None else "the model's input size"
    multiple = _whole_windows_size(model, padded)
    if multiple is not None and size is not None:
        below, above = max(size) // multiple * multiple, -(-max(size) // multiple) * multiple
        examples = " or ".join(str(s) for s in dict.fromkeys(s for s in (below, above) if s > 0))
        fix = f"give model.img_size a multiple of {multiple} (e.g. {examples})"
    else:
        fix = "give model.img_size at which every stage's token grid is a multiple of its window"
    also = f" (also {'; '.join(others.values())})" if others else ""
    raise ValueError(f"{pipeline} folds each Swin block's norm1 into attn.qkv, which keeps the float function only "
                     f"on whole windows: at {where}, {stage}'s {_grid(first.grid)} token grid is zero-padded to "
                     f"{_grid(first.padded)} for its {_grid(first.window)} windows{also}, and a padded zero after "
                     f"the fold is not the LayerNorm's zero, so the real tokens' attention would change; {fix}"
                     + (f", or {other_fix}" if other_fix else ""))
