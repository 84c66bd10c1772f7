"""A folder's images whose names timm's natural-key order ties (1.png and 01.png) are put in name order
(data/folder.py ties_in_name_order); before, they kept the directory listing's order. A checkpoint written then
records nothing of it (its data fingerprint hashes the sorted names), so a run stopped inside an epoch and resumed
now reads those indices as other images of their class: the rest of the epoch may see some twice and others not at
all. The resumed run says so in its log, naming how many images moved; a checkpoint that records the order
(`tie_order`), or one written at an epoch's end, resumes without a word."""
import os

import pytest
import torch
from PIL import Image

import train
from configs import load_config
from conftest import DEBUG_CONFIG, make_folder
from data.folder import build_folder_dataset
from engine.resume import note_moved_ties

WARNING = "was written while images whose names sort as one"


@pytest.fixture
def tied_folder(tmp_path, monkeypatch):
    """A folder whose class a holds 01.png and 02.png beside 1.png and 2.png, listed in reverse name order (as a
    directory's hash order may list them), so that name order moves 4 of its 16 training images."""
    root = tmp_path / "data"
    make_folder(root, {"train": {"a": 6, "b": 8}, "val": {"a": 2, "b": 2}})
    for i in (1, 2):
        Image.open(root / "train" / "a" / f"{i}.png").transpose(Image.FLIP_LEFT_RIGHT).save(
            root / "train" / "a" / f"0{i}.png")
    walk = os.walk

    def reverse_listing(*args, **kwargs):
        for folder, dirs, names in walk(*args, **kwargs):
            yield folder, dirs, sorted(names, reverse=True)

    monkeypatch.setattr(os, "walk", reverse_listing)
    return root


def test_the_images_name_order_moves_are_counted(tied_folder):
    dataset = build_folder_dataset(str(tied_folder), "train")
    assert dataset.moved_ties == 4  # 1.png, 01.png, 2.png, 02.png: each in the other's place
    assert build_folder_dataset(str(tied_folder), "val").moved_ties == 0


def test_a_run_stopped_inside_an_epoch_before_the_order_was_recorded_says_its_epoch_is_not_exact(tied_folder,
                                                                                               tmp_path):
    overrides = ["data.dataset=folder", f"data.root={tied_folder}", "model.num_classes=2", "data.auto_augment=",
                 "train.batch_size=4", "train.batch_size_per_gpu=4", "sched.epochs=1", "sched.warmup_epochs=0",
                 "sched.min_lr=0", f"out_dir={tmp_path / 'run'}"]
    cfg = load_config([DEBUG_CONFIG], overrides + ["train.max_steps=2"])
    train.main(cfg)  # 2 of the epoch's 4 updates
    path = os.path.join(cfg.out_dir, "checkpoint.pt")
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["epoch_position"]["samples"] == 8 and ckpt["epoch_position"]["tie_order"] == "name"
    del ckpt["epoch_position"]["tie_order"]  # as written before the order was recorded
    torch.save(ckpt, path)
    assert train.main(load_config([DEBUG_CONFIG], overrides)).state.step == 4
    with open(os.path.join(cfg.out_dir, "train.log")) as f:
        log = f.read()
    assert f"{path} {WARNING} (1.png and 01.png) kept the directory listing's order" in log
    assert "4 of the training split's images take other places now" in log


def test_the_note_is_given_only_inside_an_epoch_of_moved_images_without_a_recorded_order(caplog):
    older = {"samples": 8}
    with caplog.at_level("WARNING"):
        note_moved_ties(older, 2, 4, "c.pt")
        assert WARNING in caplog.text
        caplog.clear()
        note_moved_ties(None, 2, 4, "c.pt")  # older still: no epoch_position at all
        assert WARNING in caplog.text
        caplog.clear()
        note_moved_ties({**older, "tie_order": "name"}, 2, 4, "c.pt")  # recorded: the order it began with
        note_moved_ties(older, 0, 4, "c.pt")  # at an epoch's end: every later epoch is read whole
        note_moved_ties(older, 2, 0, "c.pt")  # no tie moved: every index is the image it was
        assert WARNING not in caplog.text
