"""The sample detector the MMDetection tests share: the generated COCO-format sample (data/coco_sample.py), the
tiny Mask R-CNN + Swin config for it, and training through scripts/train_detection.py. The fixtures reach every
test module through conftest.py's `pytest_plugins` (module-scoped: each module that asks trains once)."""
from __future__ import annotations

import importlib

import pytest

SAMPLE_CONFIG = "configs/detection/debug/mask_rcnn_swin_sample.py"


@pytest.fixture(scope="module")
def mmdet_ready():
    pytest.importorskip("mmdet")
    try:
        importlib.import_module("mmcv._ext")  # the compiled ops: mmcv-lite has none
    except ImportError as e:
        pytest.fail(f"the detection tests need full mmcv (bash scripts/install_mmcv.sh): {e}")


@pytest.fixture(scope="module")
def sample(tmp_path_factory, mmdet_ready):
    from data.coco_sample import write_coco_sample
    root = str(tmp_path_factory.mktemp("coco") / "sample")
    write_coco_sample(root, train=8, val=4, size=64, seed=0)
    return root


def train(sample, work_dir, *overrides, epochs=1, configs=()):
    """Train the sample detector `epochs` epochs into `work_dir`; the path of its last checkpoint."""
    from train_detection import main
    extra = [a for c in configs for a in ("--config", c)]
    # validation after the last epoch only, unless the caller sets it (a key given twice is refused)
    given = {o.split("=", 1)[0] for o in overrides}
    defaults = [d for d in ("randomness.seed=0", "train_cfg.val_interval=100") if d.split("=", 1)[0] not in given]
    assert main(["--config", SAMPLE_CONFIG, *extra, "--data-root", sample, "--work-dir", str(work_dir),
                 f"train_cfg.max_epochs={epochs}", *defaults, *overrides]) == 0
    return str(work_dir / f"epoch_{epochs}.pth")


@pytest.fixture(scope="module")
def trained(sample, tmp_path_factory):
    """The sample detector after 3 epochs (its weights file)."""
    return train(sample, tmp_path_factory.mktemp("run"), epochs=3)


def error_line(capsys, argv):
    """The one `error:` line (exit code 2, no traceback) train_detection.run prints for `argv`."""
    import train_detection
    with pytest.raises(SystemExit) as stop:
        train_detection.run(argv)
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]
