"""scripts/dose_report.py's energy figure is titled with what its runs trained, read from their own best.pt configs
(scripts/training_title.py): the model, fine-tuning (model.pretrained set) or training from scratch, the data set and
the input size. It carried one sweep's title on every sweep's figure ("fine-tuning (DINOv2 ViT-S/14,
Fashion-MNIST 28 px)"), a from-scratch vit_micro at 32 px included. The titles are checked against the settings the
runs were written with here, and vit_nano's own input size (32 px, models/variants.py)."""
import json

import torch

from configs import load_config
from models import build_model
from engine.checkpoint import weights_fingerprint
from tests.conftest import DEMO_CONFIG
from tests.test_dose_report import write_run
from tests.test_mechanism import make_checkpoint

import dose_report


def write_sweep(root, **overrides):
    """A baseline and a CD point of two seeds each, every best.pt a vit_nano built with the config `overrides`."""
    for seed, name in enumerate(("baseline_s0", "baseline_s1", "cd10x_s0", "cd10x_s1")):
        folder = write_run(root, name, fp=80.0, w4=60.0, fc2_curve=[100.0, 90.0], norm1_max=4.0, seed=seed)
        make_checkpoint(folder / "best.pt", seed, **overrides)
        result = json.loads((folder / "eval_best.json").read_text())
        result["fingerprint"] = weights_fingerprint(torch.load(folder / "best.pt")["model"])  # as evaluate.py
        (folder / "eval_best.json").write_text(json.dumps(result))
    return root


def saved_titles(monkeypatch, *modules) -> dict:
    """file name -> the suptitle of each matplotlib Figure that `modules`' save_figure is given from now on (None
    for a figure without one); nothing is written."""
    titles = {}

    def keep(fig, path, overwrite, **options):
        titles[path.rsplit("/", 1)[-1]] = fig._suptitle.get_text() if fig._suptitle is not None else None
    for module in modules:
        monkeypatch.setattr(module, "save_figure", keep)
    return titles


def drawn_titles(monkeypatch, root, out) -> dict:
    """The suptitle of each figure dose_report.main draws, by file name, read from the matplotlib Figure it saves."""
    titles = saved_titles(monkeypatch, dose_report)
    dose_report.main([str(root), "--out", str(out)])
    return titles


def test_a_from_scratch_sweep_is_titled_with_its_own_model_data_and_size(tmp_path, monkeypatch):
    root = tmp_path / "sweep"
    root.mkdir()
    write_sweep(root)  # vit_nano on the embedded digits (configs/demo/vit_digits.yaml), no model.pretrained
    title = drawn_titles(monkeypatch, root, tmp_path / "o")["dose_energy.png"]
    assert title == "Pair energy during training from scratch (vit_nano, digits, 32 px)"
    assert "DINOv2" not in title and "Fashion-MNIST" not in title and "fine-tuning" not in title


def test_a_fine_tuning_sweep_is_titled_with_its_backbone_data_folder_and_size(tmp_path, monkeypatch):
    weights = tmp_path / "backbone.pt"  # the pretrained file the runs started from, at their 16 px
    torch.save(build_model(load_config([DEMO_CONFIG], ["model.name=vit_nano", "model.img_size=16"]).model)
               .state_dict(), weights)
    root = tmp_path / "sweep"
    root.mkdir()
    write_sweep(root, **{"model.pretrained": str(weights), "model.img_size": "16", "data.dataset": "folder",
                         "data.root": str(tmp_path / "data_sets" / "garments_small")})
    title = drawn_titles(monkeypatch, root, tmp_path / "o")["dose_energy.png"]
    assert title == "Pair energy during fine-tuning (vit_nano, garments_small, 16 px)"


def test_runs_that_differ_are_named_as_differing_not_as_one_of_them():
    from training_title import training_title

    scratch = load_config([DEMO_CONFIG], ["model.name=vit_nano"])
    tuned = load_config([DEMO_CONFIG], ["model.name=vit_micro", "model.pretrained=w.pt", "model.img_size=28",
                                        "data.dataset=synthetic"])
    assert training_title("Pair energy", [scratch, tuned, scratch]) == (
        "Pair energy during training from scratch / fine-tuning (the runs differ) (models differ: vit_nano / "
        "vit_micro, data sets differ: digits / synthetic, input sizes differ: 32 px / 28 px)")
    assert training_title("Pair energy", [tuned, tuned]) == "Pair energy during fine-tuning (vit_micro, synthetic, " \
                                                           "28 px)"
