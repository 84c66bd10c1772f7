"""Scale reparameterisation of a LayerNorm and the Linears it feeds: RepQ-ViT's fold of per-channel
post-LayerNorm quantizers, and SmoothQuant's migration of per-channel factors (`migrate_scales`).

For a LayerNorm output y (channels c) whose consumer's input quantizer was calibrated per channel with
(s_c, z_c) (zkkli/RepQ-ViT `classification/quant/quant_model.py`):

    s~ = mean_c s_c,  z~ = mean_c z_c (optionally rounded),  r_c = s_c / s~,  b_c = s~ (z~ - z_c)
    LayerNorm:  gamma'_c = gamma_c / r_c,   beta'_c = beta_c / r_c - b_c       (y'_c = y_c / r_c - b_c)
    Linear:     W'[:, c] = W[:, c] * r_c,   bias' = bias + W' b              (bias created if absent)

The float function is unchanged, and the input quantizer becomes per-tensor (s~, z~). Since
y'_c / s~ = y_c / s_c + (z_c - z~), an integer z~ makes the per-tensor codes equal the per-channel
codes exactly; RepQ-ViT's code keeps z~ unrounded (a grid shifted by frac(z~), same MSE to ~3 digits).
Afterwards the consumer's weight quantizer must be re-fitted on W' (see calibrate.refit_weight_quantizers).

Sites are (parent pattern, norm name, linear name) triples over FQNs, folded only in the module types they are
written for (pre-norm blocks, patch merging) and into an affine LayerNorm: the pipelines refuse any other before
any work (`check_fold_sites`; a post-norm block's norm1 does not feed attn.qkv, an RMSNorm has no bias, a module
at a block's place may lack the site's layers). Swin pads the norm1 output with zeros when a stage's grid is not a
multiple of its window (not the case for the shipped geometries); padded positions are not exactly folded, because
0 in y' stands for y = r * b in y. The pipelines refuse such a timm Swin before any work (fold_windows.py); a
detector's Swin pads at each image's own grid and is folded as the official detection code folds it
(quant/README.md).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from timm.models.swin_transformer import PatchMerging, SwinTransformerBlock
from timm.models.vision_transformer import Block

from .layers import QuantLinear
from .quantizers import UniformQuantizer
from models.gpt import Block as GPTBlock
from models.modules import fqn_matches


# A mean zero point this many code ranges (2^b) outside the codes, and at least 2^12, means a near-constant
# channel: the folded bias s~ (z~ - z_c) is then a difference of large numbers (float32 keeps 24 bits).
# Relative to 2^b because a 16-bit quantizer's zero points are legitimately ~2^16.
_MAX_MEAN_ZERO_POINT_RANGES = 2.0 ** 4
_MIN_ZERO_POINT_WARNING = 2.0 ** 12


def _mean_zero_point_limit(bits: int) -> float:
    return max(_MIN_ZERO_POINT_WARNING, _MAX_MEAN_ZERO_POINT_RANGES * 2.0 ** bits)


@dataclass(frozen=True)
class FoldSite:
    """A LayerNorm feeding one quantized Linear, both children of modules matching `parent`."""

    parent: str
    norm: str
    linear: str


# The LNs inside the blocks: norm1 -> qkv, norm2 -> fc1 (ViT, GPT-2 in models/gpt.py, Swin); SmoothQuant
# smooths these. RepQ-ViT also reparameterises Swin's PatchMerging norm -> reduction. Neither touches the
# final `norm` (feeds the head) or Swin's patch_embed.norm.
BLOCK_FOLD_SITES = (
    FoldSite("blocks.*", "norm1", "attn.qkv"),
    FoldSite("blocks.*", "norm2", "mlp.fc1"),
    FoldSite("layers.*.blocks.*", "norm1", "attn.qkv"),
    FoldSite("layers.*.blocks.*", "norm2", "mlp.fc1"),
    FoldSite("backbone.stages.*.blocks.*", "norm1", "attn.w_msa.qkv"),  # MMDetection's Swin (quant/spec.py)
    FoldSite("backbone.stages.*.blocks.*", "norm2", "ffn.layers.0.0"),
)
REPQ_FOLD_SITES = BLOCK_FOLD_SITES + (FoldSite("layers.*.downsample", "norm", "reduction"),
                                      FoldSite("backbone.stages.*.downsample", "norm", "reduction"))

# The modules the sites are written for, by exact type (a subclass may override forward): in each, the site's norm
# feeds its Linear and nothing else (pre-norm blocks: x + attn(norm1(x)), x + mlp(norm2(x)); patch merging: norm
# then reduction). A module of another type under the same names may not (timm's post-norm ResPostBlock computes
# x + norm1(attn(x))), and folding there changes the float function. MMDetection's by qualified name (an extra).
FOLD_PARENT_TYPES = (Block, SwinTransformerBlock, PatchMerging, GPTBlock)
FOLD_PARENT_TYPE_NAMES = ("mmdet.models.backbones.swin.SwinBlock", "mmdet.models.layers.transformer.utils.PatchMerging")


def _type_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def check_fold_sites(model: nn.Module, sites: Sequence[FoldSite], pipeline: str, bias: bool = True,
                     other_fix: Optional[str] = None) -> None:
    """Refuse a model whose fold sites the fold cannot take without changing its float function, before any work:
    a module at a site's place without the site's norm or Linear (a user's convolution block at blocks.*: refused
    here, as SmoothQuant smooths before any conversion), a site in a module that is not of a type the sites are
    written for (FOLD_PARENT_TYPES), or whose norm is not an nn.LayerNorm with a weight (and, with `bias`, a bias: the
    RepQ-ViT fold's shift lives there; SmoothQuant's migration scales the weight alone where there is none).

    Args:
        model: the float model, before conversion (or a converted one: the blocks stay as they are).
        sites: the fold sites the pipeline folds.
        pipeline: the pipeline's name, for the message.
        bias: the fold needs the norm's bias.
        other_fix: the pipeline's way around the fold (an option that turns it off), named last.

    Raises:
        ValueError: one line naming the first such site, what it holds and the fix.
    """
    fix = f"; or {other_fix}" if other_fix else ""
    for name, module in model.named_modules():
        for site in sites:
            if not fqn_matches(name, (site.parent,)) or isinstance(module, nn.Identity):
                continue
            where = f"{pipeline} folds {name}.{site.norm} into {name}.{site.linear}"
            known = ", ".join([f"{t.__module__}.{t.__qualname__}" for t in FOLD_PARENT_TYPES]
                              + list(FOLD_PARENT_TYPE_NAMES))
            try:
                norm, _ = module.get_submodule(site.norm), module.get_submodule(site.linear)
            except AttributeError:
                # a module at a block's place that is no such block (a user's convolution block): the fold would
                # fail on it (find_fold_sites) after the copy and, for SmoothQuant, before any conversion refused it
                lacks = " and ".join(path for path in (site.norm, site.linear) if not _has_submodule(module, path))
                raise ValueError(f"{where}, as in every {site.parent} of the modules it is written for ({known}); "
                                 f"{name} is a {_type_name(module)} without {lacks}: give the model such blocks at "
                                 f"{site.parent}{fix}") from None
            if type(module) not in FOLD_PARENT_TYPES and _type_name(module) not in FOLD_PARENT_TYPE_NAMES:
                raise ValueError(f"{where}, which keeps the float function only where the norm's output feeds that "
                                 f"Linear alone, as in the modules it is written for ({known}); {name} is a "
                                 f"{_type_name(module)}, whose {site.norm} may feed other layers (timm's post-norm "
                                 f"ResPostBlock normalises the attention's output, not its input){fix}")
            if not isinstance(norm, nn.LayerNorm):
                what = f"a {_type_name(norm)}"
            elif norm.weight is None or (bias and norm.bias is None):
                what = f"an nn.LayerNorm without {'a weight' if norm.weight is None else 'a bias'}"
            else:
                continue
            need = "an affine nn.LayerNorm (weight and bias)" if bias else "an nn.LayerNorm with a weight"
            raise ValueError(f"{where}, which rescales {need}; {name}.{site.norm} is {what} (give the model "
                             f"LayerNorms, e.g. without model.kwargs.norm_layer){fix}")


def find_fold_sites(model: nn.Module, sites: Sequence[FoldSite] = REPQ_FOLD_SITES
                    ) -> List[Tuple[str, nn.LayerNorm, str, QuantLinear]]:
    """(norm FQN, norm, linear FQN, linear) for every site present in `model`, in module order."""
    found = []
    for name, module in model.named_modules():
        for site in sites:
            if not fqn_matches(name, (site.parent,)):
                continue
            if isinstance(module, nn.Identity):  # timm Swin: layers.0.downsample is an Identity
                continue
            norm, linear = module.get_submodule(site.norm), module.get_submodule(site.linear)
            found.append((f"{name}.{site.norm}", norm, f"{name}.{site.linear}", linear))
    return found


@torch.no_grad()
def migrate_scales(norm: nn.LayerNorm, linears: Sequence[nn.Linear], scales: torch.Tensor,
                   bias_shift: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Divide the LayerNorm's output channels by `scales` and multiply the consuming Linears' input columns by
    them (in place, float64 arithmetic): norm -> linears computes the same function (SmoothQuant's
    `smooth_ln_fcs`, and the channel part of the RepQ-ViT fold).

    Args:
        norm: LayerNorm over C channels (its bias, if any, is scaled too).
        linears: every Linear that reads the norm's output, [out, C] weights.
        scales: [C] positive factors.
        bias_shift: [C] subtracted from the scaled norm bias in the same float64 expression (the fold's b).

    Returns:
        The new Linear weights in float64, in the order of `linears`.
    """
    scales = scales.double()
    norm.weight.copy_(norm.weight.double() / scales)
    if norm.bias is not None:
        bias = norm.bias.double() / scales
        norm.bias.copy_(bias if bias_shift is None else bias - bias_shift)
    new = []
    for linear in linears:
        new.append(linear.weight.double() * scales[None, :])
        linear.weight.copy_(new[-1])
        if hasattr(linear, "invalidate_weight_cache"):
            linear.invalidate_weight_cache()
    return new


@torch.no_grad()
def fold_layernorm(norm: nn.LayerNorm, linear: QuantLinear, round_zero_point: bool = False) -> None:
    """Fold `linear`'s per-channel input quantizer into `norm` and `linear` (in place, see module doc).

    Args:
        norm: affine LayerNorm over C channels whose output is `linear`'s input.
        linear: QuantLinear [out, C] with a calibrated per-last-dim UniformQuantizer on its input.
        round_zero_point: round the mean zero point to an integer (exact per-channel equivalence).
    """
    iq = linear.input_quantizer
    if not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None:
        raise TypeError(f"can only fold into an affine LayerNorm, got {type(norm).__name__}")
    if not isinstance(iq, UniformQuantizer) or iq.channel_dim != -1 or not iq.calibrated:
        raise ValueError(f"{iq.name if iq is not None else 'input'}: fold needs a calibrated per-channel "
                         "(last dim) uniform input quantizer")
    # float64 for the fold arithmetic: keeps the float function equal to ~1e-7 relative. The official code folds in
    # float32, so a folded parameter can differ from its in the last bit (quant/README.md, "Fold arithmetic").
    s_c, z_c = iq.scale.double(), iq.zero_point.double()
    z_t = torch.round(z_c.mean()) if round_zero_point else z_c.mean()
    # the folded quantizer stores s~, z~ in its own dtype: fold with exactly those values
    s_t = s_c.mean().to(iq.scale.dtype).double()
    z_t = z_t.to(iq.zero_point.dtype).double()
    if z_t.abs() > _mean_zero_point_limit(iq.bits):
        warnings.warn(f"{iq.name}: mean zero point {z_t.item():.3g} after the LayerNorm fold; the folded "
                      "biases (s~ (z~ - z_c)) lose float precision. A near-constant channel? Quantizer "
                      "ranges are widened to include 0 for those, so this should not happen.", RuntimeWarning)
    r = s_c / s_t
    b = s_t * (z_t - z_c)

    w_new, = migrate_scales(norm, [linear], r, bias_shift=b)
    shift = w_new @ b
    if linear.bias is None:  # Swin's PatchMerging reduction has no bias
        linear.bias = nn.Parameter(shift.to(linear.weight.dtype), requires_grad=linear.weight.requires_grad)
    else:
        linear.bias.copy_(linear.bias.double() + shift)

    iq.channel_dim = None
    iq.set_params(s_t.reshape(1), z_t.reshape(1))
    linear.invalidate_weight_cache()
