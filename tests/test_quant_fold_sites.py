"""The LayerNorm folds (RepQ-ViT's, APHQ's where a_bits == w_bits, SmoothQuant's migration) take only what they are
written for (quant/reparam.py check_fold_sites): a site in a pre-norm block or patch merging of a known type, whose
norm is an affine nn.LayerNorm. A fold done by hand (written out here) keeps every such model's float output; in a
post-norm block (timm's ResPostBlock) it moves it, and an RMSNorm has no bias to fold into: such models are refused
before any work, by the pipelines and by evaluate.py's model check (quant.plan.check_model_converts)."""
import copy

import pytest
import torch
from timm.models.vision_transformer import ResPostBlock

from configs import ConfigError
from models.attention_sinks import use_sink_attention
from models.gpt import GPT
from quant.registry import PIPELINES
from quant.reparam import BLOCK_FOLD_SITES, REPQ_FOLD_SITES, check_fold_sites
from quant_models import digits_config, images, perturb_norms, tiny_swin, tiny_vit

FOLDING = ("repq", "aphq", "smoothquant")


def sites_by_name(model, sites):
    """(norm, linear) module pairs for every site whose layers exist, found by FQN alone (no type check)."""
    from models.modules import fqn_matches
    found = []
    for name, module in model.named_modules():
        for site in sites:
            if fqn_matches(name, (site.parent,)) and not isinstance(module, torch.nn.Identity):
                found.append((module.get_submodule(site.norm), module.get_submodule(site.linear)))
    return found


@torch.no_grad()
def fold_by_hand(model, sites, seed: int = 3):
    """A copy of `model` with every site folded as RepQ-ViT folds (float64): y' = y / r - b in the norm's affine,
    W' = W r and bias' = bias + W' b in the Linear, r > 0 and b random."""
    model = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(seed)
    pairs = sites_by_name(model, sites)
    assert pairs
    for norm, linear in pairs:
        r = torch.rand(norm.weight.shape, generator=g, dtype=torch.float64) * 3 + 0.1
        b = torch.randn(norm.weight.shape, generator=g, dtype=torch.float64)
        norm.weight.div_(r)
        norm.bias.copy_(norm.bias / r - b)
        linear.weight.mul_(r)
        if linear.bias is None:  # Swin's PatchMerging reduction
            linear.bias = torch.nn.Parameter(torch.zeros(linear.weight.shape[0], dtype=torch.float64))
        linear.bias.add_(linear.weight @ b)
    return model


def vit_post_norm():
    return perturb_norms(tiny_vit(block_fn=ResPostBlock))


SUPPORTED = {
    "vit": lambda: perturb_norms(tiny_vit()),
    "vit_layer_scale": lambda: perturb_norms(tiny_vit(init_values=0.5)),
    "vit_kv_bias": lambda: perturb_norms(_sinks(tiny_vit(), "kv_bias")),
    "swin": lambda: perturb_norms(tiny_swin()),
    "swin_attn_bias": lambda: perturb_norms(_sinks(tiny_swin(), "attn_bias")),
}


def _sinks(model, attn):
    use_sink_attention(model, attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".sink_" in name:
                p.normal_()
    return model.eval()


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_every_supported_model_passes_and_keeps_its_float_output_under_a_fold(name):
    model = SUPPORTED[name]()
    check_fold_sites(model, REPQ_FOLD_SITES, "repq")
    check_fold_sites(model, BLOCK_FOLD_SITES, "smoothquant", bias=False)
    x = images(4)
    reference = model.double()(x.double())
    folded = fold_by_hand(model, REPQ_FOLD_SITES)(x.double())
    torch.testing.assert_close(folded, reference, rtol=0, atol=1e-9 * reference.abs().max().item())


def test_gpt_blocks_pass_and_keep_their_float_output_under_a_fold():
    torch.manual_seed(0)
    model = perturb_norms(GPT(vocab_size=50, context=16, depth=2, num_heads=2, embed_dim=32).eval())
    check_fold_sites(model, BLOCK_FOLD_SITES, "smoothquant", bias=False)
    tokens = torch.randint(0, 50, (2, 16))
    reference = copy.deepcopy(model).double()(tokens)
    torch.testing.assert_close(fold_by_hand(model, BLOCK_FOLD_SITES)(tokens), reference, rtol=0,
                               atol=1e-9 * reference.abs().max().item())


def test_a_post_norm_block_moves_under_a_fold_and_is_refused():
    """The premise, by hand: timm's ResPostBlock computes x + norm1(attn(x)), so norm1 does not feed attn.qkv and
    the fold moves the output far beyond rounding; check_fold_sites refuses it, naming the block's type."""
    model = vit_post_norm()
    x = images(4).double()
    reference = copy.deepcopy(model).double()(x)
    moved = (fold_by_hand(model, REPQ_FOLD_SITES)(x) - reference).abs().max().item()
    assert moved > 1e-2 * reference.abs().max().item()
    with pytest.raises(ValueError, match=r"^repq folds blocks.0.norm1 into blocks.0.attn.qkv, which keeps the float "
                                         r"function only where the norm's output feeds that Linear alone, .*; "
                                         r"blocks.0 is a timm.models.vision_transformer.ResPostBlock, "):
        check_fold_sites(model, REPQ_FOLD_SITES, "repq")


@pytest.mark.parametrize("pipeline", FOLDING)
def test_the_folding_pipelines_refuse_a_post_norm_vit_before_any_work(pipeline, monkeypatch):
    monkeypatch.setattr(type(PIPELINES[pipeline]), "run", lambda *a, **k: pytest.fail("run reached"))
    bits = "w8a8" if pipeline == "smoothquant" else "w4a4"
    with pytest.raises(ValueError, match=rf"^{pipeline} folds blocks.0.norm1 into blocks.0.attn.qkv, .*ResPostBlock"):
        PIPELINES[pipeline](vit_post_norm(), images(4), bits)


class ConvBlock(torch.nn.Module):
    """A user's block at a transformer block's place: a convolution and a Linear, no norm1 -> attn.qkv."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv, self.fc = torch.nn.Conv2d(dim, dim, 1), torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(x)


@pytest.mark.parametrize("pipeline", FOLDING)
def test_the_folding_pipelines_refuse_a_block_without_the_fold_layers_before_any_work(pipeline, monkeypatch):
    """A module at blocks.* without norm1 / attn.qkv: one ValueError naming the block, its type and what it lacks,
    before any work, not an AttributeError of the fold (SmoothQuant smooths before it converts, so no conversion
    refused it first)."""
    monkeypatch.setattr(type(PIPELINES[pipeline]), "run", lambda *a, **k: pytest.fail("run reached"))
    model = tiny_vit(depth=2)
    model.blocks[1] = ConvBlock(model.blocks[0].norm1.normalized_shape[0])
    bits = "w8a8" if pipeline == "smoothquant" else "w4a4"
    with pytest.raises(ValueError, match=rf"^{pipeline} folds blocks.1.norm1 into blocks.1.attn.qkv, .*; blocks.1 is a "
                                         r"\S*ConvBlock without norm1 and attn.qkv: give the model "
                                         r"such blocks at blocks.\*"):
        PIPELINES[pipeline](model, images(4), bits)


def rms_vit():
    return tiny_vit(norm_layer="rmsnorm")


@pytest.mark.parametrize("pipeline", FOLDING)
def test_the_folding_pipelines_refuse_an_rmsnorm_vit_before_any_work(pipeline, monkeypatch):
    """timm's RmsNorm has no bias for the fold's shift (nor is it a LayerNorm for SmoothQuant's migration): one
    ValueError naming the norm's type, not a TypeError / AttributeError after the calibration."""
    monkeypatch.setattr(type(PIPELINES[pipeline]), "run", lambda *a, **k: pytest.fail("run reached"))
    bits = "w8a8" if pipeline == "smoothquant" else "w4a4"
    with pytest.raises(ValueError, match=rf"^{pipeline} folds blocks.0.norm1 into blocks.0.attn.qkv, which rescales "
                                         r"an (affine )?nn.LayerNorm.*; blocks.0.norm1 is a timm.layers.norm.RmsNorm"):
        PIPELINES[pipeline](rms_vit(), images(4), bits)


def test_without_a_fold_an_rmsnorm_vit_is_taken():
    """RepQ-ViT with reparam=False and APHQ at a_bits != w_bits fold nothing: the norm type does not matter."""
    from configs.quant import APHQOptions, RepQOptions
    from quant.spec import Bits

    PIPELINES["repq"].check_folds(rms_vit(), Bits(4, 4), RepQOptions(reparam=False))
    PIPELINES["aphq"].check_folds(rms_vit(), Bits(4, 8), APHQOptions())
    qmodel, report = PIPELINES["repq"](rms_vit(), images(8), "w4a4", {"reparam": False})
    assert report["folded"] == []


@pytest.mark.parametrize("pipeline", FOLDING)
def test_evaluate_refuses_an_rmsnorm_vit_naming_model_name_before_its_float_pass(pipeline):
    from models import build_model
    from quant.plan import check_model_converts

    cfg = digits_config("vit_nano", "model.kwargs.norm_layer=rmsnorm", f"quant.pipelines=[{pipeline}]")
    with pytest.raises(ConfigError, match=rf"^model.name=vit_nano: {pipeline} w\da\d cannot quantize it: {pipeline} "
                                          r"folds blocks.0.norm1 .*RmsNorm"):
        check_model_converts(build_model(cfg.model), cfg)
    cfg = digits_config("vit_nano", f"quant.pipelines=[{pipeline}]")
    check_model_converts(build_model(cfg.model), cfg)


def test_a_detectors_swin_passes():
    """MMDetection's SwinBlock and PatchMerging (by qualified name: mmdet is an extra) are fold sites' modules."""
    pytest.importorskip("mmdet")
    from cd.families import import_mmdet_swin
    import_mmdet_swin()  # a stand-in for mmcv's compiled ops under mmcv-lite
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmdet.registry import MODELS
    init_default_scope("mmdet")
    torch.manual_seed(0)
    detector = MODELS.build(Config.fromfile("configs/detection/debug/mask_rcnn_swin_sample.py").model).eval()
    from quant.reparam import find_fold_sites
    assert any(norm.endswith("downsample.norm") for norm, _, _, _ in find_fold_sites(detector, REPQ_FOLD_SITES))
    check_fold_sites(detector, REPQ_FOLD_SITES, "repq")
