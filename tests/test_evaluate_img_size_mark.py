"""A Swin checkpoint scored at another model.img_size than it trained at (its relative-position tables keep their
shapes, so the weights load) is marked † in a result table, as model.kwargs given at evaluation are; a ViT's
pos_embed refuses another size on its own. A result scored at the size it trained at is not marked
(tests/test_evaluate.py's rows of a digits ViT)."""
import json
import os

import pytest

import evaluate
import train
from configs import load_config
from engine import result_table
from tests.conftest import ROOT

SWIN_DEMO = os.path.join(ROOT, "configs", "demo", "swin_digits.yaml")


@pytest.fixture(scope="module")
def swin_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("swin")
    train.main(load_config([SWIN_DEMO], [f"out_dir={out}", "train.max_steps=2", "sched.epochs=1",
                                         "sched.warmup_epochs=0", "log.tensorboard=false"]))
    return os.path.join(out, "best.pt")


def _row_and_notes(checkpoint, out, overrides):
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", out, *overrides]))
    with open(out) as f:
        saved = json.load(f)
    return saved, result_table.markdown_table([saved]).splitlines()[2:]


@pytest.mark.slow  # a 64-px evaluation of 360 images with its activation maxima: about a minute on 2 cores
def test_a_swin_scored_at_another_img_size_is_marked_with_the_size_it_trained_at(swin_checkpoint, tmp_path):
    saved, lines = _row_and_notes(swin_checkpoint, str(tmp_path / "a.json"), ["model.img_size=64"])
    assert saved["data"]["eval_transform"]["img_size"] == 64  # the override ran: 64-px images
    row, note = lines[0], lines[-1]
    assert row.startswith("| swin_micro† |")
    assert note == "† swin_micro Baseline: evaluated with model.img_size=64 (trained with the model default)"


def test_a_result_that_records_no_img_size_is_not_compared():
    """Older files record neither the evaluated model.img_size nor, in older recipes, the trained one."""
    recipe = {"model.kwargs": {}, "model.img_size": None}
    assert result_table.evaluated_otherwise({"recipe": recipe, "model_kwargs": {}}) is None
    assert result_table.evaluated_otherwise({"recipe": {"model.kwargs": {}}, "model_kwargs": {},
                                             "model_img_size": 64}) is None
    assert result_table.evaluated_otherwise({"recipe": {**recipe, "model.img_size": 224}, "model_kwargs": {},
                                             "model_img_size": 384}) == "model.img_size=384 (trained with 224)"
