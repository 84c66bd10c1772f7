"""APHQ's and GPLQ's own training images are drawn after the float pass; a train split with fewer readable images
than a count asks (unreadable files are known only when read) is refused naming the pipeline's setting that asked
(recon_images, init_images, ...), which the user can change, not "the pipeline's training images"."""
import pytest
import torch

from configs.loader import load_config
from data.folder import DataError
from evaluate import build_pipeline_data
from models import build_model
from tests.conftest import DEMO_CONFIG, make_folder, run_entry


def test_a_split_short_of_readable_images_names_the_setting_that_asked(tmp_path):
    make_folder(tmp_path, {"train": {"a": 3, "b": 3}})
    for name in ("0.png", "1.png"):  # two of six unreadable: four readable
        (tmp_path / "train" / "b" / name).write_bytes(b"not an image at all")
    cfg = load_config([], ["data.dataset=folder", f"data.root={tmp_path}", "model.num_classes=2"])
    data = build_pipeline_data(cfg, 16, 0, 1, str(tmp_path / "eval"))
    assert data.draw_train_images(4, 0, True, "recon_images=4").shape[0] == 4
    with pytest.raises(DataError) as e:  # a user's error: evaluate.py says it in one line (USER_ERRORS)
        data.draw_train_images(5, 0, True, "recon_images=5")
    assert str(e.value) == "recon_images=5: the train split has only 4 readable images; give at most that"


def test_evaluate_says_it_in_one_error_line(tmp_path, capsys):
    """After the float pass, APHQ's draw of one image more than the split's readable ones: one `error:` line naming
    calib_images, no traceback."""
    make_folder(tmp_path / "data", {"train": {"a": 3, "b": 3}, "val": {"a": 2, "b": 2}})
    for name in ("0.png", "1.png"):
        (tmp_path / "data" / "train" / "b" / name).write_bytes(b"not an image at all")
    overrides = ["data.dataset=folder", f"data.root={tmp_path / 'data'}", "model.num_classes=2"]
    torch.save(build_model(load_config([DEMO_CONFIG], overrides).model).state_dict(), tmp_path / "w.pt")
    argv = ["--config", DEMO_CONFIG, *overrides, f"model.pretrained={tmp_path / 'w.pt'}", "--quant", "aphq",
            "--bits", "w4a4", "quant.aphq.iters=0", "quant.aphq.calib_images=5", "--out", str(tmp_path / "r.json")]
    code, _, err = run_entry("evaluate.py", argv, capsys)
    lines = [line for line in err.strip().splitlines() if "Traceback" in line or line.startswith("error:")]
    assert code != 0 and lines == ["error: calib_images=5: the train split has only 4 readable images; give at most "
                                   "that"], err
