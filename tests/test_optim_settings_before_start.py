"""optim.* settings the optimizer would not be built with as written (optim.name in upper case, optim.fused=true
for an optimizer torch has no fused kernel of, a recipe's betas beside one that reads none, optim.momentum=0 for
the Nesterov sgd) are refused by train.py before anything is made: they were refused only once out_dir was claimed
(train.log written) and the model and the data were built, inside build_run."""
import os
import subprocess
import sys

import pytest
import torch

import train
from configs import ConfigError, load_config
from engine.optim import build_optimizer
from tests.conftest import DEBUG_CONFIG, ROOT

NANO = os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")
REFUSALS = [
    (DEBUG_CONFIG, ["optim.name=ADAMW"],
     r"^optim.name=ADAMW: optimizer names are timm's, in lower case; use optim.name=adamw$"),
    (DEBUG_CONFIG, ["optim.name=lamb", "optim.fused=true"],
     r"^optim.fused=true: torch has no fused 'lamb'; use one of adamw, adam, sgd, momentum$"),
    (NANO, ["optim.name=nadamw"], r"^optim.betas=\[0.9, 0.95\] / optim.eps=1e-08 are read for adamw, adam, lamb only"),
    (DEBUG_CONFIG, ["optim.name=sgd", "optim.momentum=0"],
     r"^optim.momentum=0: timm's sgd is Nesterov, which needs momentum > 0; use optim.name=momentum for plain SGD$"),
    (DEBUG_CONFIG, ["optim.name=lookahead_lamb", "optim.clip_grad=5"],
     r"^optim.clip_grad=5: optim.name=lookahead_lamb clips the gradients to a global norm of 1 itself"),
]


def test_train_py_refuses_an_upper_case_optimizer_name_with_one_line_and_makes_nothing(tmp_path):
    """The reviewer's repro: `train.py --config configs/debug/tiny.yaml out_dir=/tmp/o optim.name=ADAMW` left
    /tmp/o/train.log behind its error."""
    out = tmp_path / "o"
    done = subprocess.run([sys.executable, "train.py", "--config", DEBUG_CONFIG, f"out_dir={out}",
                           "optim.name=ADAMW", "log.tensorboard=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["error: optim.name=ADAMW: optimizer names are timm's, in lower case; use "
                                        "optim.name=adamw"]
    assert not out.exists()


@pytest.mark.parametrize("recipe, overrides, message", REFUSALS,
                         ids=["upper_case", "fused_lamb", "nano_betas", "sgd_no_momentum", "lamb_clip"])
def test_each_refusal_comes_before_out_dir_is_claimed(tmp_path, recipe, overrides, message):
    """The check before start (check_before_start) refuses each; the run's folder is never made."""
    out = tmp_path / "run"
    cfg = load_config([recipe], [f"out_dir={out}", "log.tensorboard=false", *overrides])
    with pytest.raises(ConfigError, match=message):
        train.check_before_start(cfg)
    with pytest.raises(ConfigError, match=message):
        train.main(cfg)
    assert not out.exists()


@pytest.mark.parametrize("overrides", [["optim.name=adamw", "optim.fused=true"], ["optim.name=lamb"],
                                       ["optim.name=sgd", "optim.fused=false"],
                                       ["optim.name=lamb", "optim.clip_grad=0.5"], ["optim.clip_grad=5"]])
def test_what_builds_as_written_passes_the_check_before_start(overrides):
    """A fused kernel torch has (adamw), auto for one it lacks (lamb: unfused), and fused off pass."""
    train.check_before_start(load_config([DEBUG_CONFIG], overrides))


def test_sgd_without_momentum_is_what_torch_refuses_and_plain_sgd_builds():
    """timm's sgd is torch's SGD with nesterov=True, which torch refuses at momentum 0 (the error train.py printed
    once the model and the data were built, naming no key); optim.name=momentum at momentum 0 is plain SGD."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0, nesterov=True)
    cfg = load_config([DEBUG_CONFIG], ["optim.name=momentum", "optim.momentum=0"])
    train.check_before_start(cfg)
    optimizer = build_optimizer(model, cfg.optim, 0.1, 0.0)
    assert {(g["momentum"], g["nesterov"]) for g in optimizer.param_groups} == {(0.0, False)}


def test_a_clip_above_lambs_own_never_acts():
    """The premise of the lamb_clip refusal, from timm's Lamb itself: gradients of global norms 100 then 0.2 clipped
    to 5 before each step move the weights as the unclipped ones (Lamb clips the first to 1.0 inside), while a bound
    of 0.5 does act (the Adam moments see the two updates' gradients at another ratio)."""
    def steps(clip):
        layer = torch.nn.Linear(8, 8).double()
        for p in layer.parameters():
            torch.nn.init.constant_(p, 0.5)
        optimizer = build_optimizer(layer, load_config([DEBUG_CONFIG], ["optim.name=lamb"]).optim, 1e-2, 0.0)
        generator = torch.Generator().manual_seed(0)
        for norm in (100.0, 0.2):
            grads = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in layer.parameters()]
            total = torch.cat([g.flatten() for g in grads]).norm()
            for p, g in zip(layer.parameters(), grads):
                p.grad = g * (norm / total)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(layer.parameters(), clip)
            optimizer.step()
        return torch.cat([p.detach().flatten() for p in layer.parameters()])
    unclipped = steps(None)
    assert torch.allclose(steps(5.0), unclipped, rtol=0, atol=1e-12)
    assert (steps(0.5) - unclipped).abs().max() > 1e-4
