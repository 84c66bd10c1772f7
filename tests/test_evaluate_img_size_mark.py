"""A Swin checkpoint scored at another model.img_size than it trained at (its relative-position tables keep their
shapes, so the weights load) is marked † in a result table, as model.kwargs given at evaluation are; a ViT's
pos_embed refuses another size on its own. A result scored at the size it trained at is not marked
(tests/test_evaluate.py's rows of a digits ViT)."""
import json
import os

import pytest

import evaluate
import train
from configs import config_to_dict, load_config
from engine import result_table
from tests.conftest import DEMO_CONFIG, ROOT

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
    assert note == "† swin_micro Baseline: evaluated with model.img_size=64 (trained at 32)"


def test_the_size_trained_at_is_the_models_own_where_the_recipe_left_it_null():
    """A recipe's model.img_size null trains at the model's own size (swin_micro: 32): a model.img_size=32 given at
    evaluation is the size trained at, not another one; a language model or a weights file has no such size."""
    cfg = load_config([SWIN_DEMO])
    assert cfg.model.img_size is None
    payload = {"config": config_to_dict(cfg)}
    assert evaluate.trained_input_size(payload, language=False) == 32
    payload["config"]["model"]["img_size"] = 64
    assert evaluate.trained_input_size(payload, language=False) == 64
    assert evaluate.trained_input_size(None, language=False) is None
    assert evaluate.trained_input_size(payload, language=True) is None


def test_a_result_marked_for_its_size_names_both_sizes_and_older_files_are_not_marked():
    assert result_table.evaluated_otherwise({"img_size_changed": "384 (trained at 224)"}) == \
        "model.img_size=384 (trained at 224)"
    assert result_table.evaluated_otherwise({"img_size_changed": None}) is None
    assert result_table.evaluated_otherwise({}) is None  # a file written before the field


@pytest.mark.slow
def test_a_result_file_written_before_the_field_was_recorded_is_added_to(tmp_path):
    """A result file written before img_size_changed was recorded takes the field (its input size is compared
    through data.eval_transform): the same command adds to it. A run whose config sets model.img_size (the
    fashion_mnist recipes) was refused as another evaluation when the field held the configured size."""
    train.main(load_config([DEMO_CONFIG], [f"out_dir={tmp_path / 'run'}", "model.name=vit_nano", "model.img_size=32",
                                           "train.max_steps=2", "sched.epochs=1", "sched.warmup_epochs=0",
                                           "log.tensorboard=false"]))
    checkpoint, out = str(tmp_path / "run" / "best.pt"), tmp_path / "eval.json"
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out)]))
    older = json.loads(out.read_text())
    assert older.pop("img_size_changed") is None  # scored at the size it trained at
    out.write_text(json.dumps(older))
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "percentile", "--bits", "w8a8",
                                       "--out", str(out)]))
    saved = json.loads(out.read_text())
    assert saved["img_size_changed"] is None and "w8a8" in saved["quant"]["percentile"]
