"""train.tf32: TF32 for CUDA's float32 matmuls and cuDNN convolutions was turned on for every run (train.py
setup_process) while the run's log said "fp32 (no autocast)" and no setting turned it off. The key is honoured
(read back from torch's own switches), named in the precision line of a CUDA run, recorded in config.yaml, and
changes nothing on a CPU (the weights of two CPU runs compared bit for bit)."""
import os

import pytest
import torch
import yaml

import train
from engine.checkpoint import CheckpointError
from engine.distributed import DistInfo
from engine.precision import describe_precision, set_tf32

CPU = torch.device("cpu")


@pytest.fixture
def kept_tf32():
    """torch's TF32 switches as the test found them, put back after it (later tests read torch's defaults)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (matmul.allow_tf32, cudnn.allow_tf32)
    yield
    matmul.allow_tf32, cudnn.allow_tf32 = before


@pytest.mark.parametrize("tf32", [True, False])
def test_the_setting_sets_torch_s_tf32_switches(debug_config, kept_tf32, tf32):
    """After the run's setup, torch's switches are what train.tf32 asks, whatever they were before; false is
    full float32 precision for matmuls (torch's 'highest') and cuDNN alike."""
    cfg = debug_config(f"train.tf32={str(tf32).lower()}")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    os.makedirs(cfg.out_dir)  # the run's claim makes it
    train.setup_process(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=CPU))
    assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32


def test_the_default_is_tf32_on_as_timm_trains():
    from configs import Config
    assert Config().train.tf32 is True


def test_a_cuda_run_s_precision_line_says_what_its_fp32_math_runs_at(kept_tf32):
    """The line of a CUDA device (a string about it: nothing runs there) names TF32 and the setting; a CPU's is the
    line it always was. evaluate.py sets no switch and says what torch's own leave: matmuls at full precision,
    cuDNN convolutions at TF32."""
    cuda = torch.device("cuda")
    set_tf32(True)
    assert describe_precision("none", cuda, tf32="train.tf32=true") == (
        "precision: fp32 (no autocast) on cuda, fp32 matmuls and convolutions at TF32 (train.amp=none, "
        "train.tf32=true)")
    set_tf32(False)
    assert describe_precision("bf16", cuda, tf32="train.tf32=false") == (
        "precision: bf16 autocast on cuda, fp32 matmuls and convolutions at full fp32 precision (train.amp=bf16, "
        "train.tf32=false)")
    assert describe_precision("none", CPU, tf32="train.tf32=false") == (
        "precision: fp32 (no autocast) on cpu (train.amp=none)")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults
    assert describe_precision("none", cuda, key="--amp", scaler=False, tf32="") == (
        "precision: fp32 (no autocast) on cuda, fp32 matmuls at full fp32 precision, convolutions at TF32 "
        "(--amp=none)")


def test_on_a_cpu_the_setting_changes_nothing_and_config_yaml_records_it(debug_config, kept_tf32):
    """Two CPU runs, train.tf32 true and false, end with the same weights bit for bit; each config.yaml records
    its value."""
    weights = {}
    for tf32 in ("true", "false"):
        cfg = debug_config("train.max_steps=2", f"train.tf32={tf32}", name=tf32)
        train.main(cfg)
        with open(f"{cfg.out_dir}/config.yaml") as f:
            assert yaml.safe_load(f)["train"]["tf32"] is (tf32 == "true")
        weights[tf32] = torch.load(f"{cfg.out_dir}/checkpoint.pt", map_location="cpu", weights_only=False)["model"]
    assert weights["true"].keys() == weights["false"].keys()
    assert all(torch.equal(weights["true"][k], weights["false"][k]) for k in weights["true"])


def test_a_checkpoint_written_before_the_key_resumes_as_tf32_on(debug_config, caplog, kept_tf32):
    """Runs written before train.tf32 existed ran with TF32 on: their checkpoint's config lacks the key, and
    resumes with the default as no change; train.tf32=false there is a changed setting like any other."""
    train.main(debug_config("train.max_steps=2", name="old"))
    path = debug_config(name="old").out_dir + "/checkpoint.pt"
    payload = torch.load(path, map_location="cpu", weights_only=False)
    del payload["config"]["train"]["tf32"]
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match=r"other settings \(train.tf32: True -> False\)"):
        train.main(debug_config("train.max_steps=3", "train.tf32=false", name="old"))
    with caplog.at_level("WARNING"):
        assert train.main(debug_config("train.max_steps=3", name="old")).state.step == 3
    assert "resuming with changed settings" not in caplog.text
