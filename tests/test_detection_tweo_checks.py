"""TWEO settings of a detection run that would train otherwise than asked (scripts/train_detection.py), each one
`error:` line before the Runner is built: MMEngine's activation_checkpointing of a module that holds a Swin block
TweoHook penalizes, and tau or eps beside the rescaled form. The alternatives the refusal names (checkpointing the
blocks themselves, or the Swin backbone's with_cp=True) keep every block in the term and the gradients of a run
without checkpointing.

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from detection_runs import SAMPLE_CONFIG, error_line

pytestmark = pytest.mark.detection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWEO = os.path.join(ROOT, "configs", "detection", "method", "tweo.py")


def argv(sample, tmp_path, *overrides):
    return ["--config", SAMPLE_CONFIG, "--config", TWEO, "--data-root", sample, "--work-dir", str(tmp_path / "w"),
            "train_cfg.max_epochs=1", *overrides]


@pytest.mark.parametrize("checkpointed, block", [("[backbone.stages.0]", "backbone.stages.0.blocks.0"),
                                                 ("[neck,backbone]", "backbone.stages.0.blocks.0"),
                                                 ("backbone.stages.2", "backbone.stages.2.blocks.0")])
def test_checkpointing_a_module_that_holds_a_penalized_block_is_one_error_line_before_the_runner(
        capsys, sample, tmp_path, checkpointed, block):
    """Before the fix the stage trained without grad (L_TWEO over 3 blocks of 4), one update was applied and a
    RuntimeError traceback blamed a train_step without parse_losses."""
    line = error_line(capsys, argv(sample, tmp_path, f"activation_checkpointing={checkpointed}"))
    named = checkpointed.strip("[]").split(",")[-1]
    assert line.startswith(f"error: activation_checkpointing names {named}, which contains the block {block} "), line
    assert "checkpoint the blocks themselves" in line and "model.backbone.with_cp=True" in line
    assert not (tmp_path / "w").exists()  # refused before the Runner (and its work dir, log, config dump)


@pytest.mark.parametrize("overrides", [["activation_checkpointing=[backbone.stages.0.blocks.0,backbone.patch_embed,"
                                        "neck]"],
                                       ["model.backbone.with_cp=True"]])
def test_checkpointing_the_blocks_themselves_or_inside_them_passes_the_check(mmdet_ready, overrides):
    from engine.detection import check_hooks, load_config, parse_overrides
    check_hooks(load_config([SAMPLE_CONFIG, TWEO], parse_overrides(overrides)))


@pytest.mark.parametrize("override, named", [("custom_hooks.0.tau=5", "tau=5 would be ignored"),
                                             ("custom_hooks.0.eps=0.01", "eps=0.01 would be ignored")])
def test_tau_or_eps_beside_the_rescaled_form_is_one_error_line(capsys, sample, tmp_path, override, named):
    """train.py refuses tweo.tau beside tweo.rescale=true; a detection run took it (rc 0) and trained as without."""
    line = error_line(capsys, argv(sample, tmp_path, override))
    assert line.startswith("error: custom_hooks.0 (TweoHook) cannot be built with its arguments (ValueError: "
                           f"TweoHook {named}: "), line
    assert "give rescale=False" in line and not (tmp_path / "w").exists()


def test_tau_with_the_plain_form_passes_the_check(mmdet_ready):
    from engine.detection import check_hooks, load_config, parse_overrides
    check_hooks(load_config([SAMPLE_CONFIG, TWEO], parse_overrides(["custom_hooks.0.rescale=False",
                                                                      "custom_hooks.0.tau=5"])))


def naive_penalty(outputs):
    """L_TWEO of App. A.3 written out: the mean over the blocks of mean((|A| / (3 + 1e-6))^4)."""
    return torch.stack([((a.abs() / (3.0 + 1e-6)) ** 4).mean() for a in outputs]).mean()


def test_the_alternatives_the_refusal_names_keep_every_block_in_the_term_and_the_gradients(mmdet_ready):
    """The sample's Swin backbone (4 blocks), float64: with_cp=True (checkpoints inside each block) and MMEngine's
    checkpointing of each block give the penalty of the blocks' outputs written out and the gradient of the same
    backbone without checkpointing, with nothing captured in the backward pass."""
    from mmdet.registry import MODELS
    from mmengine.runner.activation_checkpointing import turn_on_activation_checkpointing

    from cd.tweo import TWEO as Penalty
    from engine.detection import load_config
    cfg = load_config([SAMPLE_CONFIG]).model.backbone
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)

    def run(with_cp=False, checkpointed=()):
        torch.manual_seed(0)
        backbone = MODELS.build({**copy.deepcopy(cfg), "with_cp": with_cp}).double()
        backbone.train()  # MMDetection's Swin returns None from train()
        if checkpointed:
            turn_on_activation_checkpointing(backbone, list(checkpointed))
        outputs = []
        blocks = [backbone.get_submodule(f"stages.{s}.blocks.0") for s in range(4)]
        handles = [b.register_forward_hook(lambda m, a, o: outputs.append(o.detach())) for b in blocks]
        with Penalty(backbone, lam=1.0) as tweo:
            features = backbone(x)
            terms = len(tweo._terms)
            loss = sum(f.pow(2).mean() for f in features) + tweo.aux_loss(features[0].sum())
            loss.backward()
            assert not tweo.pending  # nothing captured again in the backward pass
        for h in handles:
            h.remove()
        grads = torch.cat([p.grad.flatten() for p in backbone.parameters() if p.grad is not None])
        assert len(outputs) == 4  # each block ran once through its module call
        return terms, tweo.metrics()["tweo/penalty"], naive_penalty(outputs).item(), grads

    terms, penalty, naive, reference = run()
    assert terms == 4 and penalty == pytest.approx(naive, rel=1e-12)
    for kind in (dict(with_cp=True), dict(checkpointed=[f"stages.{s}.blocks.0" for s in range(4)])):
        terms, penalty, naive, grads = run(**kind)
        assert terms == 4 and penalty == pytest.approx(naive, rel=1e-12), kind
        torch.testing.assert_close(grads, reference, rtol=1e-10, atol=1e-12, msg=str(kind))
