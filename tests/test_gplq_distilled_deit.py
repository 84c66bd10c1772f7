"""GPLQ on a distilled DeiT (timm's VisionTransformerDistilled): two classifiers, on the class and the distillation
token, whose logits the model averages. Stage 1's FeatureTap gives the model's own logits and timm's pre-logits
(the mean of the two tokens, as the teacher PCA reads them), and the whole pipeline runs on such a model."""
import math

import pytest
import timm
import torch

from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant.gplq.qat import FeatureTap
from quant_models import images, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_distilled_deit(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                             num_heads=2, num_classes=10).eval()


def test_feature_tap_gives_the_distilled_models_logits_and_the_mean_of_its_two_tokens():
    model, x = tiny_distilled_deit(), images(4)
    with torch.no_grad():
        logits, feats = FeatureTap(model)(x)
        tokens = model.forward_features(x)  # [B, 2 + patches, D]: class token, distillation token, patches
        expected_logits = (model.head(tokens[:, 0]) + model.head_dist(tokens[:, 1])) / 2
        assert torch.equal(logits, model(x))
        assert torch.allclose(logits, expected_logits, atol=1e-6)
        assert torch.allclose(feats, (tokens[:, 0] + tokens[:, 1]) / 2, atol=1e-6)


def test_feature_tap_gives_a_plain_vits_logits_and_its_class_token_after_the_norm():
    model, x = tiny_vit(), images(4)
    with torch.no_grad():
        logits, feats = FeatureTap(model)(x)
        pooled = model.fc_norm(model.forward_features(x)[:, 0])  # class-token pooling; fc_norm is Identity here
        assert torch.equal(logits, model(x))
        assert torch.allclose(feats, pooled, atol=1e-6)
        assert torch.allclose(model.head(feats), logits, atol=1e-6)


def test_gplq_quantizes_a_distilled_deit():
    """The reviewer's run (a TypeError, 'tuple' object is not callable, at the first update): stage 1 with the PCA
    loss, then stage 2 with QwT, on a distilled DeiT."""
    model = tiny_distilled_deit()
    quantized, report = PIPELINES["gplq"](model, images(8), "w4a4", {
        "steps": 2, "batch_size_per_gpu": 4, "init_images": 8, "stage2_images": 8, "pca_images": 8},
        data=cpu_pipeline_data(num_images=16))
    assert report["stage1"]["steps"] == 2 and report["stage1"]["pca_dims"] is not None
    assert math.isfinite(report["stage1"]["ce"]) and math.isfinite(report["stage1"]["pca"])
    with torch.no_grad():
        out = quantized(images(4))
    assert out.shape == (4, 10) and torch.isfinite(out).all()
