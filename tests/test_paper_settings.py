"""The hyperparameters the paper states, against what its sweeps resolve to.

Each run of a sweep that reproduces a table (configs/sweeps/*.yaml) is resolved as `scripts/sweep.py` resolves
it, and its settings are compared with the numbers printed in paper/colinearity_decay.tex: Sec. 4.1 and
App. A.2 (lam = wd / 10, the budget wd - lam), Sec. 4.5 and App. "Additional Experimental Details"
(fine-tuning), Tables 4a / 4b / 5 (ablations) and App. "GPT-2 Language Modeling" (Table 8). The expected
values are typed in from the paper, never read from the configs. The DeiT / Swin recipe keys are checked in
tests/test_configs.py.
"""
import os
import runpy

import pytest
import torch

from configs import load_config
from tests.conftest import ROOT

import sweep


def resolved(sweep_file, *overrides):
    """name -> resolved Config of every run of a sweep file: the configs and overrides sweep.py trains with,
    then its evaluation overrides (the quantized columns)."""
    runs = sweep.expand(os.path.join(ROOT, "configs", "sweeps", sweep_file), list(overrides))
    return {r["name"]: load_config([os.path.join(ROOT, c) for c in r["configs"]], r["overrides"] + r["evaluate"])
            for r in runs}


def budgeted_wd(cfg):
    """The weight decay a run trains with: the paper's budget rule wd - lam with CD on (App. A.2)."""
    return cfg.optim.weight_decay - cfg.cd.lam if cfg.cd.enabled and cfg.cd.budget else cfg.optim.weight_decay


def test_table1_pretraining_cd_is_one_tenth_of_wd_and_keeps_the_budget():
    runs = resolved("pretrain_main.yaml", "data.root=/datasets/imagenet")
    for model in ("vit_t", "vit_s", "vit_b", "swin_t"):
        base, cd = runs[f"{model}_baseline"], runs[f"{model}_cd"]
        assert not base.cd.enabled and not base.tweo.enabled and base.optim.weight_decay == 0.05, model
        assert cd.cd.enabled and cd.cd.mode == "decoupled" and cd.cd.targets == "A+B", model
        assert cd.cd.lam == pytest.approx(0.005) and budgeted_wd(cd) == pytest.approx(0.045), model
        assert cd.cd.lam_per_role == {}, model
        # App. A.3: TWEO on every block output with p = 4, tau = 3
        tweo = runs[f"{model}_tweo"]
        assert tweo.tweo.enabled and not tweo.cd.enabled, model
        assert (tweo.tweo.p, tweo.tweo.tau) == (4.0, 3.0), model
        for cfg in (base, cd, tweo):  # Sec. 4.1: AMP and AdamW everywhere
            assert cfg.optim.name == "adamw" and cfg.train.amp == "fp16", model


def test_table1_quantized_columns_are_repq_and_aphq_at_w4a4():
    runs = resolved("pretrain_main.yaml", "data.root=/datasets/imagenet")
    for name, cfg in runs.items():
        assert sorted(cfg.quant.pipelines) == ["aphq", "repq"], name
        assert cfg.quant.bits in ([], ["w4a4"]), name  # evaluate.py's default bit width is W4A4
        assert not cfg.quant.aphq.mlp_reconstruct, name  # Sec. 4.1: APHQ without MLP reconstruction


def test_table4a_cd_strengths_with_the_budget_rule():
    runs = resolved("cd_lambda.yaml", "data.root=/datasets/imagenet")
    assert not runs["baseline"].cd.enabled and runs["baseline"].optim.weight_decay == 0.05
    for lam in (0.0025, 0.005, 0.01):
        cfg = runs[f"lam{lam}"]
        assert cfg.model.name == "vit_base_patch16_224" and cfg.cd.enabled
        assert cfg.cd.lam == pytest.approx(lam) and budgeted_wd(cfg) == pytest.approx(0.05 - lam)


def test_table4b_update_forms():
    runs = resolved("cd_form.yaml", "data.root=/datasets/imagenet")
    assert not runs["baseline"].cd.enabled and runs["baseline"].optim.weight_decay == 0.05  # the table's first row
    assert (runs["decay_0.005"].cd.mode, runs["decay_0.005"].cd.lam) == ("decoupled", 0.005)
    for coef in (0.01, 0.005):
        cfg = runs[f"loss_{coef}"]
        assert cfg.cd.enabled and cfg.cd.mode == "loss" and cfg.cd.loss_coef == pytest.approx(coef)


def test_table5_target_sets():
    runs = resolved("cd_targets.yaml", "data.root=/datasets/imagenet")
    assert not runs["baseline"].cd.enabled
    for targets in ("A", "B", "C", "A+B"):
        cfg = runs[targets]
        assert cfg.cd.enabled and cfg.cd.targets == targets and cfg.cd.lam == pytest.approx(0.005)


def test_table3_finetuning_recipe_and_cd_strengths():
    runs = resolved("finetune.yaml", "model.pretrained=/weights/vit_b_in21k.safetensors")
    assert len(runs) == 27  # nine data sets x baseline / CD / TWEO
    for name, cfg in runs.items():
        assert cfg.model.name == "vit_base_patch16_224.orig_in21k", name
        assert (cfg.optim.name, cfg.optim.lr, cfg.optim.layer_decay) == ("adamw", 5e-4, 0.9), name
        assert (cfg.model.drop_path, cfg.data.label_smoothing, cfg.train.amp) == (0.1, 0.1, "fp16"), name
        assert cfg.quant.pipelines == ["repq"], name
        if name.endswith("_cd"):  # lam 0.01 for every target, 0.02 for W_F2, the budget on the base lam
            assert cfg.cd.lam == pytest.approx(0.01) and cfg.cd.lam_per_role == {"fc2": 0.02}, name
            assert budgeted_wd(cfg) == pytest.approx(0.04), name
        else:
            assert cfg.optim.weight_decay == 0.05 and not cfg.cd.enabled, name
        if name.endswith("_tweo"):  # "TWEO again uses the stabilized loss rescaling"
            assert cfg.tweo.enabled and cfg.tweo.rescale, name
        if name.startswith("imagenet_"):
            continue
        # the eight small data sets: batch 64 (one GPU), eval batch 256, 5 warmup + 75 cosine epochs
        assert (cfg.train.batch_size, cfg.train.eval_batch_size_per_gpu) == (64, 256), name
        assert (cfg.sched.epochs, cfg.sched.warmup_epochs, cfg.sched.warmup_prefix) == (80, 5, True), name


def test_table3_imagenet_row_is_20k_updates_of_512_with_500_warmup_updates():
    """App. "Additional Experimental Details": the ImageNet-1K row is "a step-based recipe ... 500 warmup steps, 20k
    total steps". The recipe once ran 8 epochs (20,016 updates, warmup 0.1998 epochs inside the cosine) stopped by
    its own train.max_steps=20000, a debugging stop whose finished runs said "raise train.max_steps (or drop it)" and
    whose cosine never reached its end. The lr of every update, from the run's own scheduler: it rises over the first
    500 updates to the peak and falls from there to sched.min_lr at update 20,000, where the run ends unstopped."""
    from engine.optim import build_scheduler, schedule_length

    updates_per_epoch = 1_281_167 // 512  # ImageNet-1K's training images, full batches
    runs = resolved("finetune.yaml", "model.pretrained=/weights/vit_b_in21k.safetensors")
    for name in ("imagenet_baseline", "imagenet_cd", "imagenet_tweo"):
        cfg = runs[name]
        assert (cfg.train.batch_size, cfg.train.batch_size_per_gpu) == (512, 128), name  # 128 per GPU on 4 GPUs
        assert cfg.train.eval_batch_size_per_gpu == 1024, name
        assert cfg.train.max_steps is None, name  # the schedule's end is the run's end
        assert schedule_length(cfg.sched, updates_per_epoch)[1] == 20_000, name
    sched = runs["imagenet_baseline"].sched
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=5e-4)
    scheduler = build_scheduler(optimizer, sched, updates_per_epoch)
    lrs = []
    for t in range(20_001):
        scheduler.step_update(t)
        lrs.append(optimizer.param_groups[0]["lr"])
    peak = lrs.index(max(lrs))
    assert peak == 500 and max(lrs) == pytest.approx(5e-4)  # 500 warmup updates, then the peak
    assert all(a < b for a, b in zip(lrs[:peak], lrs[1:peak + 1]))  # rising through the warmup
    assert all(a > b for a, b in zip(lrs[peak:-1], lrs[peak + 1:]))  # decaying over every update after it
    assert lrs[-1] == pytest.approx(sched.min_lr, abs=1e-12)  # at its end at update 20,000


def test_table8_gpt2_recipes():
    runs = resolved("gpt2_table8.yaml", "data.root=/datasets/openwebtext")
    for size, model, lr, lam in (("small", "gpt2", 6e-4, 0.005), ("medium", "gpt2_medium", 3e-4, 0.01)):
        base, cd = runs[f"gpt2_{size}_baseline"], runs[f"gpt2_{size}_cd"]
        for cfg in (base, cd):
            assert cfg.model.name == model and cfg.optim.name == "adamw" and cfg.optim.lr == lr, size
            assert (cfg.sched.steps, cfg.sched.warmup_steps) == (300_000, 1000), size
            tokens = cfg.train.batch_size * 1024  # context length 1024
            assert 0.45e6 <= tokens <= 0.55e6, size  # "approximately 0.5M tokens"
        assert base.optim.weight_decay == 0.1 and not base.cd.enabled, size
        # GPT-2 Small: lam 0.005, wd 0.095; Medium: lam 0.01, wd 0.09
        assert cd.cd.enabled and cd.cd.lam == pytest.approx(lam), size
        assert budgeted_wd(cd) == pytest.approx(0.1 - lam), size


def test_gpt2_model_sizes():
    from models.gpt import GPT_SIZES  # noqa: PLC0415
    assert GPT_SIZES["gpt2"] == dict(depth=12, num_heads=12, embed_dim=768, context=1024)
    assert GPT_SIZES["gpt2_medium"] == dict(depth=24, num_heads=16, embed_dim=1024, context=1024)


def test_detection_fragments():
    """Sec. 4.4: CD with the pre-training strength and budget; TWEO rescaled, lam in the 1e-4 range."""
    frag = os.path.join(ROOT, "configs", "detection", "method")
    cd = runpy.run_path(os.path.join(frag, "cd.py"))
    (hook,) = cd["custom_hooks"]
    assert hook["type"] == "ColinearityDecayHook" and hook["lam"] == 0.005 and cd["cd_budget"] is True
    tweo = runpy.run_path(os.path.join(frag, "tweo.py"))
    (hook,) = tweo["custom_hooks"]
    assert hook["type"] == "TweoHook" and hook["rescale"] is True and 1e-4 <= hook["lam"] < 1e-3
