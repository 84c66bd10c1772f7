"""APHQ and GPLQ end to end on tiny ViT / Swin models trained on digits, with a few iterations.

Asserts only what must hold: the float model is untouched, the result is a fully calibrated W4A4
model with finite outputs, AdaRound weights lie on the grid, GPLQ's stage-1 checkpoint resumes to the
same model, MLP reconstruction runs, the options work as evaluate.py overrides. Accuracies are printed
(pytest -s): with a few iterations they say nothing about the methods (see quant/README.md for the
measured comparison with the full settings).
"""
import dataclasses
import json

import pytest
import torch

import evaluate as evaluate_entry
from configs import ConfigError, config_to_dict, load_config
from quant import PIPELINES, quantize_model
from quant.aphq.adaround import AdaRoundQuantizer
from quant.layers import QuantConv2d, QuantLinear
from quant.modes import named_quantizers
from quant.spec import parse_bits
from quant.gplq.qwt import is_compensated
from quant.units import find_units
from quant_models import top1, train_on_digits

APHQ_FAST = dict(iters=4, recon_images=64, calib_images=32, batch_size=16, matmul_steps=9, search_rounds=1,
                 log_every=2)
GPLQ_FAST = dict(steps=3, batch_size_per_gpu=16, init_images=32, pca_images=64, stage2_images=48, log_every=1,
                 ckpt_every=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def _trained(name, tmp_path_factory):
    # 100 updates, not the helper's 300: no assertion here reads an accuracy (they are printed only)
    model, cfg, xv, yv = train_on_digits(name, steps=100)
    work = tmp_path_factory.mktemp(name)
    # the entry point's data seam
    data = evaluate_entry.build_pipeline_data(cfg, 32, 0, 1, str(work / "eval"))
    calib = data.train_images(32, 0, False)
    return model, cfg, data, calib, xv, yv


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    return _trained("vit_nano", tmp_path_factory)


@pytest.fixture(scope="module")
def swin(tmp_path_factory):
    return _trained("swin_nano", tmp_path_factory)


@pytest.fixture(params=["vit", "swin"])
def trained(request):
    return request.getfixturevalue(request.param)


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model, before):
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def assert_fully_quantized(qmodel):
    qs = list(named_quantizers(qmodel))
    assert qs and all(q.enabled and q.calibrated for _, q in qs)
    assert not any(q.training or q.drop_prob != 1.0 for _, q in qs)  # QDrop off
    assert not any(p.requires_grad for p in qmodel.parameters())


@pytest.mark.slow
def test_aphq_end_to_end(trained):
    model, _, data, calib, xv, yv = trained
    before = snapshot(model)
    qmodel, report = PIPELINES["aphq"](model, calib, "w4a4", APHQ_FAST, data=data)
    assert_untouched(model, before)
    assert_fully_quantized(qmodel)
    assert [u["unit"] for u in report["units"]] == [u.name for u in find_units(model)]
    assert all(u["iters"] == 4 and u["seconds"] >= 0 for u in report["units"])
    assert report["data"] == {"calibration_images": 32, "reconstruction_images": 64, "seed": 3407,
                              "transform": "train"}
    assert report["calibration"]["folded"]  # RepQ-style LayerNorm fold happened
    for m in qmodel.modules():
        if isinstance(m, (QuantLinear, QuantConv2d)):
            q = m.weight_quantizer
            assert isinstance(q, AdaRoundQuantizer) and q.alpha is None  # hard rounding baked
            shape = (-1,) + (1,) * (m.weight.ndim - 1)
            codes = m.weight / q.scale.view(shape) + q.zero_point.view(shape)
            assert torch.allclose(codes, codes.round(), atol=1e-3)
    assert qmodel.patch_embed.proj.input_quantizer is None  # image input float, as in APHQ
    attn = qmodel.get_submodule(find_units(qmodel, ("block",))[0].name).attn
    assert attn.q_quant.channel_dim == 1 and attn.attn_quant.channel_dim == 1  # per-head operands
    with torch.no_grad():
        assert torch.isfinite(qmodel(xv[:8])).all()
    print(f"APHQ W4A4 ({APHQ_FAST['iters']} iters) {top1(qmodel, xv, yv):.1f} "
          f"(float {top1(model, xv, yv):.1f})")


def test_aphq_folds_layernorms_only_at_equal_weight_and_activation_bits(vit):
    model, _, data, calib, _, _ = vit
    qmodel, report = PIPELINES["aphq"](model, calib, "w4a8", {**APHQ_FAST, "iters": 1}, data=data)
    assert report["calibration"]["folded"] == []  # official: reparameterisation only when a_bit == w_bit
    assert_fully_quantized(qmodel)
    qkv = qmodel.get_submodule(find_units(qmodel, ("block",))[0].name).attn.qkv
    assert qkv.input_quantizer.bits == 8 and qkv.input_quantizer.channel_dim is None
    norms = [n for n, _ in model.named_parameters() if n.endswith(("norm1.weight", "norm1.bias"))]
    # not rescaled
    assert norms and all(torch.equal(model.get_parameter(n), qmodel.get_parameter(n)) for n in norms)


def test_aphq_mlp_reconstruction_runs(vit):
    model, _, data, calib, _, _ = vit
    before = snapshot(model)
    qmodel, report = PIPELINES["aphq"](model, calib, "w4a4",
                                       {**APHQ_FAST, "mlp_reconstruct": True, "mlp_iters": 3}, data=data)
    assert_untouched(model, before)
    blocks = [u.name for u in find_units(model, ("block",))]
    assert [r["unit"] for r in report["mlp_reconstruction"]] == blocks
    assert all(isinstance(qmodel.get_submodule(b).mlp.act, torch.nn.ReLU) for b in blocks)
    assert not isinstance(model.get_submodule(blocks[0]).mlp.act, torch.nn.ReLU)


def test_gplq_end_to_end_and_resume(trained):
    model, _, data, calib, xv, yv = trained
    before = snapshot(model)
    qmodel, report = PIPELINES["gplq"](model, calib, "w4a4", GPLQ_FAST, data=data)
    assert_untouched(model, before)
    assert_fully_quantized(qmodel)
    assert report["stage1"]["steps"] == 3 and report["stage1"]["resumed_from"] is None
    assert report["stage1"]["pca_dims"] % 32 == 0 and report["stage1"]["pca_explained"] >= 0.6
    blocks = find_units(model, ("block",))
    assert len(report["qwt"]["blocks"]) == len(blocks)
    kept = [s["unit"] for s in report["qwt"]["blocks"] if s["kept"]]
    assert all(is_compensated(qmodel.get_submodule(b.name)) == (b.name in kept) for b in blocks)
    # the compensation adds a child and a hook: every FQN of the plain conversion is still there
    plain = quantize_model(model, PIPELINES["gplq"].layout(parse_bits("w4a4"), PIPELINES["gplq"].Options()))
    names = {n for n, _ in qmodel.named_modules()}
    assert {n for n, _ in plain.named_modules()} == {n for n in names if "qwt_compensation" not in n}
    q = qmodel.get_submodule(blocks[0].name).mlp.fc1.input_quantizer
    assert q.symmetric and q.channel_dim == -1  # symmetric per-channel activations
    with torch.no_grad():
        logits = qmodel(xv[:8])
    assert torch.isfinite(logits).all()
    print(f"GPLQ W4A4 ({GPLQ_FAST['steps']} steps) {top1(qmodel, xv, yv):.1f} "
          f"(float {top1(model, xv, yv):.1f})")

    # resumes the finished stage 1
    again, report2 = PIPELINES["gplq"](model, calib, "w4a4", GPLQ_FAST, data=data)
    assert report2["stage1"]["resumed_from"] == 3
    with torch.no_grad():
        assert torch.allclose(again(xv[:8]), logits, atol=1e-5)
    from engine.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="different GPLQ stage-1 run") as refused:
        PIPELINES["gplq"](model, calib, "w4a4", {**GPLQ_FAST, "steps": 4}, data=data)
    said = str(refused.value)  # what differs, then and now, and nothing else of the long identity
    assert "stage1.steps: 3 then, 4 now" in said and "lr:" not in said, said


def test_pipelines_need_the_training_data(vit):
    model, _, _, calib, _, _ = vit
    for name in ("aphq", "gplq"):
        with pytest.raises(ValueError, match="PipelineData"):
            PIPELINES[name](model, calib, "w4a4", {})


def test_require_data_refuses_exactly_what_a_pipeline_lacks():
    """quant.pipeline_data.require_data: images (or a detector's samples) for every pipeline that draws its own,
    a train loader only where asked; the work path is the prefix followed by the suffix, or none."""
    from quant.pipeline_data import PipelineData, require_data

    def images(count, seed, train_transform):
        return torch.zeros(count, 3, 8, 8)

    def samples(count, seed):
        return []

    def loader(batch_size_per_gpu, seed):
        return []

    for data, needs_loader in ((PipelineData(train_images=images), False),
                               (PipelineData(detector_samples=samples), False),  # a detector: no image tensor
                               (PipelineData(train_images=images, train_loader=loader), True)):
        assert require_data("x", data, loader=needs_loader) is data
    only_images = PipelineData(train_images=images)
    assert require_data("x", only_images) is only_images  # no loader asked for by default (APHQ)
    for data, needs_loader, message in ((None, False, r"pass data=PipelineData\(\.\.\.\)"),
                                        (PipelineData(train_loader=loader), True, "PipelineData.train_images"),
                                        (PipelineData(train_images=images), True, "PipelineData.train_loader"),
                                        (PipelineData(detector_samples=samples), True, "PipelineData.train_loader")):
        with pytest.raises(ValueError, match=rf"^the 'x' pipeline .*{message}"):
            require_data("x", data, loader=needs_loader)
    assert PipelineData(work_prefix="runs/a/eval_best").work_path("_gplq_w4a4_stage1.pt") == \
        "runs/a/eval_best_gplq_w4a4_stage1.pt"
    assert PipelineData().work_path("_gplq_w4a4_stage1.pt") is None


def test_options_are_typed_config_sections():
    cfg = load_config([], ["quant.aphq.iters=5", "quant.aphq.weight_pct=[0.8, 1.0]", "quant.gplq.steps=7",
                           "quant.gplq.lr=2e-5", "quant.aphq.hessian_probe=rademacher"])
    assert cfg.quant.aphq.iters == 5 and cfg.quant.aphq.weight_pct == (0.8, 1.0)
    assert cfg.quant.gplq.steps == 7 and cfg.quant.gplq.lr == 2e-5
    for bad in ("quant.gplq.qwt_target=fp16", "quant.aphq.iters=many", "quant.aphq.iter=5"):
        with pytest.raises(ConfigError):
            load_config([], [bad])


@pytest.mark.slow  # APHQ and GPLQ end to end (about 20 s)
def test_evaluate_cli_runs_both_pipelines_with_overrides(vit, tmp_path):
    model, cfg, _, _, _, _ = vit
    ckpt = tmp_path / "best.pt"
    torch.save({"model": model.state_dict(), "config": config_to_dict(cfg)}, ckpt)
    overrides = [f"quant.aphq.{k}={v}" for k, v in APHQ_FAST.items()] + [
        f"quant.gplq.{k}={v}" for k, v in GPLQ_FAST.items()] + ["quant.act_max_csv=false"]
    result = evaluate_entry.main(evaluate_entry.parse_args(
        ["--checkpoint", str(ckpt), *overrides, "--quant", "aphq", "gplq", "--bits", "w4a4"]))
    assert set(result["quant"]) == {"aphq", "gplq"}
    assert result["quant"]["aphq"]["w4a4"]["report"]["options"]["iters"] == APHQ_FAST["iters"]
    assert result["quant"]["gplq"]["w4a4"]["report"]["stage1"]["steps"] == GPLQ_FAST["steps"]
    assert (tmp_path / "eval_best_gplq_w4a4_stage1.pt").exists()  # resumable stage 1 next to the JSON
    with open(tmp_path / "eval_best.json") as f:
        assert set(json.load(f)["quant"]) == {"aphq", "gplq"}


def test_evaluate_refuses_another_runs_stage1_checkpoint_before_the_fp_pass(vit, tmp_path, monkeypatch):
    """A GPLQ stage-1 checkpoint at the result file's path that another run wrote (here: other stage-1 steps)
    is refused before the FP pass, not after it, the maxima and the pipelines planned before GPLQ; the file is
    kept. The same checkpoint with the settings that wrote it is resumed."""
    from engine.checkpoint import CheckpointError
    from engine.tasks import ClassificationTask

    model, cfg, _, _, _, _ = vit
    ckpt = tmp_path / "best.pt"
    torch.save({"model": model.state_dict(), "config": config_to_dict(cfg)}, ckpt)
    fast = [f"quant.gplq.{k}={v}" for k, v in GPLQ_FAST.items()] + ["quant.act_max_csv=false"]
    first = evaluate_entry.main(evaluate_entry.parse_args(
        ["--checkpoint", str(ckpt), *fast, "--quant", "gplq", "--bits", "w4a4", "--out", str(tmp_path / "a.json")]))
    assert first["quant"]["gplq"]["w4a4"]["report"]["stage1"]["resumed_from"] is None
    stage1 = tmp_path / "a_gplq_w4a4_stage1.pt"
    written = stage1.read_bytes()

    passes = []
    evaluate_pass = ClassificationTask.evaluate
    monkeypatch.setattr(ClassificationTask, "evaluate",
                        lambda self, *a, **k: passes.append(k.get("progress")) or evaluate_pass(self, *a, **k))
    # percentile is planned first: the refusal comes before it and before the FP pass
    with pytest.raises(CheckpointError, match=r"a_gplq_w4a4_stage1\.pt was written by a different GPLQ stage-1 run"):
        evaluate_entry.main(evaluate_entry.parse_args(
            ["--checkpoint", str(ckpt), *[o for o in fast if not o.startswith("quant.gplq.steps=")],
             "quant.gplq.steps=4", "--quant", "percentile", "gplq", "--bits",
             "w4a4", "--out", str(tmp_path / "a.json"), "--recompute"]))
    assert passes == [] and stage1.read_bytes() == written

    resumed = evaluate_entry.main(evaluate_entry.parse_args(
        ["--checkpoint", str(ckpt), *fast, "--quant", "gplq", "--bits", "w4a4", "--out", str(tmp_path / "a.json"),
         "--recompute"]))
    assert resumed["quant"]["gplq"]["w4a4"]["report"]["stage1"]["resumed_from"] == GPLQ_FAST["steps"]


@pytest.mark.parametrize("pipeline, variant", [
    ("aphq", {"hessian_probe": "rademacher", "search_max_rows": 64, "cache_device": "cpu"}),
    ("aphq", {"loss": "mse", "normalize_loss": False, "round_zero_point": False, "stem_a_bits": 8}),
    ("gplq", {"act_granularity": "tensor", "matmul_operands": False, "qwt_target": "teacher",
              "qwt_ridge": 1.0, "stage2_train_transform": True, "weight_symmetric": False,
              "weight_range": "minmax"}),
    ("gplq", {"qwt_target": "float", "amp": "bf16", "scale_lr": 1e-3, "weight_decay": 0.05}),
    ("gplq", {"qwt": False, "steps": 2}),
])
def test_option_variants_run(vit, pipeline, variant):
    model, _, data, calib, xv, _ = vit
    fast = APHQ_FAST if pipeline == "aphq" else GPLQ_FAST
    data = dataclasses.replace(data, work_prefix=None)  # no stage-1 checkpoint shared between variants
    options = {**fast, **variant}
    if options.get("qwt") is False:  # stage 2 draws images only for QwT: its image count would be refused unread
        del options["stage2_images"]
    qmodel, report = PIPELINES[pipeline](model, calib, "w4a4", options, data=data)
    assert_fully_quantized(qmodel)
    assert all(report["options"][k] == v for k, v in variant.items())
    with torch.no_grad():
        assert torch.isfinite(qmodel(xv[:4])).all()


def test_gplq_stage1_crosses_an_epoch_end(vit):
    # 1,437 digits train images at 512 a batch: 2 updates an epoch, so update 3 is in the second epoch
    # (the epoch-end bookkeeping once reached stage 1's progress line and raised there)
    model, _, data, calib, xv, _ = vit
    data = dataclasses.replace(data, work_prefix=None)
    options = {**GPLQ_FAST, "qwt": False, "steps": 3, "batch_size_per_gpu": 512, "log_every": 1}
    del options["stage2_images"]  # read only with QwT on
    qmodel, report = PIPELINES["gplq"](model, calib, "w4a4", options, data=data)
    assert report["stage1"]["steps"] == 3
    assert_fully_quantized(qmodel)
