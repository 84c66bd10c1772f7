"""evaluate.py refuses a model.pretrained weights file that is not there, and val data that a listing or a token
file's size refuses (a data.root that is not there, a val split missing, a token file that is no file of uint16
ids), before it makes --out's folder and opens its eval.log there: the refusals came from the weights' load and the
val loader's build, after a typo had made the folder and written the log. The corrected command then writes its
result in that folder, as in a new one."""
import numpy as np
import pytest
import torch

from configs import load_config
from models import build_model
from tests.conftest import DEBUG_CONFIG, ROOT, run_entry
from tests.test_data import make_image_folder

LM_CONFIG = f"{ROOT}/configs/lm/kjv_nano.yaml"


def weights(tmp_path, config: str, *overrides: str) -> str:
    """A weights file of the model `config` (with `overrides`) builds: its initial weights."""
    torch.manual_seed(0)
    path = tmp_path / "weights.pt"
    torch.save(build_model(load_config([config], list(overrides)).model).state_dict(), path)
    return str(path)


def image_setup(tmp_path, case: str) -> tuple[dict, dict]:
    """({key: value} of a command that evaluates, {key: value} that breaks it) for `case`."""
    make_image_folder(tmp_path / "data", per_class=2)
    given = {"data.dataset": "folder", "data.root": tmp_path / "data", "model.num_classes": 2,
             "train.eval_batch_size_per_gpu": 2}
    given["model.pretrained"] = weights(tmp_path, DEBUG_CONFIG, "model.num_classes=2")
    broken = {"weights": {"model.pretrained": tmp_path / "wieghts.pt"}, "root": {"data.root": tmp_path / "dta"},
              "val split": {"data.val_split": "valid"}}[case]
    return given, broken


def token_setup(tmp_path, case: str) -> tuple[dict, dict]:
    """As image_setup, of a folder holding nanoGPT's val.bin (ids below the 65 of kjv_nano)."""
    root = tmp_path / "tokens"
    root.mkdir()
    (np.arange(4_000) % 60).astype(np.uint16).tofile(root / "val.bin")
    (root / "odd.bin").write_bytes(b"\x01\x00\x02")
    given = {"data.dataset": "tokens", "data.root": root, "data.val_windows": 0,
             "model.pretrained": weights(tmp_path, LM_CONFIG)}
    broken = {"root": {"data.root": tmp_path / "tokns"}, "odd bytes": {"data.val_split": "odd"}}[case]
    return given, broken


@pytest.mark.parametrize("config, case, says", [
    (DEBUG_CONFIG, "weights", "pretrained weights not found"),
    (DEBUG_CONFIG, "root", "does not exist or is not a folder"),
    (DEBUG_CONFIG, "val split", "no 'valid' split in"),
    (LM_CONFIG, "root", "is not a folder: give the folder holding"),
    (LM_CONFIG, "odd bytes", "odd.bin is empty or has an odd number of bytes (3)"),
])
def test_an_input_refused_by_its_listing_leaves_no_out_folder_and_the_corrected_command_writes_there(
        tmp_path, capsys, config, case, says):
    given, broken = (image_setup if config == DEBUG_CONFIG else token_setup)(tmp_path, case)
    out = tmp_path / "results" / "r.json"
    command = lambda settings: ["--config", config, "--quant", "--out", str(out),
                                *(f"{k}={v}" for k, v in settings.items())]
    code, _, err = run_entry("evaluate.py", command({**given, **broken}), capsys)
    assert code == 1 and err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert not out.parent.exists()
    code, _, err = run_entry("evaluate.py", command(given), capsys)
    assert code == 0, err
    assert out.is_file() and (out.parent / "eval.log").is_file()
