"""A run's checkpoints record the software that trained their weights (engine/runinfo.py trained_software), part by
part: a resume under other software adds its part, one under the same keeps the list, and a checkpoint written
before the record stands for its part as null. evaluate.py copies the list into the result file
(tests/test_evaluate.py test_the_result_file_names_the_software_that_scored_it)."""
import platform

import timm
import torch

import train
from configs import load_config
from engine.checkpoint import save_atomic
from tests.conftest import DEBUG_CONFIG

OLD = {"commit": "0123abc", "torch": "2.4.0", "timm": "1.0.9", "python": "3.10.0"}


def recorded(path) -> list:
    return torch.load(path, weights_only=False, map_location="cpu")["software"]


def test_a_checkpoint_records_the_software_of_each_part_of_its_run(tmp_path):
    out = tmp_path / "run"
    common = [f"out_dir={out}", "log.tensorboard=false"]
    train.main(load_config([DEBUG_CONFIG], [*common, "train.max_steps=2"]))
    now = recorded(out / "checkpoint.pt")
    assert len(now) == 1 and now[0]["torch"] == torch.__version__ and now[0]["timm"] == timm.__version__
    assert now[0]["python"] == platform.python_version() and recorded(out / "best.pt") == now

    def resume_after(software, steps: int) -> None:
        payload = torch.load(out / "checkpoint.pt", weights_only=False, map_location="cpu")
        if software is None:
            del payload["software"]  # written before checkpoints recorded it
        else:
            payload["software"] = software
        save_atomic(payload, str(out / "checkpoint.pt"))
        train.main(load_config([DEBUG_CONFIG], [*common, f"train.max_steps={steps}"]))

    resume_after(now, 4)  # the same software: one part
    assert recorded(out / "checkpoint.pt") == now
    resume_after([OLD], 6)  # trained under torch 2.4.0 before: a part of its own
    assert recorded(out / "checkpoint.pt") == [OLD, *now]
    resume_after(None, 8)
    assert recorded(out / "checkpoint.pt") == [None, *now]
