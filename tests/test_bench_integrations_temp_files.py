"""scripts/bench_integrations.py leaves no files behind: the Trainer's output_dir and the MMEngine Runner's
work_dir (its config dump and log) are temporary folders it removes after each run; they were made with
tempfile.mkdtemp and kept, two more per framework and repeat."""
import logging
import os

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch's compile cache folder is made in the temp folder at its import: not ours)

from tests.conftest import load_script


@pytest.mark.parametrize("framework", ["plain", "hf", "lightning", "mmengine"])
def test_each_runner_removes_the_folders_it_made(framework, tmp_path, monkeypatch):
    if framework != "plain":
        pytest.importorskip({"hf": "transformers"}.get(framework, framework))
    import tempfile

    bench = load_script("bench_integrations")
    temp, cwd = tmp_path / "t", tmp_path / "cwd"
    temp.mkdir()
    cwd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where tempfile makes its folders
    monkeypatch.chdir(cwd)  # nor anything in the working folder
    threads = torch.get_num_threads()
    try:
        bench.main(["--frameworks", framework, "--warmup", "0", "--steps", "1", "--repeats", "1",
                    "--width", "32", "--depth", "1", "--batch", "2"])
    finally:
        torch.set_num_threads(threads)
    assert os.listdir(temp) == [] and os.listdir(cwd) == [], (os.listdir(temp), os.listdir(cwd))
    if framework == "mmengine":  # its log was closed before its folder went (Windows cannot remove an open file)
        from mmengine.logging import MMLogger
        open_logs = [h.baseFilename for logger in MMLogger._instance_dict.values() for h in logger.handlers
                     if isinstance(h, logging.FileHandler) and h.baseFilename.startswith(str(temp))]
        assert open_logs == []
