"""GPLQ draws its QwT (stage-2) images before stage 1, so that a count the data cannot give is refused before any
stage-1 update (hours at full scale), as init_images is; and the move changes nothing: the quantized model is
bitwise the one of the old order, where the images were drawn at the first QwT fit, after stage 1 and the weights'
quantization (reproduced here by drawing them there again). evaluate.py's provider draws with generators of its own
and restores the global RNG (data/loader.py calibration_images), and stage 1 reseeds it per update (engine/loop.py),
so where the draw comes does not change the images or the training."""
import logging

import pytest
import torch

import evaluate as evaluate_entry
import quant.gplq.pipeline as gplq_pipeline
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant_models import digits_config, images, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

POOL = images(8, seed=7)
STAGE2 = 24  # QwT's images; the initialisation draws 16, so a provider can tell the two draws apart
OPTIONS = dict(steps=4, batch_size_per_gpu=8, init_images=16, pca_images=32, stage2_images=STAGE2, log_every=1,
               seed=5)


@pytest.fixture
def stage1_calls(monkeypatch) -> list:
    """One entry per stage-1 run (quant.gplq.qat.run_stage1, as the pipeline calls it)."""
    calls, real = [], gplq_pipeline.run_stage1

    def recorded(*args, **kwargs):
        calls.append("run_stage1")
        return real(*args, **kwargs)

    monkeypatch.setattr(gplq_pipeline, "run_stage1", recorded)
    return calls


def updates(caplog) -> int:
    return sum("GPLQ stage 1 update" in r.getMessage() for r in caplog.records)


def test_a_stage2_count_the_data_lacks_is_refused_before_any_stage1_update(stage1_calls, caplog):
    data = cpu_pipeline_data()
    data.train_images = lambda count, seed, train_transform: POOL[:count]  # 8 images: init's 8, not QwT's 16
    caplog.set_level(logging.INFO, logger="quant.gplq")
    options = dict(steps=20, batch_size_per_gpu=8, init_images=8, stage2_images=16, log_every=1)
    with pytest.raises(ValueError, match=r"^stage2_images=16: PipelineData.train_images\(16, ...\) returned a "
                                         r"tensor of shape \[8, 3, 32, 32\], not 16 images"):
        PIPELINES["gplq"](tiny_vit(), None, "w4a4", options, data=data)
    assert stage1_calls == [] and updates(caplog) == 0
    # the spy sees stage 1 where the data holds the images
    data.train_images = lambda count, seed, train_transform: images(count, seed=7)
    PIPELINES["gplq"](tiny_vit(), None, "w4a4", options, data=data)
    assert len(stage1_calls) == 1 and updates(caplog) == 20


def _gplq(data):
    model, report = PIPELINES["gplq"](tiny_vit(), None, "w4a4", OPTIONS, data=data)
    with torch.no_grad():
        out = model(images(16, seed=5))
    return model.state_dict(), out, report["qwt"], report["stage1"]["ce"]


def _drawn_at_the_old_point(monkeypatch, seed_shift: int = 0):
    """GPLQ as before the move: the early QwT draw gives NaN placeholders (used anywhere, the result would be
    NaN), and the real images are drawn at the first QwT fit, as the old _stage2 did."""
    data = evaluate_entry.build_pipeline_data(digits_config("vit_nano"), 32, 0, 1, None)
    real_draw, real_fit, asked = data.train_images, gplq_pipeline.fit_on_images, []

    def placeholder(count, seed, train_transform):
        if count != STAGE2:
            return real_draw(count, seed, train_transform)
        asked.append((count, seed, train_transform))
        return torch.full((count, 3, 32, 32), float("nan"))

    def fit_on_images(model, given, batch_size, ridge):
        found = {}

        def fit_block(unit, reference):
            if "fit" not in found:
                count, seed, train_transform = asked[0]
                found["fit"] = real_fit(model, real_draw(count, seed + seed_shift, train_transform), batch_size,
                                        ridge)
            return found["fit"](unit, reference)
        return fit_block

    data.train_images = placeholder
    with monkeypatch.context() as patched:
        patched.setattr(gplq_pipeline, "fit_on_images", fit_on_images)
        result = _gplq(data)
    assert asked == [(STAGE2, OPTIONS["seed"], True)]
    return result


def test_the_early_stage2_draw_gives_the_model_of_the_old_order(monkeypatch):
    # evaluate.py's own provider: digits, the training transform (one seeded augmentation per image)
    now = _gplq(evaluate_entry.build_pipeline_data(digits_config("vit_nano"), 32, 0, 1, None))
    old = _drawn_at_the_old_point(monkeypatch)
    assert now[0].keys() == old[0].keys()
    assert all(torch.equal(now[0][k], old[0][k]) for k in now[0] if torch.is_tensor(now[0][k]))
    assert torch.equal(now[1], old[1]) and now[2] == old[2] and now[3] == old[3]
    assert now[2]["kept"] > 0 and torch.isfinite(now[1]).all()
    # the comparison sees the QwT images: other images (another seed at the old point) give another model
    other = _drawn_at_the_old_point(monkeypatch, seed_shift=1)
    assert other[3] == now[3] and not torch.equal(other[1], now[1])
