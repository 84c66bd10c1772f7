"""Numbers that are not numbers: weights with a NaN or an inf are refused wherever they enter (a checkpoint to
evaluate, a model.pretrained file, a checkpoint to resume), naming the tensor; an evaluation whose logits
or loss are not finite is an error naming the batch; nothing is written for them."""
import os

import pytest
import torch

import evaluate
import train
from engine.checkpoint import CheckpointError
from engine.loop import NonFiniteLossError, evaluate as evaluate_loader
from models import ModelError
from tests.conftest import run_entry


def spoiled(path, out, value, key="blocks.0.mlp.fc2.weight"):
    """A copy of the checkpoint at `path` with one value of `key` set to `value`."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    payload["model"][key].view(-1)[3] = value
    torch.save(payload, out)
    return str(out)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_evaluate_refuses_non_finite_weights_naming_the_tensor(checkpoint, tmp_path, value):
    bad = spoiled(checkpoint, tmp_path / "bad.pt", value)
    out = tmp_path / "r.json"
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp\.fc2\.weight \((1 NaN, 0|0 NaN, 1) inf"):
        evaluate.main(evaluate.parse_args(["--checkpoint", bad, "--out", str(out)]))
    assert not out.exists() and not (tmp_path / "r_act_max.csv").exists()


def test_the_command_line_ends_in_one_error_line(checkpoint, tmp_path, capsys):
    """evaluate.py's __main__ in this process (run_entry: a process would import torch again); what a real
    process adds to stderr around it: test_usage_errors.py::test_the_whole_process_writes_one_line_and_exits_2."""
    bad = spoiled(checkpoint, tmp_path / "bad.pt", float("nan"))
    code, _, err = run_entry("evaluate.py", ["--checkpoint", bad, "--quant"], capsys)
    assert code == 1 and err.strip().splitlines()[-1].startswith("error: "), err[-2000:]
    assert "Traceback" not in err and not os.path.exists(tmp_path / "eval_bad.json")


def test_a_pretrained_file_with_non_finite_weights_is_refused(checkpoint, tmp_path, debug_config):
    weights = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    weights["head.bias"][0] = float("nan")
    path = tmp_path / "w.pth"
    torch.save(weights, path)
    with pytest.raises(ModelError, match=r"head\.bias \(1 NaN"):
        train.main(debug_config("model.num_classes=10", f"model.pretrained={path}"))


def test_resuming_from_non_finite_weights_is_refused_naming_the_file(debug_config):
    cfg = debug_config("train.max_steps=2", name="r")
    train.main(cfg)
    ckpt = os.path.join(cfg.out_dir, "checkpoint.pt")
    spoiled(ckpt, ckpt, float("nan"))
    with pytest.raises(CheckpointError, match=r"cannot resume from .*checkpoint\.pt .*NaN or inf.*"
                                              r"blocks\.0\.mlp\.fc2\.weight"):
        train.main(debug_config(name="r"))


def test_non_finite_logits_in_an_evaluation_name_the_batch():
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.zeros(10, dtype=torch.long))
    loader = torch.utils.data.DataLoader(data, batch_size=4)

    class Sums(torch.nn.Module):  # no weights at all: an inf image gives inf logits
        def forward(self, x):
            return torch.stack([x.sum(1), -x.sum(1)], 1)

    model = Sums()
    assert evaluate_loader(model, loader, torch.device("cpu"))["count"] == 10
    data.tensors[0][5] = float("inf")
    with pytest.raises(NonFiniteLossError, match=r"FP eval: the logits of batch 1 \(first image image 4\) "
                                                 r"are NaN or inf.*nothing is\s+written"):
        evaluate_loader(model, loader, torch.device("cpu"), progress="FP eval")


@pytest.mark.parametrize("key", ["model", "model_ema"])
def test_a_checkpoint_with_non_finite_weights_or_ema_weights_is_not_resumable(tmp_path, key):
    from engine.snapshots import read_training_checkpoint

    payload = {"model": {"w": torch.ones(2)}, "model_ema": {"w": torch.ones(2)}, "optimizer": {}, "state": {},
               "config": {s: {} for s in ("model", "data", "optim", "sched", "train")}}
    torch.save(payload, tmp_path / "good.pt")
    assert read_training_checkpoint(str(tmp_path / "good.pt"))[0] is not None
    payload[key]["w"][1] = float("nan")
    torch.save(payload, tmp_path / "bad.pt")
    got, problem = read_training_checkpoint(str(tmp_path / "bad.pt"))
    assert got is None and "NaN or inf values (1 tensors, e.g. w (1 NaN, 0 inf of 2 values))" in problem


def test_nonfinite_tensors_counts_each_tensors_nan_and_inf_in_order():
    """models.modules.nonfinite_tensors on a state dict written by hand: per floating tensor holding a NaN or an inf,
    its NaN and inf counts over all its values (a 2x3 matrix: 6), in the dict's order; finite, integer and bool
    tensors and non-tensor entries (a quantizer's `_extra_state` dict) are passed over."""
    from models.modules import nonfinite_tensors

    nan, inf = float("nan"), float("inf")
    state = {"z.weight": torch.tensor([[1.0, nan, inf], [nan, 2.0, 3.0]]),
             "finite": torch.ones(3),
             "steps": torch.tensor([7, 8]),
             "mask": torch.tensor([True, False]),
             "q._extra_state": {"bits": 4},
             "a.bias": torch.tensor([-inf, 0.0, inf, 1.0], dtype=torch.float64)}
    assert nonfinite_tensors(state) == ["z.weight (2 NaN, 1 inf of 6 values)", "a.bias (0 NaN, 2 inf of 4 values)"]
    assert nonfinite_tensors({"finite": torch.zeros(2, 2)}) == []
