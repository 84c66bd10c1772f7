"""scripts/gap_test.py reads a top-1 drop exactly (100 * images right / images scored) from the result files that
evaluate.py writes: their fp entry records the count of images scored, as their quantized entries do. evaluate.py
kept it out of the fp entry, so that on every real result the drop was the difference of two rounded floats, and
only hand-written results (tests/test_gap_test.py) reached the exact path."""
import json
import types
from fractions import Fraction

import evaluate
import gap_test


def test_the_drop_of_a_result_evaluate_py_wrote_is_the_exact_difference_of_images_right(checkpoint, tmp_path):
    out = tmp_path / "eval.json"
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out), "--quant", "percentile",
                                       "--bits", "w4a4"]))
    result = json.loads(out.read_text())
    fp, quantized = result["fp"], result["quant"]["percentile"]["w4a4"]
    images = result["images"]  # the val split's size (digits: no image unreadable, every one scored)
    assert fp.get("count") == quantized.get("count") == images, (fp, quantized, images)
    right = [round(entry["top1"] * images / 100) for entry in (fp, quantized)]
    assert all(abs(entry["top1"] - 100 * k / images) < 1e-9 for entry, k in zip((fp, quantized), right))
    assert gap_test.counted_top1(fp) == Fraction(100 * right[0], images)
    drop = gap_test.gap(types.SimpleNamespace(result=result), "percentile", "w4a4", "top1")
    assert drop == float(Fraction(100 * (right[0] - right[1]), images))
