"""GPLQ's detector parts in plain torch (no MMDetection needed): QwT fitted by streaming a model through a
`SampleFeed` (images of different sizes, blocks called as block(x, hw_shape)) equals the least-squares fit
computed directly on the pooled tokens, and a reference that calls the block itself inside the stream is not
counted as another call."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from quant import PIPELINES
from quant.gplq.detector import stage1_identity as detector_identity
from quant.gplq.qwt import fit_block_compensation_streamed
from quant.spec import parse_bits
from quant_models import ImageFeed, tiny_vit


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, c)

    def forward(self, x, hw_shape):
        assert x.shape[1] == hw_shape[0] * hw_shape[1]
        return x + torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, c: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(3, c)
        self.blocks = nn.ModuleList([Block(c), Block(c)])

    def forward(self, image):
        b, _, h, w = image.shape
        x = self.stem(image.flatten(2).transpose(1, 2))
        for block in self.blocks:
            x = block(x, (h, w))
        return x


def test_streamed_compensation_is_the_least_squares_fit_on_the_pooled_tokens():
    torch.manual_seed(0)
    net = Net().double()
    reference_block = Block(5).double()  # the "float" block the compensation moves towards
    images = [torch.randn(1, 3, h, w, dtype=torch.float64) for h, w in ((3, 4), (5, 2), (2, 2))]
    calls = []

    def reference(x, hw):
        calls.append(hw)
        return reference_block(x, hw)

    fit = fit_block_compensation_streamed(net, "blocks.1", ImageFeed(images), reference)
    assert calls == [(3, 4), (5, 2), (2, 2)]

    xs, ds = [], []
    with torch.no_grad():
        for image in images:
            _, _, h, w = image.shape
            x = net.blocks[0](net.stem(image.flatten(2).transpose(1, 2)), (h, w))[0]
            xs.append(x)
            ds.append(reference_block(x[None], (h, w))[0] - net.blocks[1](x[None], (h, w))[0])
    X, D = torch.cat(xs), torch.cat(ds)
    A = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], dim=1)
    solution = torch.linalg.lstsq(A, D).solution
    assert torch.allclose(fit.weight.double(), solution[:-1].t(), atol=1e-4)
    assert torch.allclose(fit.bias.double(), solution[-1], atol=1e-4)
    sse = float((A @ solution - D).pow(2).sum())
    sst = float((D - D.mean(0)).pow(2).sum())
    assert abs(fit.r2 - (1 - sse / sst)) < 1e-6


def test_detector_options_refuse_the_pca_loss_and_an_lsq_start_of_another_batch():
    """GPLQ on a detector trains without the PCA loss and initialises LSQ on the --calib-images batch."""
    import dataclasses
    from configs.quant import GPLQ_DETECTION, GPLQOptions
    from quant.gplq.detector import check_detector_options
    detection = dataclasses.replace(GPLQOptions(), **GPLQ_DETECTION, init_images=2)
    check_detector_options(detection, calib_count=2)
    with pytest.raises(ValueError, match="init_images=2 but the calibration batch holds 1 images"):
        check_detector_options(detection, calib_count=1)
    with pytest.raises(ValueError, match="pca_weight=0.5"):
        check_detector_options(dataclasses.replace(detection, pca_weight=0.5), calib_count=2)
    with pytest.raises(ValueError, match="stage2_train_transform=True"):
        check_detector_options(dataclasses.replace(detection, stage2_train_transform=True), calib_count=2)


def test_detector_stage1_identity_holds_every_stage1_option():
    model, opts = tiny_vit(depth=1), PIPELINES["gplq"].Options
    base = detector_identity(model, parse_bits("w4a4"), opts(pca_weight=0.0), None)
    for key, value in [("init_images", 7), ("lr", 1e-5), ("seed", 2), ("steps", 3), ("head_a_bits", 8)]:
        assert detector_identity(model, parse_bits("w4a4"), opts(pca_weight=0.0, **{key: value}), None) != base, key
