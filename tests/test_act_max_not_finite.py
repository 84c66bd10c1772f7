"""A NaN or inf `max` in an activation-maxima CSV (a model whose activations overflowed) is refused where the rows
are read, naming the file and line: dose_report.read_act_max (dose_report.py, lm_study.py) and compare_act_max.py's
per_block used to let it through, and the largest value of a type or block (max() ignores a NaN after the first
value) was then the other modules' maximum. A NaN kurtosis (an output too near a constant to resolve) stays a value
the per-type table leaves out.

Where they are measured (engine.act_max.ActivationProbe): an output that is NaN (an fp16 overflow's inf - inf) was
a record of max NaN, which Python's max() of the records skips, so act/max_block was the largest of the other blocks'
outputs; it is inf, and the largest kurtosis of its kind NaN (not known)."""
import math

import pytest
import torch

from engine.act_max import ActivationProbe
from quant_models import images, tiny_vit
from test_compare_act_max import load as load_compare, run_rows, write as write_act_max
from test_lm_study import write_run
from tests.conftest import run_entry

import dose_report

HEADER = "name,kind,block,type,max,kurtosis\n"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_read_act_max_names_the_file_and_line_of_a_max_that_is_not_finite(tmp_path, value):
    path = tmp_path / "eval_best_act_max.csv"
    path.write_text(HEADER + "blocks.0.mlp.fc2,module,0,mlp.fc2,2.0,4.0\n"
                    f"blocks.1.mlp.fc2,module,1,mlp.fc2,{value},4.0\n" + "blocks.1,block,1,block,5.0,3.0\n")
    with pytest.raises(dose_report.ReportError, match=rf"eval_best_act_max.csv, line 3: max '{value}' is not a "
                                                      r"finite number: the model's activations overflowed"):
        dose_report.read_act_max(str(path))


def test_a_nan_kurtosis_is_read_and_left_out_of_the_largest_kurtosis_of_its_type(tmp_path):
    path = tmp_path / "eval_best_act_max.csv"
    path.write_text(HEADER + "blocks.0.mlp.fc2,module,0,mlp.fc2,2.0,nan\nblocks.1.mlp.fc2,module,1,mlp.fc2,3.0,7.5\n"
                    "blocks.1.norm1,module,1,norm1,1.5,nan\nblocks.1,block,1,block,5.0,3.0\n")
    run = dose_report.Run("p", 0, str(tmp_path), {}, {}, dose_report.read_act_max(str(path)))
    # by hand: mlp.fc2's maxima 2.0 and 3.0, its kurtosis 7.5 (the NaN is no value); norm1 has no kurtosis at all
    assert dose_report.type_maxima(run) == {"mlp.fc2": 3.0, "norm1": 1.5, "block": 5.0}
    assert dose_report.type_maxima(run, "kurtosis") == {"mlp.fc2": 7.5, "block": 3.0}


def test_lm_study_refuses_a_run_with_a_nan_max_in_one_error_line(tmp_path, capsys):
    root = tmp_path / "sweep"
    root.mkdir()
    for name in ("baseline_s0", "baseline_s1"):
        write_run(root, name, ppl=4.0, rtn=5.0, block_max=20.0, kurtosis=10.0, fc2_final=100.0)
    csv_path = root / "baseline_s1" / "eval_best_act_max.csv"
    csv_path.write_text(csv_path.read_text().replace("mlp.fc2,3.0,", "mlp.fc2,nan,"))
    code, out, err = run_entry("scripts/lm_study.py", [str(root), "--out", str(tmp_path / "out")], capsys)
    assert isinstance(code, str) and "\n" not in code and not out and not err, (code, err)
    assert code.startswith(f"error: {csv_path}, line 3: max 'nan' is not a finite number"), code
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["module", "block", "outside"])
def test_compare_act_max_refuses_a_max_that_is_not_finite_naming_file_and_line(tmp_path, kind):
    compare = load_compare()
    write_act_max(tmp_path / "a_s0_act_max.csv", run_rows([1.0, 4.0], [10.0, 2.0], [3.0, 7.0]))
    rows = run_rows([3.0, 6.0], [20.0, 1.0], [5.0, 9.0])
    # rows: block 0 output, norm1, fc2, block 1 output, norm1, fc2, the final norm (block -1); line = index + 2
    index = {"module": 1, "block": 3, "outside": 6}[kind]
    rows[index]["max"] = float("nan")
    write_act_max(tmp_path / "a_s1_act_max.csv", rows, checkpoint=str(tmp_path / "other.pt"))
    with pytest.raises(SystemExit, match=rf"error: .*a_s1_act_max.csv, line {index + 2}: max nan is not a finite "
                                         r"number: the model's activations overflowed"):
        compare.main([f"a={tmp_path}/a_s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert not (tmp_path / "cmp.csv").exists()


def overflowing_vit():
    """A tiny ViT whose last block's fc1 overflows fp16 at the patch tokens only (their position embedding's large
    channel 0, which two fc1 rows read 2e4 times, and fc2 adds them with opposite signs: inf - inf = NaN); the cls
    token that the head reads stays finite."""
    model = tiny_vit()
    with torch.no_grad():
        model.pos_embed[0, 1:, 0] = 50.0
        fc1, fc2 = model.blocks[-1].mlp.fc1, model.blocks[-1].mlp.fc2
        fc1.weight[:, 0] = 0.0
        fc1.weight[0:2, 0] = 2e4
        fc2.weight[:, 0], fc2.weight[:, 1] = 1.0, -1.0
    return model


def test_a_nan_block_output_under_fp16_autocast_is_an_infinite_block_maximum():
    model = overflowing_vit()
    outputs = {}  # the reference: every block output, kept by the test's own hooks
    handles = [block.register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o.detach()))
               for n, block in enumerate(model.blocks)]
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe, torch.autocast("cpu", dtype=torch.float16):
        logits = model(images(4))
    for handle in handles:
        handle.remove()
    # the premise: the logits are finite (the FP pass scores them), block 0's output too, block 1's has NaN
    assert torch.isfinite(logits).all() and torch.isfinite(outputs[0]).all() and outputs[1].isnan().any()
    result = probe.result()
    assert result.block == math.inf and result.module == math.inf  # was block 0's maximum, 51.3
    assert {r["name"]: r["max"] for r in result.per_layer}["blocks.1"] == math.inf
    assert not probe.maxima().isnan().any()  # a MAX all-reduce keeps it on every rank
    metrics = result.metrics()
    assert math.isnan(metrics["act/kurtosis_block"]) and math.isnan(metrics["act/kurtosis_module"])


def test_finite_outputs_keep_their_largest_kurtosis():
    model = tiny_vit()
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
        model(images(4))
    result = probe.result()
    kurtosis = [r["kurtosis"] for r in result.per_layer if r["kind"] == "block"]
    assert math.isfinite(result.block) and result.metrics()["act/kurtosis_block"] == max(kurtosis)
