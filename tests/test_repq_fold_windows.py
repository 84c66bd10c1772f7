"""RepQ-ViT's LayerNorm fold on a Swin keeps the float function only where norm1's output fills whole windows
(quant/fold_windows.py): timm zero-pads it to whole windows before attn.qkv, and after the fold a padded zero is
not the LayerNorm's zero. Every shipped Swin geometry keeps the float output of the unfolded model; a padded one
is refused before any work, by the pipelines and by evaluate.py's model check."""
import copy

import pytest
import timm
import torch

from configs import ConfigError
from models.variants import VARIANTS
from quant.modes import quant_state
from quant.registry import PIPELINES
from quant_models import digits_config, perturb_norms


def swin(img_size: int, name: str = "swin_micro", seed: int = 0, **overrides) -> torch.nn.Module:
    """A models/variants.py Swin (timm) at `img_size`, its LayerNorms given non-trivial affine parameters."""
    kwargs = dict(VARIANTS[name], img_size=img_size, num_classes=10, **overrides)
    torch.manual_seed(seed)
    return perturb_norms(timm.create_model(kwargs.pop("arch"), **kwargs).eval())


def swin_t_geometry() -> torch.nn.Module:
    """Swin-T's geometry (configs/pretrain/swin_t.yaml: 224 px, patches of 4, windows of 7, grids 56/28/14/7) at a
    width and depth that calibrate in seconds; two blocks per stage, so every stage has a shifted block."""
    torch.manual_seed(0)
    return perturb_norms(timm.create_model("swin_tiny_patch4_window7_224", embed_dim=24, depths=(2, 2, 2, 2),
                                           num_heads=(1, 2, 4, 8), num_classes=10).eval())


def inputs(size: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def float_output_after_fold(model: torch.nn.Module, size: int, **options) -> tuple:
    """(the original model's output, the RepQ model's output with every quantizer off) on held-out images."""
    x = inputs(size, 4, seed=5)
    with torch.no_grad():
        reference = model(x)
    qmodel, report = PIPELINES["repq"](model, inputs(size, 8, seed=4), "w4a4", options)
    with torch.no_grad(), quant_state(qmodel, weights=False, activations=False):
        return reference, qmodel(x), report


@pytest.mark.parametrize("build, size", [
    (lambda: swin(32, "swin_micro"), 32),  # configs/demo/swin_digits.yaml: grids 16 / 8 / 4, windows of 4
    (lambda: swin(32, "swin_nano"), 32),  # the tests' Swin: grids 8 / 4, windows of 4
    (swin_t_geometry, 224),  # configs/pretrain/swin_t.yaml
], ids=["swin_micro_32", "swin_nano_32", "swin_t_224"])
def test_the_fold_keeps_the_float_output_at_every_shipped_swin_geometry(build, size):
    from quant.fold_windows import padded_fold_windows

    model = build()
    assert padded_fold_windows(model) == []
    reference, folded, report = float_output_after_fold(model, size)
    assert any(".norm1 -> " in site for site in report["folded"])
    torch.testing.assert_close(folded, reference, rtol=0, atol=1e-5 * reference.abs().max().item())


def test_the_fold_would_change_the_float_output_where_windows_are_padded():
    """The premise of the refusal, by hand (the pipeline refuses it): at 40 px swin_micro's stage grids 20 / 10 / 5
    are padded to 20 / 12 / 8 for windows of 4, and the folded model's float output moves far beyond rounding;
    SmoothQuant's migration (scales only, 0 stays 0) stays exact there."""
    from configs.quant import RepQOptions
    from quant import quantize_model
    from quant.calibrate import calibrate
    from quant.modes import set_quant_state
    from quant.reparam import BLOCK_FOLD_SITES, find_fold_sites, fold_layernorm, migrate_scales
    from quant.spec import Bits

    model = swin(40)
    x = inputs(40, 4, seed=5)
    with torch.no_grad():
        reference = model(x)
    qmodel = quantize_model(model, PIPELINES["repq"].layout(Bits(4, 4), RepQOptions()))
    calibrate(qmodel, inputs(40, 8, seed=4))
    set_quant_state(qmodel, weights=False, activations=False)
    for _, norm, _, linear in find_fold_sites(qmodel):
        fold_layernorm(norm, linear)
    with torch.no_grad():
        moved = (qmodel(x) - reference).abs().max().item()
    assert moved > 1e-3 * reference.abs().max().item()

    smoothed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, norm, _, linear in find_fold_sites(smoothed, BLOCK_FOLD_SITES):
            migrate_scales(norm, [linear], torch.rand(norm.weight.shape, generator=g) * 3 + 0.1)
        torch.testing.assert_close(smoothed(x), reference, rtol=0, atol=1e-5 * reference.abs().max().item())


def test_repq_refuses_a_padded_geometry_before_any_work(monkeypatch):
    """One line naming the input size (model.img_size), the first padded stage's grid and windows, the other padded
    stage, and both fixes: an image size of whole windows, or reparam=False; nothing is converted or calibrated."""
    monkeypatch.setattr(type(PIPELINES["repq"]), "run", lambda *a, **k: pytest.fail("run reached"))
    message = (r"^repq folds each Swin block's norm1 into attn.qkv, which keeps the float function only on whole "
               r"windows: at an input of 40 x 40 pixels \(model.img_size\), layers.1's 10 x 10 token grid is "
               r"zero-padded to 12 x 12 for its 4 x 4 windows \(also layers.2: 5 x 5 -> 8 x 8\), .*; give "
               r"model.img_size a multiple of 32 \(e.g. 32 or 64\), or reparam=False \(quant.repq.reparam=false")
    with pytest.raises(ValueError, match=message) as refused:
        PIPELINES["repq"](swin(40), inputs(40, 2, seed=4), "w4a4")
    assert "\n" not in str(refused.value)
    # Swin-T's geometry at 256 px: grids 64 / 32 / 16 / 8 for windows of 7
    with pytest.raises(ValueError, match=r"at an input of 256 x 256 pixels \(model.img_size\), layers.0's 64 x 64 "
                                         r"token grid is zero-padded to 70 x 70 for its 7 x 7 windows .*a multiple "
                                         r"of 224 \(e.g. 224 or 448\)"):
        PIPELINES["repq"](timm.create_model("swin_tiny_patch4_window7_224", img_size=256, embed_dim=24,
                                            depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8), num_classes=10).eval(),
                          inputs(256, 2, seed=4), "w4a4")


def test_repq_without_the_fold_takes_a_padded_geometry():
    """reparam=False (no fold) quantizes the padded geometry, and its float function is the model's."""
    reference, unfolded, report = float_output_after_fold(swin(40), 40, reparam=False)
    assert report["folded"] == []
    torch.testing.assert_close(unfolded, reference, rtol=0, atol=1e-6)


def test_aphq_refuses_a_padded_geometry_where_it_folds():
    """APHQ folds at a_bits == w_bits (as officially) and has no option that turns the fold off: refused there,
    before any work (no data is given: the refusal comes first); at w4a8 nothing is folded, so the size is taken."""
    from configs.quant import APHQOptions
    from quant.spec import Bits

    with pytest.raises(ValueError, match=r"^aphq folds each Swin block's norm1 .* 40 x 40 pixels \(model.img_size\)"
                                         r".*give model.img_size a multiple of 32 \(e.g. 32 or 64\)$"):
        PIPELINES["aphq"](swin(40), None, "w4a4")
    PIPELINES["aphq"].check_input_size(swin(40), Bits(4, 8), APHQOptions())


def test_evaluate_refuses_a_padded_geometry_naming_model_name_before_its_float_pass():
    """evaluate.py's model check (quant.plan.check_model_converts, before the float and maxima passes): swin_micro
    trained at 32 px, evaluated at model.img_size=40 under repq, is one ConfigError; 32 px, or reparam=false, pass."""
    from models import build_model
    from quant.plan import check_model_converts

    cfg = digits_config("swin_micro", "model.img_size=40", "quant.pipelines=[repq]")
    with pytest.raises(ConfigError, match=r"^model.name=swin_micro: repq w4a4 cannot quantize it: repq folds each "
                                          r"Swin block's norm1 .*40 x 40 pixels \(model.img_size\)"):
        check_model_converts(build_model(cfg.model), cfg)
    cfg = digits_config("swin_micro", "quant.pipelines=[repq]")
    check_model_converts(build_model(cfg.model), cfg)
    cfg = digits_config("swin_micro", "model.img_size=40", "quant.pipelines=[repq]", "quant.repq.reparam=false")
    check_model_converts(build_model(cfg.model), cfg)


def test_the_window_check_leaves_a_model_without_fold_layers_to_the_conversions_refusal():
    """A ViT with SwiGLU MLPs (no fc1 for the norm2 site): the percentile pipeline refuses it for its uncovered
    layers, RepQ-ViT (and SmoothQuant, which smooths before it converts) for the site its fold lacks
    (reparam.check_fold_sites), not with an AttributeError of the window check (which looks at Swin blocks only) or of
    the fold; reparam=false leaves it to the conversion's refusal."""
    from timm.layers import SwiGLU

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2,
                              num_classes=3, mlp_layer=SwiGLU).eval()
    uncovered = r"4 Linear/Conv2d layers match no quantization rule: \['blocks.0.mlp.fc1_g'"
    for name, options in (("percentile", None), ("repq", {"reparam": False})):
        with pytest.raises(ValueError, match=uncovered):
            PIPELINES[name](model, torch.randn(4, 3, 32, 32), "w4a4", options)
    for name in ("repq", "smoothquant"):
        with pytest.raises(ValueError, match=r"^" + name + r" folds blocks.0.norm2 into blocks.0.mlp.fc1, .* blocks.0 "
                                             r"is a timm.models.vision_transformer.Block without mlp.fc1: "):
            PIPELINES[name](model, torch.randn(4, 3, 32, 32), "w4a4" if name == "repq" else "w8a8")
