"""APHQ's activation scales learn at act_lr during the block reconstruction, through the quantized elements that
QDrop keeps (drop_prob: the probability of an element's quantized value, quant/aphq/reconstruct.py). On a classifier
at drop_prob=0 every activation quantizer passes its float input, so the scales get no gradient and act_lr changes
nothing: given beside it, act_lr is refused as an override that would be ignored (configs/loader.py READ_ONLY_WHEN,
CLASSIFIER_ONLY), by the config and by the Python API. A detector's neck units reconstruct with QDrop off whatever
drop_prob says (quant/aphq/detector.py, as the official set_qdrop), so their scales train at act_lr at drop_prob=0:
there act_lr is read, and evaluate_detection.py's --quant-options, the Python API with a detector's data and the
settings of a detector's result file (its task) keep it; a classifier's result file compares its entries without it
(tests/test_result_read_options.py)."""
import dataclasses

import pytest
import torch

from configs.loader import ConfigError, load_config
from configs.quant import APHQ_DETECTION, APHQOptions
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant.pipeline_data import PipelineData
from quant_models import ImageFeed, images, same_state, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(iters=4, recon_images=8, calib_images=8, batch_size=4, eq_n=32, matmul_steps=5, search_rounds=0)


def quantized_state(**options) -> dict:
    """The state of APHQ's model for `options` (as the dataclass: parse_options checks nothing of it)."""
    model, _ = PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", APHQOptions(**SMALL, **options),
                                 data=cpu_pipeline_data(num_images=16))
    return model.state_dict()


def test_act_lr_changes_nothing_at_drop_prob_0():
    """The property the refusal rests on, and that act_lr acts where some quantized elements are kept."""
    assert same_state(quantized_state(drop_prob=0.0), quantized_state(drop_prob=0.0, act_lr=1e-2))
    assert not same_state(quantized_state(drop_prob=0.5), quantized_state(drop_prob=0.5, act_lr=1e-2))


def test_the_config_refuses_act_lr_at_drop_prob_0_naming_both_keys():
    with pytest.raises(ConfigError, match=r"^quant.aphq.act_lr=0.01 would be ignored: quant.aphq.act_lr is read only "
                                          r"when quant.aphq.drop_prob is nonzero, and it is 0"):
        load_config([], ["quant.aphq.drop_prob=0", "quant.aphq.act_lr=0.01"])
    assert load_config([], ["quant.aphq.drop_prob=0.25", "quant.aphq.act_lr=0.01"]).quant.aphq.act_lr == 0.01
    assert load_config([], ["quant.aphq.drop_prob=0"]).quant.aphq.drop_prob == 0  # act_lr left at its default


@pytest.mark.parametrize("data", [None, cpu_pipeline_data(num_images=16)])
def test_the_python_api_refuses_act_lr_at_drop_prob_0_on_a_classifier_before_any_work(data):
    with pytest.raises(ValueError, match=r"quant.aphq.act_lr=0.01 would be ignored: .*quant.aphq.drop_prob"):
        PIPELINES["aphq"](tiny_vit(), None, "w4a4", {"drop_prob": 0.0, "act_lr": 0.01}, data=data)


def detector_scales(act_lr: float) -> dict:
    """{quantizer: activation scale} of a toy detector (test_aphq_detector_parts.StagedDetector: a backbone block,
    a 1x1-conv neck, an RPN head) after APHQ's detector reconstruction at drop_prob=0, min/max-calibrated."""
    import quant.aphq.detector as aphq_detector
    from quant.calibrate import calibrate
    from quant.modes import named_quantizers, set_quant_state
    from quant.spec import LinearRule, QuantizerSpec, QuantSpec, parse_bits
    from test_aphq_detector_parts import CalibFeed, StagedDetector, images as detector_images
    options = dataclasses.replace(APHQOptions(), **{**APHQ_DETECTION, "calib_images": 1, "recon_images": 2,
                                                    "iters": 3, "log_every": 0, "loss": "mse", "drop_prob": 0.0,
                                                    "act_lr": act_lr})
    spec = QuantSpec(linears=(LinearRule(("backbone.stages.*.blocks.*.fc", "neck", "rpn_head.*"),
                                         QuantizerSpec(4, granularity="channel"), QuantizerSpec(4)),), strict=False)
    torch.manual_seed(0)
    mp = pytest.MonkeyPatch()
    # min/max instead of APHQ's search (which folds ViT LayerNorms the toy lacks), left off as calibrate_aphq does
    mp.setattr(aphq_detector, "calibrate_aphq", lambda model, units, calib, search, generator: (
        calibrate(model, calib), set_quant_state(model, weights=False, activations=False)))
    try:
        result = aphq_detector.quantize_detector(spec, StagedDetector(), CalibFeed(detector_images()[:1]),
                                                 parse_bits("w4a4"), options, PipelineData(
                                                     detector_samples=lambda n, seed: ImageFeed(detector_images()[:n])))
    finally:
        mp.undo()
    return {name: q.scale.detach().clone() for name, q in named_quantizers(result.model)
            if name.endswith("input_quantizer")}


def test_a_detectors_neck_trains_its_activation_scales_at_act_lr_at_drop_prob_0():
    """The property that keeps act_lr read on a detector: its neck's input scale moves with act_lr at drop_prob=0,
    while the backbone block's, which honours drop_prob, does not (as a classifier's units)."""
    still, moved = detector_scales(0.0), detector_scales(1e-2)
    assert not torch.equal(still["neck.input_quantizer"], moved["neck.input_quantizer"])
    assert torch.equal(still["backbone.stages.0.blocks.0.fc.input_quantizer"],
                       moved["backbone.stages.0.blocks.0.fc.input_quantizer"])


@pytest.mark.parametrize("items", [["aphq.drop_prob=0", "aphq.act_lr=1e-4"], ["aphq.act_lr=1e-4", "aphq.drop_prob=0"]])
def test_evaluate_detection_takes_act_lr_at_drop_prob_0(items):
    """--quant-options as evaluate_detection.py reads them (typed by the config schema), then parsed with the
    detection recipe as main() does: act_lr reaches the options."""
    from evaluate_detection import pipeline_options
    from quant.pipeline_base import parse_options
    given = pipeline_options(items, ["aphq"])
    assert given == {"aphq": {"drop_prob": 0.0, "act_lr": 1e-4}}
    parsed = parse_options(APHQOptions, {**APHQ_DETECTION, "calib_images": 8, **given["aphq"]})
    assert (parsed.drop_prob, parsed.act_lr) == (0.0, 1e-4)


def test_the_python_api_takes_act_lr_at_drop_prob_0_on_a_detector(monkeypatch):
    """PIPELINES['aphq'] with a detector's data (PipelineData.detector_samples) hands act_lr to the detector's
    reconstruction (quantize_detector, stubbed: the toy is no mmdet model)."""
    import quant.aphq.pipeline as aphq_pipeline
    from quant.pipeline_base import PTQResult
    from test_aphq_detector_parts import StagedDetector
    seen = []
    monkeypatch.setattr(aphq_pipeline, "quantize_detector", lambda layout, model, calib, bits, options, data: (
        seen.append(options) or PTQResult(model, {})))
    data = PipelineData(detector_samples=lambda n, seed: None)
    # w4a8: no RepQ-ViT fold, which a toy without LayerNorms would refuse
    PIPELINES["aphq"](StagedDetector(), None, "w4a8",
                      {**APHQ_DETECTION, "calib_images": 1, "drop_prob": 0.0, "act_lr": 1e-4}, data=data)
    (options,) = seen
    assert (options.drop_prob, options.act_lr) == (0.0, 1e-4)


# a detector's result file (evaluate_detection.py: its identity's task, its entries' settings() shape: the
# calibration batch and the --quant-options given)
DETECTION = {"task": "detection", "checkpoint": "/runs/det/best.pt", "fingerprint": "f"}


def detection_entry(**options) -> dict:
    return {"calib_images": 8, "calib_seed": 0, "options": options}


def detector_default_act_lr() -> float:
    """What a detector's APHQ runs at where --quant-options give no act_lr: evaluate_detection.py's options
    (detection_defaults: the recipe and the calibration count), parsed as main() parses them."""
    from quant.pipeline_base import parse_options
    return parse_options(APHQOptions, {**APHQ_DETECTION, "calib_images": 8, "drop_prob": 0.0}).act_lr


def test_a_detector_result_file_keeps_act_lr_at_drop_prob_0(tmp_path):
    """A detector's result depends on act_lr at drop_prob=0 (the neck, above), so its recorded settings keep it and
    two results at different act_lr compare as different (engine/eval_results.py), in a file whose task says it is
    a detector's."""
    from engine.eval_results import EvalResults, ResultsError, evaluation_difference, read_options
    options = {**APHQ_DETECTION, "drop_prob": 0.0, "act_lr": 1e-4}
    assert read_options("aphq", options, detector=True)["act_lr"] == 1e-4
    stored = detection_entry(drop_prob=0.0, act_lr=1e-4)  # given: evaluate_detection.py before ac3a53d, or now
    results = EvalResults.open(str(tmp_path / "eval.json"), DETECTION)
    results.add("aphq", "w4a4", {"bbox_mAP": 0.3}, stored)
    results.save()
    again = EvalResults.open(str(tmp_path / "eval.json"), DETECTION)
    assert again.plan("aphq", "w4a4", detection_entry(drop_prob=0.0, act_lr=1e-4), False) is False
    with pytest.raises(ResultsError, match=r"other settings \(options.act_lr 0.0001 -> 4e-05\)"):
        again.plan("aphq", "w4a4", detection_entry(drop_prob=0.0), False)
    assert evaluation_difference({**DETECTION, "quant": {"aphq": {"w4a4": {"settings": stored}}}},
                                 {**DETECTION, "quant": {"aphq": {"w4a4": {"settings": detection_entry(
                                     drop_prob=0.0, act_lr=4e-5)}}}}) is not None


def test_a_detector_entry_at_drop_prob_0_without_act_lr_is_of_the_default(tmp_path):
    """evaluate_detection.py from ac3a53d to 90fb3cc refused act_lr beside drop_prob=0, so its entries there hold
    none and ran at the default: the same command, or one giving that default (which it may now), reuses them; any
    other act_lr is another result."""
    from engine.eval_results import EvalResults, ResultsError, evaluation_difference
    default = detector_default_act_lr()
    stored = detection_entry(drop_prob=0.0)  # settings() of evaluate_detection.py at ac3a53d..90fb3cc^
    results = EvalResults.open(str(tmp_path / "eval.json"), DETECTION)
    results.add("aphq", "w4a4", {"bbox_mAP": 0.3}, stored)
    results.save()
    again = EvalResults.open(str(tmp_path / "eval.json"), DETECTION)
    for asked in (detection_entry(drop_prob=0.0), detection_entry(drop_prob=0.0, act_lr=default)):
        assert again.plan("aphq", "w4a4", asked, False) is False
        assert evaluation_difference({**DETECTION, "quant": {"aphq": {"w4a4": {"settings": stored}}}},
                                     {**DETECTION, "quant": {"aphq": {"w4a4": {"settings": asked}}}}) is None
    with pytest.raises(ResultsError, match=r"other settings \(options.act_lr 4e-05 -> 0.0001\)"):
        again.plan("aphq", "w4a4", detection_entry(drop_prob=0.0, act_lr=1e-4), False)
