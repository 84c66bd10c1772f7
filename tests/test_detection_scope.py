"""What the vision pipelines quantize in an MMDetection Mask R-CNN + Swin, against the rules of the official
RepQ-ViT detection code (zkkli/RepQ-ViT `detection/tools/quant/quant_model.py`, transcribed below), and the
RepQ-ViT LayerNorm folds of MMDetection's Swin. Conversion only, no forward: it runs with mmcv-lite (the
compiled ops a detector's forward needs are stood in by `cd.families.import_mmdet_swin`), so it is part of the
default suite.

The official rules, for every module of the detector (module names of the Swin-Transformer-Object-Detection
fork; MMDetection 3.x spells qkv `attn.w_msa.qkv`, fc1 `ffn.layers.0.0`, the patch embedding `projection`):
  * nn.Conv2d: weights per output channel at w bits; input per tensor at a bits, 8 bits if 'embed' is in the name;
  * nn.Linear: weights per output channel; input per channel if 'qkv', 'fc1' or 'reduction' is in the name
    (RepQ-ViT then folds it into the preceding LayerNorm), otherwise per tensor; a bits;
  * the attention matmuls: q, k, v uniform per tensor, the softmax output log2-quantized; a bits;
  * nothing else (the mask head's ConvTranspose2d is not an nn.Conv2d there and stays float).

The official APHQ-ViT detection code (GoatWu/APHQ-ViT `Object-Detection/tools/quant_utils/wrap_net.py`) differs:
every nn.Conv2d's input is at a bits except under 'patch_embed' (8 bits, which its layers bypass: float); both
matmul operands are uniform asymmetric PER HEAD, the softmax output too; weights asymmetric per output channel
(AdaRound during reconstruction).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("mmdet")

SAMPLE_CONFIG = "configs/detection/debug/mask_rcnn_swin_sample.py"
OFFICIAL_NAMES = {"ffn.layers.0.0": "mlp.fc1", "ffn.layers.1": "mlp.fc2", "w_msa.": "", "projection": "proj"}


def official_name(name: str) -> str:
    for ours, theirs in OFFICIAL_NAMES.items():
        name = name.replace(ours, theirs)
    return name


@pytest.fixture(scope="module")
def detector():
    from cd.families import import_mmdet_swin
    import_mmdet_swin()  # a stand-in for mmcv's compiled ops under mmcv-lite
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmdet.registry import MODELS
    init_default_scope("mmdet")
    torch.manual_seed(0)
    model = MODELS.build(Config.fromfile(SAMPLE_CONFIG).model)
    return model.eval()


@pytest.mark.parametrize("pipeline", ["percentile", "repq"])
def test_every_conv_and_linear_is_quantized_as_the_official_detection_code_does(detector, pipeline):
    from quant import PIPELINES, parse_bits
    from quant.attention import QuantWindowMSA
    from quant.convert import quantize_model
    from quant.layers import QuantConv2d, QuantLinear
    p = PIPELINES[pipeline]
    assert "detection" in p.tasks
    bits = parse_bits("w4a4")
    qmodel = quantize_model(detector, p.layout(bits, p.Options()))
    fp_modules = dict(detector.named_modules())
    checked = 0
    for name, module in qmodel.named_modules():
        source = fp_modules.get(name)
        if isinstance(source, (nn.Conv2d, nn.Linear)):  # mmcv's Conv2d / Linear wrappers are subclasses
            official = official_name(name)
            assert isinstance(module, (QuantConv2d, QuantLinear)), f"{name} stayed float"
            assert module.weight_quantizer.bits == 4 and module.weight_quantizer.channel_dim == 0, name
            a_bits = 8 if isinstance(source, nn.Conv2d) and "embed" in official else 4
            assert module.input_quantizer.bits == a_bits, (name, module.input_quantizer.bits)
            per_channel = isinstance(source, nn.Linear) and any(s in official for s in ("qkv", "fc1", "reduction"))
            if pipeline == "repq":  # per channel before the fold (percentile: per tensor everywhere)
                assert (module.input_quantizer.channel_dim is not None) == per_channel, name
            checked += 1
        elif isinstance(source, nn.ConvTranspose2d):
            assert module is source or type(module) is type(source), f"{name}: the official code keeps it float"
    assert checked == sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in detector.modules())
    attentions = [m for m in qmodel.modules() if isinstance(m, QuantWindowMSA)]
    blocks = sum(len(stage.blocks) for stage in detector.backbone.stages)
    assert len(attentions) == blocks
    for attention in attentions:
        assert [attention.q_quant.bits, attention.k_quant.bits, attention.attn_quant.bits,
                attention.v_quant.bits] == [4, 4, 4, 4]
        kind = type(attention.attn_quant).__name__
        assert kind == ("LogSqrt2Quantizer" if pipeline == "repq" else kind)


def converted_layers(detector, pipeline: str):
    """(name, converted layer, float source) for every nn.Conv2d / nn.Linear of `detector` converted by the
    pipeline's W4A4 layout; every one of them must be converted."""
    from quant import PIPELINES, parse_bits
    from quant.convert import quantize_model
    from quant.layers import QuantConv2d, QuantLinear
    p = PIPELINES[pipeline]
    assert "detection" in p.tasks
    qmodel = quantize_model(detector, p.layout(parse_bits("w4a4"), p.Options()))
    fp_modules = dict(detector.named_modules())
    layers = [(name, module, fp_modules[name]) for name, module in qmodel.named_modules()
              if isinstance(fp_modules.get(name), (nn.Conv2d, nn.Linear))]  # mmcv's wrappers are subclasses
    assert len(layers) == sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in detector.modules())
    for name, module, _ in layers:
        assert isinstance(module, (QuantConv2d, QuantLinear)), f"{name} stayed float"
    return qmodel, layers


def test_aphq_quantizes_the_detector_as_the_official_aphq_detection_code_does(detector):
    from quant.aphq.adaround import AdaRoundQuantizer
    from quant.attention import QuantWindowMSA
    qmodel, layers = converted_layers(detector, "aphq")
    for name, module, source in layers:
        official = official_name(name)
        wq = module.weight_quantizer
        assert isinstance(wq, AdaRoundQuantizer) and wq.bits == 4 and wq.channel_dim == 0 and not wq.symmetric
        if isinstance(source, nn.Conv2d) and "patch_embed" in official:
            assert module.input_quantizer is None, f"{name}: 8-bit input, bypassed officially"
        else:
            aq = module.input_quantizer
            assert aq.bits == 4 and not aq.symmetric, name
            per_channel = isinstance(source, nn.Linear) and any(s in official for s in ("qkv", "fc1", "reduction"))
            assert (aq.channel_dim is not None) == per_channel, name
    for attention in [m for m in qmodel.modules() if isinstance(m, QuantWindowMSA)]:
        for q in (attention.q_quant, attention.k_quant, attention.attn_quant, attention.v_quant):
            assert type(q).__name__ == "UniformQuantizer" and q.bits == 4 and not q.symmetric
            assert q.channel_dim == 1  # per head: [B, heads, N, d]


def test_gplq_quantizes_the_same_layers_with_lsq_activations(detector):
    """GPLQ has no official detection code: it takes the same scope, with its own quantizers (LSQ activations
    symmetric per channel, 8-bit stem input; per-head matmul operands; symmetric per-channel weights)."""
    from quant.attention import QuantWindowMSA
    from quant.gplq.lsq import LSQQuantizer
    qmodel, layers = converted_layers(detector, "gplq")
    for name, module, source in layers:
        wq, aq = module.weight_quantizer, module.input_quantizer
        assert wq.bits == 4 and wq.channel_dim == 0 and wq.symmetric, name
        assert isinstance(aq, LSQQuantizer) and aq.symmetric and aq.channel_dim is not None, name
        assert aq.bits == (8 if isinstance(source, nn.Conv2d) and "patch_embed" in name else 4), name
    for attention in [m for m in qmodel.modules() if isinstance(m, QuantWindowMSA)]:
        for q in (attention.q_quant, attention.k_quant, attention.attn_quant, attention.v_quant):
            assert isinstance(q, LSQQuantizer) and q.bits == 4 and q.channel_dim == 1


def test_repq_folds_every_layernorm_that_feeds_a_per_channel_input(detector):
    """RepQ-ViT's official detection code folds norm1 -> qkv, norm2 -> fc1 and the PatchMerging norm -> reduction
    inside the backbone's stages (not the output norms); the fold sites found in MMDetection's Swin are those."""
    from quant.reparam import REPQ_FOLD_SITES, find_fold_sites
    sites = {(norm, linear) for norm, _, linear, _ in find_fold_sites(detector, REPQ_FOLD_SITES)}
    expected = set()
    for s, stage in enumerate(detector.backbone.stages):
        for b in range(len(stage.blocks)):
            prefix = f"backbone.stages.{s}.blocks.{b}"
            expected |= {(f"{prefix}.norm1", f"{prefix}.attn.w_msa.qkv"),
                         (f"{prefix}.norm2", f"{prefix}.ffn.layers.0.0")}
        if stage.downsample is not None:
            expected.add((f"backbone.stages.{s}.downsample.norm", f"backbone.stages.{s}.downsample.reduction"))
    assert sites == expected


def test_the_quantized_window_attention_computes_mmdetections_attention(detector):
    """With its quantizers off, the converted WindowMSA gives MMDetection's own output (shifted-window mask
    included), so the conversion changes nothing but the quantized operands."""
    from quant.attention import convert_attention
    torch.manual_seed(0)
    block = detector.backbone.stages[0].blocks[0]
    w_msa = block.attn.w_msa
    with torch.no_grad():
        w_msa.relative_position_bias_table.normal_()
    quantized = convert_attention(w_msa, {})
    n = w_msa.window_size[0] * w_msa.window_size[1]
    x = torch.randn(4, n, w_msa.embed_dims)
    mask = torch.zeros(2, n, n)
    mask[1, :, : n // 2] = -100.0
    for m in (None, mask):
        torch.testing.assert_close(quantized(x, m), w_msa(x, m), rtol=1e-5, atol=1e-5)
