"""evaluate_detection.py records in each `quant.<pipeline>.<bits>` entry the scores of the detector that pipeline
quantized at those bits, not those of the float detector (which the `fp` entry holds).

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import pytest
import torch

from detection_runs import SAMPLE_CONFIG  # its fixture (sample) comes through conftest.py

pytestmark = pytest.mark.detection


def _random_detector(tmp_path):
    """A checkpoint of the sample detector at its initial weights (no training: the scores are stubbed below),
    keeping the sample's classes as training does."""
    from engine.detection import load_config
    from mmdet.registry import MODELS
    torch.manual_seed(0)
    model = MODELS.build(load_config([SAMPLE_CONFIG]).model)
    path = tmp_path / "random.pth"
    torch.save({"state_dict": model.state_dict(), "meta": {"dataset_meta": {"classes": ("box", "disc")}}}, path)
    return str(path)


def _weight_bits(model):
    """The weight bit-widths of the model's quantized Conv2d / Linear layers: empty for a float model."""
    from quant.layers import QuantConv2d, QuantLinear
    return {m.weight_quantizer.bits for m in model.modules()
            if isinstance(m, (QuantConv2d, QuantLinear)) and m.weight_quantizer is not None}


def test_each_quant_entry_holds_the_scores_of_the_detector_quantized_at_its_bits(sample, tmp_path, monkeypatch):
    """The scoring is replaced by a recorder that keeps the model of each call and answers numbers of its own per
    call; the quantization (percentile at two bit-widths) is the real one. Each entry's numbers are those of the
    call made on a quantized detector at the entry's bits, another object than the float detector, which is
    scored once (the `fp` entry, with the activation maxima) and left float."""
    import engine.detection
    from evaluate_detection import main
    calls = []

    def recorder(model, cfg, loader, probe_maxima=False, progress=True):
        """Stands for evaluate_detector: numbers no other call returns, and the model's bits at this call."""
        n = len(calls)
        result = {"bbox_mAP": 0.1 + 0.25 * n, "segm_mAP": 0.05 + 0.25 * n, "images": len(loader.dataset),
                  "seconds": 0.0}
        calls.append({"model": model, "bits": _weight_bits(model), "probe": probe_maxima, "result": dict(result)})
        if probe_maxima:
            result["max_act"] = {"backbone": 1.0, "head": 2.0}
        return result

    monkeypatch.setattr(engine.detection, "evaluate_detector", recorder)  # main imports it from there at its call
    data = main(["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample,
                 "--out", str(tmp_path / "eval.json"), "--quant", "percentile", "--bits", "w4a4", "w8a8"])
    fp_calls = [c for c in calls if c["probe"]]
    assert len(fp_calls) == 1 and len(calls) == 3, calls
    fp_model = fp_calls[0]["model"]
    assert fp_calls[0]["bits"] == set() and _weight_bits(fp_model) == set()  # float, before and after quantizing
    assert {k: data["fp"][k] for k in ("bbox_mAP", "segm_mAP")} == {
        k: fp_calls[0]["result"][k] for k in ("bbox_mAP", "segm_mAP")}
    scored_models = []
    for bits, weight_bits in (("w4a4", 4), ("w8a8", 8)):
        entry = data["quant"]["percentile"][bits]
        scored = [c for c in calls if (c["result"]["bbox_mAP"], c["result"]["segm_mAP"])
                  == (entry["bbox_mAP"], entry["segm_mAP"])]
        assert len(scored) == 1, (bits, entry, calls)  # the numbers of one call
        call = scored[0]
        on_float = call["model"] is fp_model  # a bool: the models' reprs would fill the failure's lines
        assert not call["probe"] and not on_float, f"{bits} entry scored on the float detector"
        assert call["bits"] == {weight_bits}, (bits, call["bits"])  # quantized, at the entry's bit-width
        scored_models.append(call["model"])
    assert scored_models[0] is not scored_models[1]
