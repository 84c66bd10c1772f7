"""model.pretrained=hub weights fine-tuned or scored with another input pipeline than timm records for them (their
pretrained_cfg: mean, std, eval crop and crop mode, interpolation) are named in one warning line of train.py's run
log and of evaluate.py's output, with both values and the overrides that match them; not refused (DeiT fine-tunes
with its own values). The reference is timm's own data config of the weights (timm.data.resolve_data_config), read
offline; the hub is a Hugging Face cache made here (nothing is fetched)."""
import dataclasses
import re

import pytest
import timm
from timm.data import resolve_data_config

import train
from conftest import run_entry
from configs import load_config
from hub_cache import make_hub_cache, serve_hub_cache
from models.hub import hub_data_mismatch

NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # timm records mean / std 0.5, crop_pct 0.9, bicubic
KEYS = ("mean", "std", "crop_pct", "interpolation")


def weights_data_config(name):
    """timm's data config of the hub weights of `name` (its model's pretrained_cfg), without weights or download."""
    resolved = resolve_data_config({}, model=timm.create_model(name, pretrained=False))
    return {key: tuple(v) if isinstance(v, tuple) else v for key, v in resolved.items() if key in KEYS}


def warned(cfg):
    """The line for `cfg` and the data keys it names as differing from the weights'."""
    line = hub_data_mismatch(cfg)
    return line, re.findall(r"data\.(\w+)=[^;]*? \(the weights': ", line)


def test_the_config_values_that_differ_from_the_weights_are_named_with_the_overrides_that_match_them():
    reference = weights_data_config(NAME)
    cfg = load_config(None, [f"model.name={NAME}", "model.pretrained=hub", "data.interpolation=bilinear"])
    line, named = warned(cfg)
    differ = [key for key in KEYS if getattr(cfg.data, key) != reference[key]]
    assert differ == list(KEYS), (reference, cfg.data)  # the schema's DeiT values and bilinear: all four differ
    assert sorted(named) == sorted(differ), line
    assert line.startswith(f"model.pretrained=hub ({NAME}): "), line
    # the overrides the line gives make the config's values the weights' own, and then nothing is said
    fixes = re.search(r"to match them, set (.*?) \(", line)[1].split()
    matched = load_config(None, [f"model.name={NAME}", "model.pretrained=hub", *fixes])
    assert {key: getattr(matched.data, key) for key in KEYS} == reference, fixes
    assert hub_data_mismatch(matched) == ""


@pytest.mark.parametrize("weights", ["", f"/weights/{NAME}.safetensors"])
def test_other_weights_than_the_hubs_are_not_compared(weights):
    # none: a tagged name without weights is refused where a config is loaded (tests/test_model_tag_weights.py), so
    # it is made here as a checkpoint's config may hold it
    cfg = load_config(None, [f"model.name={NAME}", "model.pretrained=hub"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=weights))
    assert hub_data_mismatch(cfg) == ""


def test_the_shipped_hub_fine_tuning_recipe_prepares_the_data_as_its_weights_were():
    cfg = load_config(["configs/finetune/vit_b_in21k.yaml"], [])
    assert cfg.model.pretrained == "hub"
    assert {key: getattr(cfg.data, key) for key in KEYS} == weights_data_config(cfg.model.name)
    assert hub_data_mismatch(cfg) == ""


@pytest.fixture
def hub(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("hf") / "hub"
    make_hub_cache(root, [NAME])
    serve_hub_cache(monkeypatch, root)


def test_train_py_fine_tunes_them_with_the_line_in_its_run_log(hub, debug_config):
    cfg = debug_config(f"model.name={NAME}", "model.pretrained=hub", "model.img_size=32", "train.max_steps=1",
                       "data.dataset=digits", "model.num_classes=10")
    train.main(cfg)
    with open(f"{cfg.out_dir}/train.log") as f:
        lines = [line for line in f if "the data are prepared otherwise than these weights" in line]
    assert len(lines) == 1 and " WARNING " in lines[0], lines
    assert "data.mean=[0.485, 0.456, 0.406] (the weights': [0.5, 0.5, 0.5])" in lines[0], lines


def test_evaluate_py_scores_them_with_the_line_in_its_output(hub, tmp_path, capsys):
    code, out, err = run_entry("evaluate.py", [
        "--config", "configs/debug/tiny.yaml", f"model.name={NAME}", "model.pretrained=hub", "model.num_classes=1000",
        "model.img_size=32", "data.dataset=digits", "data.crop_pct=0.9", "--quant", "--out", str(tmp_path / "e.json")],
        capsys)
    said = (out + err).splitlines()
    lines = [line for line in said if "the data are prepared otherwise than these weights" in line]
    assert len(lines) == 1, out + err
    # crop_pct is the weights' own here: only the normalization differs
    assert "data.mean=" in lines[0] and "data.std=" in lines[0] and "data.crop_pct" not in lines[0], lines
    # the 1000-class weights are then refused for the 10 digits (before anything is scored), after the line
    assert code == 1 and said[-1].startswith("error: the digits val split has 10 classes"), out + err


def test_synthetic_images_which_get_no_transform_are_not_compared():
    cfg = load_config(None, [f"model.name={NAME}", "model.pretrained=hub", "data.dataset=synthetic"])
    assert hub_data_mismatch(cfg) == ""


def test_weights_scored_on_a_squashed_image_name_the_center_crop():
    # timm scores these weights on the whole image squashed to a square (crop_mode squash, at crop_pct 1.0): the
    # schema's center crop at crop_pct 1.0 cuts a non-square image's sides off instead
    name = "convnext_tiny.fb_in22k_ft_in1k_384"
    reference = resolve_data_config({}, model=timm.create_model(name, pretrained=False))
    assert reference["crop_mode"] == "squash" and reference["crop_pct"] == 1.0, reference
    cfg = load_config(None, [f"model.name={name}", "model.pretrained=hub", "data.crop_pct=1.0"])
    line, named = warned(cfg)
    assert named == ["crop_mode"], line
    assert "data.crop_mode=center (the weights': squash)" in line, line
    fixes = re.search(r"to match them, set (.*?) \(", line)[1].split()
    matched = load_config(None, [f"model.name={name}", "model.pretrained=hub", "data.crop_pct=1.0", *fixes])
    assert matched.data.crop_mode == reference["crop_mode"], fixes
    assert hub_data_mismatch(matched) == ""
