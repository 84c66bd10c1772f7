"""Detection options that would be recorded but change nothing, refused before any model or data set is built
(so with mmcv-lite: part of the default suite; the one marked `detection` reads the config's test metric, which
needs full mmcv)."""
from __future__ import annotations

import pytest

pytest.importorskip("mmdet")

from detection_runs import SAMPLE_CONFIG  # noqa: E402


@pytest.mark.parametrize("pipeline", ["percentile", "repq", "aphq", "gplq"])
@pytest.mark.parametrize("option", ["head_w_bits=8", "head_a_bits=8", "head_w_bits=0", "head_a_bits=4"])
def test_a_classifier_head_bit_width_is_refused_for_every_detection_pipeline(tmp_path, pipeline, option):
    """The head rule matches timm's head / head.fc / head_dist, which no MMDetection detector has: the option was
    written into the result's settings and quantized nothing differently. The config and checkpoint are never
    read (neither exists), so the refusal comes before any work."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    out = tmp_path / "x.json"
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "none.pth"), "--data-root",
            str(tmp_path / "none"), "--out", str(out), "--quant", pipeline, "--quant-options", f"{pipeline}.{option}"]
    with pytest.raises(DetectionError) as refused:
        main(argv)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"--quant-options {pipeline}.{option}: ") and "detector does not have" in message
    assert not out.exists()


def test_a_main_rank_wait_is_refused_in_one_process_and_read_under_torchrun(tmp_path, monkeypatch):
    """--main-rank-wait-hours is how long the other ranks wait for rank 0 (run_on_main), and one process has none:
    it was taken and changed nothing. Refused as evaluate.py refuses quant.main_rank_wait_hours, whatever its value,
    before the config or checkpoint is read (neither exists); under torchrun (WORLD_SIZE 2) it is read: 0 hours
    meets the value check (which comes before the ranks meet)."""
    from configs import ConfigError
    from engine.detection import DetectionError
    from evaluate_detection import main
    out = tmp_path / "x.json"

    def argv(hours):
        return ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "none.pth"), "--data-root",
                str(tmp_path / "none"), "--out", str(out), "--quant", "--main-rank-wait-hours", hours]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for hours in ("2", "0"):
        with pytest.raises(ConfigError, match=r"^--main-rank-wait-hours would be ignored: it is how long the other "
                                              r"ranks .* under torchrun wait for rank 0 .*this is one process"):
            main(argv(hours))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DetectionError, match=r"^--main-rank-wait-hours 0.0: give a positive number of hours"):
        main(argv("0"))
    assert not out.exists()


def test_a_head_bit_width_left_at_its_default_passes_the_head_check():
    """null is the default (the main bit-width for a classifier): it changes nothing and is not refused."""
    from configs.quant import FirstLastOptions
    from evaluate_detection import check_head_options
    check_head_options("repq", FirstLastOptions())
    check_head_options("repq", FirstLastOptions(stem_w_bits=8, stem_a_bits=8))  # the stem is the detector's too


@pytest.mark.detection  # the config's test metric is read after the data set's files are checked: full mmcv
@pytest.mark.parametrize("evaluator", ["test_evaluator.outfile_prefix={prefix}",
                                       "test_evaluator.outfile_prefix={prefix} test_evaluator.format_only=False"])
def test_a_test_metric_that_dumps_its_predictions_to_a_prefix_is_refused_before_any_work(sample, tmp_path, evaluator):
    """CocoMetric writes PREFIX.bbox.json / PREFIX.segm.json at every scoring: over files already there, and each
    quantized scoring over the full-precision one's. The files there are left as they were, no result is written."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    prefix = tmp_path / "dump" / "preds"
    prefix.parent.mkdir()
    kept = prefix.parent / "preds.bbox.json"
    kept.write_text("[]")  # someone's earlier dump
    out = tmp_path / "x.json"
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "none.pth"), "--data-root", sample,
            "--out", str(out), "--quant", "repq", *evaluator.format(prefix=prefix).split()]
    with pytest.raises(DetectionError) as refused:
        main(argv)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"test_evaluator.outfile_prefix={prefix}: ")
    assert "tools/test.py" in message
    assert kept.read_text() == "[]" and sorted(p.name for p in prefix.parent.iterdir()) == ["preds.bbox.json"]
    assert not out.exists()


@pytest.mark.detection  # the data set's files are checked first: full mmcv
@pytest.mark.parametrize("thresholds", ["[0.5]", "0.5", "[0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95]"])
def test_iou_thresholds_of_a_coco_metric_are_refused_before_any_work(sample, tmp_path, capsys, thresholds):
    """CocoMetric's iou_thrs from a config (a list or a number) fail in pycocotools' summary, whose look-up of mAP_50
    and mAP_75 (`iouThr == p.iouThrs`, checked here on pycocotools itself: the reference) is one bool for them: the
    evaluation failed with "Calling nonzero on 0d arrays" once the whole split was scored, and training at its first
    validation, after an epoch. Refused before the weights are read or the work dir made."""
    import ast
    import numpy as np
    from detection_runs import error_line
    from engine.detection import DetectionError
    from evaluate_detection import main
    from pycocotools.cocoeval import Params
    given = ast.literal_eval(thresholds)
    params = Params(iouType="bbox")
    params.iouThrs = given  # as CocoMetric hands them on
    assert np.ndim(0.5 == params.iouThrs) == 0  # one bool, not a mask of the thresholds
    out = tmp_path / "x.json"
    with pytest.raises(DetectionError) as refused:
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "none.pth"), "--data-root", sample, "--out",
              str(out), "--quant", f"test_evaluator.iou_thrs={thresholds}"])
    assert str(refused.value).startswith(f"test_evaluator.iou_thrs={given}: ") and not out.exists()
    work = tmp_path / "run"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(work),
                               f"val_evaluator.iou_thrs={thresholds}"])
    assert line.startswith(f"error: val_evaluator.iou_thrs={given}: ") and not work.exists()


@pytest.mark.parametrize("script", ["scripts/train_detection.py", "evaluate_detection.py"])
@pytest.mark.parametrize("override", ["train_cfg.max_epochs=[1,(2]", "model.test_cfg.rcnn.max_per_img=(1,2",
                                      "model.backbone.init_cfg=dict(type='Pretrained',checkpoint='/x.pt')"])
@pytest.mark.slow
def test_an_override_value_mmengine_cannot_parse_is_one_error_line(tmp_path, script, override):
    """MMEngine's DictAction asserts on unbalanced brackets and recurses without end on dict(...): the entry points
    printed a traceback (about 1000 lines for the recursion) instead of their one `error:` line, exit code 2."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work = tmp_path / "work"
    args = (["--work-dir", str(work)] if script.startswith("scripts/") else
            ["--checkpoint", str(tmp_path / "none.pth"), "--out", str(tmp_path / "x.json"), "--quant", "repq"])
    done = subprocess.run([sys.executable, os.path.join(root, script), "--config", os.path.join(root, SAMPLE_CONFIG),
                           *args, override], capture_output=True, text=True, cwd=root, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"error: {override!r}: the value cannot be parsed") and "key.sub=value" in lines[0]
    assert not work.exists() and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("items, expected", [
    (["gplq.lr =1e-3"], {"gplq": {"lr": 1e-3}}),
    (["gplq.steps = 0", " gplq.qwt= false"], {"gplq": {"steps": 0, "qwt": False}}),
])
def test_quant_options_with_spaces_around_the_equals_sign_are_read_as_without(items, expected):
    """A quoted `--quant-options "gplq.lr =1e-3"`: the schema reads the key without its space, and the option is
    the one without it (it was an AttributeError traceback on `'lr '`)."""
    from evaluate_detection import pipeline_options
    assert pipeline_options(items, ["gplq"]) == expected


def test_an_unread_option_with_spaces_is_refused_naming_the_item():
    """The whole-mapping rule check (batch_size_per_gpu at steps=0) names the item it refuses, also where the user
    typed spaces around `=` (the lookup of the item by its key found none: StopIteration)."""
    from evaluate_detection import pipeline_options
    with pytest.raises(ValueError, match=r"^--quant-options gplq\.batch_size_per_gpu=2: .*would be ignored"):
        pipeline_options(["gplq.batch_size_per_gpu = 2", "gplq.steps=0"], ["gplq"])
