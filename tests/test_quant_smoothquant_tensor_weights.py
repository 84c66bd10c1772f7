"""SmoothQuant's per-tensor weights (`weight_granularity=tensor`) against the official formula.

mit-han-lab/smoothquant's `quantize_weight_per_tensor_absmax` quantizes each Linear with one scale
max|W| / 127 (max|W| floored at 1e-5), and `quantize_opt` applies it to OPT's q_proj, k_proj and v_proj
separately. A fused qkv (GPT-2, timm ViT / Swin) must therefore get three scales, one per projection.
The reference below is that formula, written out here.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models.gpt import build_gpt
from quant import PIPELINES, quantize_model
from quant.convert import quantized_layers
from quant.spec import Bits
from quant_models import perturb_norms

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
TENSOR = {"weight_granularity": "tensor"}


def official_per_tensor(w: torch.Tensor, n_bits: int = 8) -> torch.Tensor:
    """Their quantize_weight_per_tensor_absmax: one scale max(max|w|, 1e-5) / (2^(b-1) - 1) for all of w."""
    scale = w.abs().max().clamp(min=1e-5) / (2 ** (n_bits - 1) - 1)
    return (w / scale).round() * scale


def official_qkv(w: torch.Tensor) -> torch.Tensor:
    """The fused weight as OPT's three projections get it: rows [Q; K; V] each quantized on its own."""
    return torch.cat([official_per_tensor(p) for p in w.chunk(3, dim=0)])


def with_uneven_projections(model: nn.Module) -> nn.Module:
    """K's rows 20x smaller than Q's and V's: one scale for the fused weight would leave K few codes."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("attn.qkv"):
                c = module.weight.shape[0] // 3
                module.weight[c:2 * c] /= 20
    return model


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return with_uneven_projections(perturb_norms(build_gpt("gpt2_nano", vocab_size=VOCAB)).eval())


def timm_model(variant: str) -> nn.Module:
    import timm

    from models.variants import VARIANTS

    kwargs = dict(VARIANTS[variant])
    torch.manual_seed(0)
    return with_uneven_projections(perturb_norms(timm.create_model(kwargs.pop("arch"), num_classes=10, **kwargs))
                                   .eval())


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))


def images() -> torch.Tensor:
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))


MODELS = [(gpt, tokens), (lambda: timm_model("vit_nano"), images), (lambda: timm_model("swin_nano"), images)]


@pytest.mark.parametrize("pipeline", ["smoothquant", "smoothquant_strict"])
@pytest.mark.parametrize("make, inputs", MODELS, ids=["gpt", "vit", "swin"])
def test_per_tensor_weights_are_the_official_per_projection_formula(pipeline, make, inputs):
    qmodel, _ = PIPELINES[pipeline](make(), inputs(), "w8a8", TENSOR)
    layers = dict(quantized_layers(qmodel))
    assert sum(name.endswith("attn.qkv") for name in layers) >= 2
    for name, layer in layers.items():
        w = layer.weight.detach()  # the smoothed float weight
        want = official_qkv(w) if name.endswith("attn.qkv") else official_per_tensor(w)
        torch.testing.assert_close(layer.quantized_weight().detach(), want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("pipeline", ["smoothquant", "smoothquant_strict"])
def test_per_tensor_weights_change_no_activation_quantizer_of_the_fused_qkv(pipeline):
    # the weight granularity is the weights' alone: the fused qkv's own rule (listed before the in-block ones) quantizes
    # its input as every block Linear's, per token at run time or with the static range of the smoothed float model,
    # as the per-channel run (test_quant_smoothquant.py checks that one against the naive formulas) does
    model, calib = gpt(), tokens()
    tensor, _ = PIPELINES[pipeline](model, calib, "w8a8", TENSOR)
    channel, _ = PIPELINES[pipeline](model, calib, "w8a8")
    x = torch.randn(2, 5, model.blocks[0].attn.qkv.in_features, generator=torch.Generator().manual_seed(2)) * 3
    for (name, layer), (_, reference) in zip(quantized_layers(tensor), quantized_layers(channel)):
        assert type(layer.input_quantizer) is type(reference.input_quantizer), name
        with torch.no_grad():
            torch.testing.assert_close(layer.input_quantizer(x), reference.input_quantizer(x), rtol=0, atol=0,
                                       msg=name)
            assert not torch.equal(layer.input_quantizer(x), x), name  # quantized, not passed through


def test_each_projection_of_a_fused_qkv_uses_its_whole_code_range():
    qmodel, _ = PIPELINES["smoothquant"](gpt(), tokens(), "w8a8", TENSOR)
    for block in qmodel.blocks:
        qkv = block.attn.qkv
        scale = qkv.weight_quantizer.scale.view(-1, 1)
        codes = (qkv.quantized_weight().detach() / scale).round()
        for part in codes.chunk(3, dim=0):  # q, k and v each reach +-127: their scale is their own max|w| / 127
            assert part.abs().max() == 127
        scales = [float(p.abs().max() / 127) for p in qkv.weight.detach().chunk(3, dim=0)]
        assert qkv.weight_quantizer.scale.unique().numel() == 3
        assert scales[1] < scales[0] / 5  # the fixture's small K got a scale of its own


def test_reports_name_the_per_projection_ranges_and_channel_stays_per_row():
    from quant.smoothquant.fused_qkv import ProjectionTensorQuantizer

    _, report = PIPELINES["smoothquant"](gpt(), tokens(), "w8a8", TENSOR)
    rows = {row["module"]: row["weight"] for row in report["layers"]}
    assert rows["blocks.0.attn.qkv"] == "8b sym per-tensor of each of q, k, v (max-abs)"
    assert rows["blocks.0.mlp.fc1"] == rows["blocks.0.attn.proj"] == "8b sym per-tensor (max-abs)"
    qmodel, report = PIPELINES["smoothquant"](gpt(), tokens(), "w8a8")  # channel: one scale per row, as before
    qkv = qmodel.blocks[0].attn.qkv
    assert type(qkv.weight_quantizer) is not ProjectionTensorQuantizer
    assert qkv.weight_quantizer.scale.numel() == qkv.weight.shape[0]


def test_a_saved_per_projection_quantizer_loads_into_a_fresh_conversion():
    fp, x = gpt(), tokens()
    qmodel, _ = PIPELINES["smoothquant"](fp, x, "w8a8", TENSOR)
    options = PIPELINES["smoothquant"].Options(**TENSOR)
    fresh = build_gpt("gpt2_nano", vocab_size=VOCAB).eval()
    fresh = quantize_model(fresh, PIPELINES["smoothquant"].layout(Bits(8, 8), options))  # lazily sized scales
    fresh.load_state_dict(qmodel.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), qmodel(x), rtol=0, atol=0)


def test_a_weight_that_is_not_three_projections_is_refused():
    from quant.smoothquant.fused_qkv import ProjectionTensorQuantizer
    from quant.spec import QuantizerSpec

    quantizer = ProjectionTensorQuantizer.from_spec(QuantizerSpec(8, symmetric=True), None)
    quantizer.name = "blocks.0.attn.qkv.weight_quantizer"
    quantizer.calibrating = True
    with pytest.raises(ValueError, match="blocks.0.attn.qkv.weight_quantizer has 10 output rows.*weight_granularity"):
        quantizer(torch.randn(10, 4))


def test_per_projection_scales_are_created_on_the_device_of_the_weight():
    """tests/test_device_explicit.py's trick: with the default device `meta`, a tensor created without the
    weight's device would land there."""
    from device_utils import tensors_of

    model, calib = gpt(), tokens()
    with torch.device("meta"):
        qmodel, _ = PIPELINES["smoothquant"](model, calib, "w8a8", TENSOR)
        out = qmodel(calib)
    assert out.device.type == "cpu" and torch.isfinite(out).all()
    assert [name for name, t in tensors_of(qmodel) if t.device.type != "cpu"] == []
