"""Command-line and config checks of the detection entry points that run before any model or data set is built,
so with mmcv-lite (no compiled ops): part of the default suite. The checks that build a detector are in
tests/test_detection_inputs.py (`detection` marker)."""
from __future__ import annotations

import pytest

pytest.importorskip("mmdet")

from detection_runs import SAMPLE_CONFIG, error_line  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_amp_training_without_a_gpu_is_one_error_line_before_any_work(tmp_path, capsys, monkeypatch, device):
    """The shipped Swin configs train with AmpOptimWrapper, whose constructor asserts a GPU inside runner.train(),
    after the config dump and the settings file were written: an AssertionError traceback on a CPU machine."""
    import mmengine.device
    monkeypatch.setattr(mmengine.device, "get_device", lambda: device)
    work = tmp_path / "work"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(tmp_path), "--work-dir", str(work),
                               "optim_wrapper.type=AmpOptimWrapper"])
    assert line == ("error: optim_wrapper.type=AmpOptimWrapper trains with AMP, which MMEngine runs on a GPU only, "
                    "and no GPU is visible: train on a GPU, or give optim_wrapper.type=OptimWrapper to train in "
                    "fp32 on the CPU"), line
    assert not work.exists()


def test_amp_training_on_a_gpu_and_fp32_training_on_the_cpu_pass_the_amp_check(monkeypatch):
    import mmengine.device
    from mmengine.config import Config
    import train_detection
    from mmengine.optim import AmpOptimWrapper

    class CpuAmp(AmpOptimWrapper):  # a subclass that may run on the CPU: left to its own constructor
        pass
    for device, kind in (("cuda", "AmpOptimWrapper"), ("cpu", "OptimWrapper"), ("cpu", None), ("cpu", CpuAmp)):
        monkeypatch.setattr(mmengine.device, "get_device", lambda: device)
        train_detection.check_amp(Config(dict(optim_wrapper=dict(type=kind) if kind else None)))
    with pytest.raises(ValueError, match="optim_wrapper.type=AmpOptimWrapper trains with AMP"):
        train_detection.check_amp(Config(dict(optim_wrapper=dict(type=AmpOptimWrapper))))
