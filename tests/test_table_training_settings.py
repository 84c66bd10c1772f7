"""A quantized cell of evaluate.py's table is marked * with a note where its entry drew on other training images or
another training mode than its run trained with: an evaluation override of the training transform (APHQ's and
GPLQ's images, a calibration batch under quant.calib_transform=train), of the calibration batch's split, or of GPLQ
stage 1's dropout / stochastic depth. The entry records these settings (so a cached result is not reused for
another value), but the table compared the quant.* options and the batch's count, seed and transform alone, so an
APHQ result at data.reprob=0 beside a run trained at 0.25 read as the default protocol. Results hand-written here."""
from __future__ import annotations

import copy

from engine.result_table import markdown_table

RECIPE = {"data.dataset": "digits", "data.reprob": 0.25, "data.scale": [0.7, 1.0], "data.train_split": "train",
          "data.interpolation": "bicubic", "model.drop": 0.0, "model.drop_path": 0.1}


def result(train_transform: dict, model_training: dict, recipe=RECIPE) -> dict:
    """A digits result with one APHQ and one GPLQ entry at default quant.* options (none recorded: an older entry's
    options are not compared), drawing images of `train_transform` and training GPLQ with `model_training`."""
    aphq = {"train_transform": {"split": "train", **train_transform}}
    gplq = {**copy.deepcopy(aphq), "model_training": model_training, "world_size": 1}
    return {"model": "vit_nano", "method": "Baseline", "fp": {"top1": 90.0}, "max_act": {"module": 3.0, "block": 4.0},
            **({"recipe": recipe} if recipe is not None else {}),
            "quant": {"aphq": {"w4a4": {"top1": 80.0, "settings": aphq}},
                      "gplq": {"w4a4": {"top1": 81.0, "settings": gplq}}}}


def test_training_settings_other_than_the_runs_mark_the_cell_and_are_named():
    table = markdown_table([result({"reprob": 0.0, "scale": [0.7, 1.0], "interpolation": "bicubic"},
                                   {"drop": 0.0, "drop_path": 0.0})]).splitlines()
    assert table[2] == "| vit_nano | Baseline | 90.000 | 3.00 / 4.00 | 80.000* | 81.000* |"
    assert table[4:] == [
        "\\* vit_nano Baseline APHQ W4A4: not the default settings: data.reprob=0.0 (trained with 0.25)",
        "\\* vit_nano Baseline GPLQ W4A4: not the default settings: data.reprob=0.0 (trained with 0.25), "
        "model.drop_path=0.0 (trained with 0.1)"]


def test_a_calibration_batch_of_another_split_is_named():
    other = result({"reprob": 0.25}, {"drop": 0.0, "drop_path": 0.1})
    other["quant"] = {"repq": {"w4a4": {"top1": 70.0, "settings": {"calibration": {
        "images": 32, "seed": 0, "split": "train_small", "transform": "eval"}}}}}
    assert markdown_table([other]).splitlines()[-1] == (
        "\\* vit_nano Baseline RepQ-ViT W4A4: not the default settings: data.train_split=train_small "
        "(trained with train)")


def test_the_runs_own_training_settings_or_a_result_without_a_recipe_leave_the_cells_unmarked():
    own = ({"reprob": 0.25, "scale": [0.7, 1.0]}, {"drop": 0.0, "drop_path": 0.1})
    # data.interpolation is the eval transform's too: another one is the row's (data_changed), not the cell's
    for r in (result(*own), result({"reprob": 0.0}, {"drop_path": 0.0}, recipe=None),
              result({"reprob": 0.25, "interpolation": "bilinear"}, own[1])):
        assert "*" not in markdown_table([r]).splitlines()[2]
