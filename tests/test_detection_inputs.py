"""Detection inputs that would not run as asked (scripts/train_detection.py, evaluate_detection.py): each is one
`error:` line before any work, and the inputs that do fit still pass.

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from configs.quant import GPLQ_DETECTION, GPLQOptions
from detection_runs import SAMPLE_CONFIG, error_line
from engine.eval_results import as_stored

# the options GPLQ runs with on a detector at --calib-images 1 (its default): the detection recipe over the defaults
GPLQ_RECIPE = {**dataclasses.asdict(GPLQOptions()), **GPLQ_DETECTION, "init_images": 1}
QWT_OPTIONS = ("stage2_images", "stage2_train_transform", "qwt_ridge", "qwt_target")  # read by QwT's fits alone

pytestmark = pytest.mark.detection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _official_swin_checkpoint(path, parameters_only=False, **backbone):
    """A checkpoint in the official Swin repository's format (what MMDetection's `convert_weights` reads) for the
    sample config's backbone with `backbone` changed: its keys renamed back, the ImageNet head and final norm and
    the shifted blocks' attention masks added, the detection output norms left out. `parameters_only`: a
    weights-only export, without the buffers (relative_position_index, attention masks) the model rebuilds."""
    from engine.detection import load_config
    from mmdet.registry import MODELS
    cfg = load_config([SAMPLE_CONFIG])
    model = MODELS.build({**cfg.model.backbone, **backbone})
    state = {}
    for key, value in (model.named_parameters() if parameters_only else model.state_dict().items()):
        if key.startswith("norm"):  # norm0..norm3: the detection outputs, not in an ImageNet checkpoint
            continue
        key = (key.replace("stages", "layers", 1).replace("attn.w_msa.", "attn.").replace("ffn.layers.0.0.", "mlp.fc1.")
               .replace("ffn.layers.1.", "mlp.fc2.").replace("patch_embed.projection", "patch_embed.proj"))
        state[key] = value.detach()
        if key.endswith("blocks.1.norm1.weight") and not parameters_only:
            state[key.replace("norm1.weight", "attn_mask")] = torch.zeros(4, 49, 49)
    dims = model.num_features[-1]
    state.update({"norm.weight": torch.ones(dims), "norm.bias": torch.zeros(dims),
                  "head.weight": torch.zeros(1000, dims), "head.bias": torch.zeros(1000)})
    torch.save({"model": state}, path)
    return str(path)


def _pretrained(cfg, checkpoint):
    cfg.model.backbone.init_cfg = dict(type="Pretrained", checkpoint=str(checkpoint))
    return cfg


def test_a_backbone_checkpoint_of_another_model_is_refused(mmdet_ready, tmp_path):
    """MMDetection's Swin loads its init checkpoint with strict=False and says nothing: the official Swin format
    for this backbone passes (and loads), while another model's weights (none of the backbone's keys: MMDetection
    would train from random; a deeper Swin's, whose extra blocks its loading code trips on) and a file that is no
    checkpoint are refused, naming the weights."""
    from engine.detection import DetectionError, check_backbone_init, load_config
    from mmdet.registry import MODELS
    fits = _official_swin_checkpoint(tmp_path / "swin.pth")
    cfg = _pretrained(load_config([SAMPLE_CONFIG]), fits)
    check_backbone_init(cfg)
    backbone = MODELS.build(cfg.model.backbone)
    backbone.init_weights()  # the accepted file really loads: a block's weights are the file's
    assert torch.equal(backbone.stages[0].blocks[0].attn.w_msa.qkv.weight,
                       torch.load(fits)["model"]["layers.0.blocks.0.attn.qkv.weight"])

    resnet = tmp_path / "resnet.pth"
    torch.save({"state_dict": {"conv1.weight": torch.zeros(8, 3, 7, 7), "fc.weight": torch.zeros(10, 8)}}, resnet)
    with pytest.raises(DetectionError, match=r"does not fit model.backbone \(SwinTransformer\): \d+ missing"):
        check_backbone_init(_pretrained(load_config([SAMPLE_CONFIG]), resnet))
    deeper = _official_swin_checkpoint(tmp_path / "deeper.pth", depths=[1, 1, 3, 1])
    with pytest.raises(DetectionError, match=r"cannot be loaded into model.backbone \(KeyError: 'stages.2.blocks.1"):
        check_backbone_init(_pretrained(load_config([SAMPLE_CONFIG]), deeper))
    notes = tmp_path / "notes.pth"
    notes.write_text("not a checkpoint")
    with pytest.raises(DetectionError, match="cannot be loaded into model.backbone"):
        check_backbone_init(_pretrained(load_config([SAMPLE_CONFIG]), notes))


def test_a_backbone_checkpoint_of_every_weight_but_no_buffers_loads(mmdet_ready, tmp_path):
    """A weights-only export (every parameter, none of the buffers: relative_position_index, attention masks, which
    the model builds itself) fits the backbone: it passes, and MMDetection's Swin then holds the file's weights (a
    first and a later one compared: the backbone is built with other random weights)."""
    from engine.detection import check_backbone_init, load_config
    from mmdet.registry import MODELS
    path = _official_swin_checkpoint(tmp_path / "weights.pth", parameters_only=True)
    assert not any(k.endswith(("relative_position_index", "attn_mask")) for k in torch.load(path)["model"])
    cfg = _pretrained(load_config([SAMPLE_CONFIG]), path)
    check_backbone_init(cfg)
    backbone = MODELS.build(cfg.model.backbone)
    backbone.init_weights()
    file = torch.load(path)["model"]
    assert torch.equal(backbone.stages[1].blocks[0].attn.w_msa.relative_position_bias_table,
                       file["layers.1.blocks.0.attn.relative_position_bias_table"])
    assert torch.equal(backbone.patch_embed.projection.weight, file["patch_embed.proj.weight"])


def test_a_backbone_checkpoint_of_other_shapes_or_without_a_block_norm_is_refused(mmdet_ready, tmp_path):
    """Two checkpoints that MMDetection's Swin loads with strict=False without a word: the same layout at another
    width (every weight of another shape: none would load) and one without a block's norm1 (it would train from
    random); only the detection output norms (norm0..norm3) may be missing."""
    from engine.detection import DetectionError, check_backbone_init, load_config
    wider = _official_swin_checkpoint(tmp_path / "wider.pth", embed_dims=48)
    with pytest.raises(DetectionError, match=r"does not fit model.backbone \(SwinTransformer\): \d+ of another shape"):
        check_backbone_init(_pretrained(load_config([SAMPLE_CONFIG]), wider))
    path = _official_swin_checkpoint(tmp_path / "swin.pth")
    state = torch.load(path)
    del state["model"]["layers.0.blocks.0.norm1.weight"]
    torch.save(state, path)
    with pytest.raises(DetectionError, match=r"1 missing \(e.g. stages.0.blocks.0.norm1.weight\)"):
        check_backbone_init(_pretrained(load_config([SAMPLE_CONFIG]), path))


def test_mismatch_names_missing_unexpected_and_reshaped_keys():
    """engine.detection.model.mismatch against its definition, on a hand-made state dict."""
    from engine.detection.model import mismatch
    own = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1), "norm0.w": torch.zeros(1)}
    given = {"a": torch.zeros(3, 2), "b": torch.zeros(4), "x": torch.zeros(1), "mask": torch.zeros(1)}
    assert mismatch(own, given) == ("2 missing (e.g. c, norm0.w); 2 unexpected (e.g. mask, x); "
                                    "1 of another shape (e.g. a)")
    import re
    assert mismatch(own, given, needed=["a", "b"], may_lack=re.compile("^norm"), may_add=re.compile("mask$")) == \
        "1 unexpected (e.g. x); 1 of another shape (e.g. a)"
    assert mismatch(own, dict(own)) == ""


def test_training_from_a_backbone_checkpoint_of_another_model_is_one_error_line(sample, tmp_path, capsys):
    resnet = tmp_path / "resnet.pth"
    torch.save({"state_dict": {"conv1.weight": torch.zeros(8, 3, 7, 7)}}, resnet)
    config = tmp_path / "pretrained.py"
    config.write_text(f"_base_ = {os.path.join(ROOT, SAMPLE_CONFIG)!r}\nmodel = dict(backbone=dict(init_cfg=dict("
                      f"_delete_=True, type='Pretrained', checkpoint={str(resnet)!r})))\n")
    line = error_line(capsys, ["--config", str(config), "--data-root", sample, "--work-dir", str(tmp_path / "w")])
    assert f"model.backbone.init_cfg.checkpoint={resnet} does not fit model.backbone" in line, line
    assert not (tmp_path / "w").exists()


def test_a_second_command_in_a_work_dir_a_run_holds_is_refused_before_it_writes_there(sample, tmp_path, capsys):
    """The racing order of two commands started at the same moment, made deterministic: one has just claimed the
    work dir (its lock, nothing else yet). The other trained into the same folder (or, refused late, removed the
    first one's config dump); now it is one error line, and the folder is as the holder left it."""
    from engine.run_dir import lock_folder
    work = tmp_path / "held"
    work.mkdir()
    with lock_folder(str(work), "--work-dir"):
        before = {p.name: p.read_bytes() for p in work.iterdir()}
        line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(work),
                                   "train_cfg.max_epochs=1", "train_cfg.val_interval=100"])
        assert {p.name: p.read_bytes() for p in work.iterdir()} == before
    assert re.search(rf"--work-dir '{re.escape(str(work))}' is in use by another run \(pid \d+", line), line


@pytest.mark.parametrize("split", ["val2017", "train2017"])
def test_a_data_root_without_an_image_folder_is_refused_before_training(sample, tmp_path, capsys, split):
    """The images are read only when a batch is drawn: without val2017/ a run trained a whole epoch and failed
    with a traceback in its first validation. Refused before the work dir is made."""
    import shutil
    root = tmp_path / "coco"
    shutil.copytree(sample, root)
    shutil.rmtree(root / split)
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(root), "--work-dir", str(tmp_path / "w")])
    assert f"reads its images from {root / split}, which is no folder" in line, line
    assert not (tmp_path / "w").exists()


def test_evaluation_without_the_val_images_is_refused_before_the_weights_are_read(sample, tmp_path):
    import shutil
    from engine.detection import DetectionError
    from evaluate_detection import main
    root = tmp_path / "coco"
    shutil.copytree(sample, root)
    shutil.rmtree(root / "val2017")
    with pytest.raises(DetectionError, match="_dataloader reads its images from .*val2017, which is no folder"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", str(root),
              "--quant", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_a_full_precision_evaluation_needs_no_training_images(sample, tmp_path):
    """Only a pipeline calibrates or trains on train2017/: a bare --quant (full precision) reads the test images
    alone, so a data root without the training images gets as far as the checkpoint; a pipeline is refused."""
    import shutil
    from engine.detection import DetectionError
    from evaluate_detection import main
    root = tmp_path / "coco"
    shutil.copytree(sample, root)
    shutil.rmtree(root / "train2017")
    common = ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", str(root),
              "--out", str(tmp_path / "x.json")]
    with pytest.raises(DetectionError, match="train_dataloader reads its images from .*train2017, which is no folder"):
        main(common + ["--quant", "percentile"])
    with pytest.raises(Exception) as failed:  # past the image check: the checkpoint does not exist
        main(common + ["--quant"])
    assert "w.pth" in str(failed.value) and "train2017" not in str(failed.value), failed.value


@pytest.mark.parametrize("override, uses", [
    ("max_epochs=1", "train_cfg.max_epochs"),  # the sample trained its 2 epochs
    ("train_pipeline.2.scale=(32,32)", "train_dataloader.dataset.pipeline"),  # it kept its 64-pixel resize
    ("classes=('a','b')", "train_dataloader.dataset.metainfo.classes")])
def test_an_override_of_a_config_variable_is_refused(mmdet_ready, override, uses):
    """A top-level variable of the config files is copied into the keys that use it while they are parsed, so an
    override of it changed nothing (MMEngine's --cfg-options says nothing either); refused, naming a key to
    override instead. The keys MMEngine's Runner reads pass."""
    from engine.detection import DetectionError, load_config, parse_overrides
    with pytest.raises(DetectionError, match=rf"is read only while the config files are parsed .*e.g. {uses}"):
        load_config([SAMPLE_CONFIG], parse_overrides([override]))
    cfg = load_config([SAMPLE_CONFIG], parse_overrides(["train_cfg.max_epochs=1", "find_unused_parameters=True",
                                                        "randomness.seed=1", "auto_scale_lr.enable=True"]))
    assert cfg.train_cfg.max_epochs == 1 and cfg.find_unused_parameters is True


@pytest.mark.parametrize("override, uses", [
    ("train_pipeline.2.scale=(32,32)", "train_dataloader.dataset.pipeline"),  # the mmdet:: bases' _scope_ tags
    ("pretrained=/w/swin_tiny.pth", "model.backbone.init_cfg.checkpoint")])
def test_a_variable_of_the_shipped_configs_names_the_key_to_override(mmdet_ready, override, uses):
    from engine.detection import DetectionError, load_config, parse_overrides
    with pytest.raises(DetectionError, match=rf"is read only while the config files are parsed .*e.g. {uses}"):
        load_config([os.path.join(ROOT, "configs", "detection", "mask_rcnn_swin_t_1x.py")], parse_overrides([override]))


def test_training_refuses_a_variable_override_before_any_work(sample, tmp_path, capsys):
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(tmp_path / "w"),
                                "max_epochs=1"])
    assert "override max_epochs" in line and "train_cfg.max_epochs" in line, line
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("old", ["data/coco", "data/coco/"])
def test_data_root_moves_an_evaluator_file_under_the_configs_root_whatever_its_trailing_slash(mmdet_ready, tmp_path,
                                                                                               old):
    """--data-root keeps an evaluator file's path below the config's data_root: written without its trailing
    slash, the rest began with one and os.path.join dropped the new root (/annotations/...); a sibling folder
    (data/coco2) is no part of data/coco."""
    from mmengine.config import Config
    from engine.detection.data_checks import set_data_root
    cfg = Config(dict(data_root=old, val_evaluator=dict(ann_file="data/coco/annotations/sub/val.json"),
                      test_evaluator=dict(ann_file="data/coco2/annotations/test.json")))
    set_data_root(cfg, str(tmp_path))
    assert cfg.val_evaluator.ann_file == os.path.join(str(tmp_path), "annotations", "sub", "val.json")
    assert cfg.test_evaluator.ann_file == os.path.join(str(tmp_path), "annotations", "test.json")


def test_a_loader_data_root_override_with_data_root_is_refused(sample, tmp_path):
    """--data-root sets every loader's data_root: a loader's own one given beside it was replaced without a word
    (the val loader read --data-root's images). Refused; absolute paths of the loader's files are kept."""
    from engine.detection import DetectionError, load_config, parse_overrides
    with pytest.raises(DetectionError, match="override val_dataloader.dataset.data_root: --data-root sets"):
        load_config([SAMPLE_CONFIG], parse_overrides([f"val_dataloader.dataset.data_root={tmp_path}"]), sample)
    ann = os.path.join(sample, "annotations", "instances_val2017.json")
    cfg = load_config([SAMPLE_CONFIG], parse_overrides([f"val_dataloader.dataset.ann_file={ann}",
                                                        f"val_evaluator.ann_file={ann}"]), sample)
    assert cfg.val_dataloader.dataset.ann_file == ann and cfg.val_evaluator.ann_file == ann


@pytest.mark.parametrize("override, message", [
    ("load_from=/elsewhere/epoch_12.pth", "give --checkpoint instead"),
    ("val_dataloader.dataset.ann_file=annotations/instances_train2017.json", "give test_dataloader instead"),
    ("train_cfg.max_epochs=3", "does not read train_cfg"),
    # a bare --quant scores full precision: the training split is not read at all
    ("train_dataloader.batch_size=4", "without a quantization pipeline .* does not read train_dataloader, so it "
                                      "would change nothing; drop it"),
    ("test_dataloder.batch_size=1", "did you mean test_dataloader"),  # a typo keeps its close matches
    # keys of the training script's flags, which the evaluation does not have: it named --work-dir and the others
    ("work_dir=/tmp/x", "does not read work_dir, so it would change nothing; drop it"),
    ("launcher=pytorch", "does not read launcher, so it would change nothing; drop it"),
    ("resume=True", "does not read resume, so it would change nothing; drop it"),
    ("data_root=/tmp/x", "data_root is set from the command's --data-root flag .*give --data-root instead")])
def test_evaluation_refuses_overrides_it_does_not_read(sample, tmp_path, override, message):
    """evaluate_detection.py scores --checkpoint on test_dataloader: an override of another key (the weights to
    load, the val loader, a training setting, the batch size GPLQ's stage 1 sets itself) was accepted and changed
    nothing. Refused before any work."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    with pytest.raises(DetectionError, match=f"override {override.split('=')[0]}: .*{message}"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", sample, "--quant",
              "--out", str(tmp_path / "x.json"), override])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("flags", [["--quant", "repq", "repq"], ["--quant", "percentile", "--bits", "w4a4", "w4a4"]])
def test_evaluation_refuses_a_pipeline_or_bit_width_named_twice(mmdet_ready, tmp_path, flags):
    """Each was quantized and scored twice, the first result moved to the JSON's history (evaluate.py refuses)."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    with pytest.raises(DetectionError, match=r"names (repq|w4a4) twice: give each once"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), *flags,
              "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("hooks, method", [
    ("[]", "Baseline"),
    ("[dict(type='ColinearityDecayHook', lam=0.005)]", "CD"),
    ("(dict(type='mmdet.TweoHook', lam=1e-4),)", "TWEO"),  # a scoped type, in a tuple
    ("[dict(type='ColinearityDecayHook'), dict(type='TweoHook'), dict(type='EMAHook')]", "CD + TWEO"),
    # CD at every strength 0 updates no weight (custom_hooks.0.lam=0): the run is a baseline, not one of CD's
    ("[dict(type='ColinearityDecayHook', lam=0)]", "Baseline"),
    ("[dict(type='ColinearityDecayHook', lam=0.0, lam_per_role=dict(fc2=0))]", "Baseline"),
    ("[dict(type='ColinearityDecayHook', lam=0, module='neck'), dict(type='TweoHook')]", "TWEO"),
    # TWEO at lam 0 adds 0 x its term (a gradient of zeros, test_tweo_at_lam_0_trains_as_the_baseline): a baseline
    # too, in any schedule, not a TWEO point of Fig. 1 (whose colour is the label's method)
    ("[dict(type='TweoHook', lam=0)]", "Baseline"),
    ("[dict(type='TweoHook', lam=0.0, schedule='cosine'), dict(type='WeightNoiseHook')]", "Noise"),
    # fc2 is decayed (labelled with its strengths since the labels name other settings than the fragments')
    ("[dict(type='ColinearityDecayHook', lam=0, lam_per_role=dict(fc2=0.02))]", "CD (lam 0, fc2 0.02)"),
    # a strength sweep: each of its circles and CSV rows named apart, as a classifier's "CD (lam 0.01)"; the
    # settings of configs/detection/method/*.py are the plain names
    ("[dict(type='ColinearityDecayHook', lam=0.01)]", "CD (lam 0.01)"),
    ("[dict(type='TweoHook', lam=3e-4), dict(type='WeightNoiseHook', bits=3)]", "TWEO (lam 0.0003) + Noise (bits 3)"),
    ("[dict(type='WeightNoiseHook', bits=4)]", "Noise"),
])
def test_the_training_method_is_read_from_the_config_a_checkpoint_keeps(mmdet_ready, tmp_path, monkeypatch, hooks,
                                                                       method):
    """evaluate_detection.py labels a result (Fig. 1's circles) with the method of the hooks in the training
    config MMEngine keeps in a checkpoint's meta["cfg"]; the hooks' module need not be importable where the
    evaluation runs, and a config that cannot be read leaves no file behind."""
    from engine.detection import method_of, training_config
    text = (f"custom_imports = dict(imports=['a_module_not_installed_here'], allow_failed_imports=False)\n"
            f"custom_hooks = {hooks}\ncd_budget = 'applied: 0.05 - lam 0.005 = 0.045'\n")  # as the dump records it
    assert method_of(training_config({"cfg": text})) == method
    if method.startswith("CD"):  # without the budget rule (cd_budget=False): another weight decay
        no_budget = method[:-1] + ", no budget)" if "(" in method.split("+")[0] else method.replace(
            "CD", "CD (no budget)", 1)
        if method.startswith("CD (lam 0,"):  # but the rule's 0.05 - 0 is the weight decay as given: the same run
            no_budget = method
        without = text.replace("cd_budget = 'applied", "cd_budget = False  # '")
        assert method_of(training_config({"cfg": without})) == no_budget
        # no cd_budget at all: a config from before the key (the budget in its weight decay) says nothing of it
        assert method_of(training_config({"cfg": text[:text.index("cd_budget")]})) == method
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    assert training_config({"cfg": "not python ("}) is None and training_config({}) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rescale", [True, False])
def test_tweo_at_lam_0_trains_as_the_baseline(rescale):
    """What the label "Baseline" of a TweoHook at lam 0 says (method_of): the loss and every gradient of a step with
    TWEO's term at lam 0 are those of the step without it, bit for bit."""
    from cd.tweo import TWEO
    from quant_models import tiny_vit
    images = torch.randn(2, 3, 32, 32)
    grads = []
    for lam in (None, 0.0):
        model = tiny_vit(depth=2).train()
        tweo = None if lam is None else TWEO(model, lam=lam, rescale=rescale)
        loss = model(images).square().mean()
        if tweo is not None:
            loss = loss + tweo.aux_loss(loss)
            tweo.remove()
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_cd_checkpoint_from_before_cd_budget_existed_keeps_its_plain_label(mmdet_ready):
    """configs/detection/method/cd.py set the budgeted weight decay itself (0.045) before its cd_budget key existed:
    a checkpoint of then keeps no cd_budget, and its result is the same method as a later run's "CD", not one
    "without the budget rule" (its circles and rows would be split from the runs they belong with)."""
    from engine.detection import method_of, training_config
    old_fragment = ("custom_imports = dict(imports=['cd.integrations.mmengine'], allow_failed_imports=False)\n"
                    "custom_hooks = [dict(type='ColinearityDecayHook', lam=0.005)]\n"
                    "optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-4, weight_decay=0.045))\n")
    assert method_of(training_config({"cfg": old_fragment})) == "CD"
    assert method_of(training_config({"cfg": old_fragment.replace("lam=0.005", "lam=0.01")})) == "CD (lam 0.01)"


@pytest.mark.parametrize("hook, label", [
    # the paper's detection TWEO is the rescaled form (configs/detection/method/tweo.py): the plain one is another
    # method, as are another penalty shape or schedule
    ("dict(type='TweoHook', lam=1e-4, rescale=False)", "TWEO (no rescale)"),
    ("dict(type='TweoHook', rescale=False, p=2.0, tau=2.0)", "TWEO (no rescale, p 2, tau 2)"),
    # tau and eps given at the values their null takes (cd.tweo's TAU, EPS): the same term as left out
    ("dict(type='TweoHook', rescale=False, tau=3.0, eps=1e-6)", "TWEO (no rescale)"),
    ("dict(type='TweoHook', schedule='cosine', total_steps=100)", "TWEO (cosine, 100 steps)"),
    ("dict(type='TweoHook', rescale=True, p=4.0, form='plain')", "TWEO"),  # form: the same term, other memory
    # the noise on other layers, or another draw of it
    ("dict(type='WeightNoiseHook', bits=4, layer_types=['Linear', 'Conv2d'], seed=0)", "Noise (layers Conv2d+Linear)"),
    ("dict(type='WeightNoiseHook', layer_types=('Linear',), seed=1)", "Noise (seed 1)"),
    # another part of the detector than its backbone, and CD's other target sets
    ("dict(type='ColinearityDecayHook', module='neck')", "CD (on neck)"),
    ("dict(type='ColinearityDecayHook', module='backbone')", "CD"),
    ("dict(type='TweoHook', module='')", "TWEO (on the whole model)"),
    ("dict(type='ColinearityDecayHook', targets='C')", "CD (targets C)"),
])
def test_runs_that_differ_in_a_hook_setting_other_than_the_strength_get_other_labels(mmdet_ready, hook, label):
    """Two detectors trained with TWEO with and without its rescale, or with the Noise on other layers or of another
    seed, were labelled alike ("TWEO", "Noise"): one method in the result JSON and one colour of Fig. 1. Each
    setting that differs from configs/detection/method/*.py (the hooks' defaults) is named, as the strength is."""
    from engine.detection import method_of, training_config
    assert method_of(training_config({"cfg": f"custom_hooks = [{hook}]\n"})) == label


@pytest.mark.parametrize("hooks, overrides", [
    ("[dict(type='ColinearityDecayHook'), dict(type='TweoHook')]", ["cd.enabled=true", "tweo.enabled=true"]),
    ("[dict(type='TweoHook'), dict(type='ColinearityDecayHook', lam=0.01)]",
     ["cd.enabled=true", "cd.lam=0.01", "tweo.enabled=true"]),
])
def test_a_detector_and_a_classifier_of_cd_and_tweo_are_one_method_of_the_figure(mmdet_ready, hooks, overrides):
    """A detector trained with CD and TWEO was "CD+TWEO", a classifier "CD + TWEO" (engine.result_table.method_name):
    motivation_figure.py drew the two panels' circles of one method in two colours, as two legend entries."""
    from configs import load_config
    from engine.detection import method_of, training_config
    from engine.result_table import method_name
    from tests.conftest import DEMO_CONFIG, load_script
    detector = method_of(training_config({"cfg": f"custom_hooks = {hooks}\n"}))
    classifier = method_name(load_config([DEMO_CONFIG], overrides))
    colours = load_script("motivation_figure").method_colours([classifier, detector])
    assert len(colours) == 1, colours

def _categories_copy(sample, tmp_path, names):
    """A copy of the sample whose annotation files name their categories (ids 1, 2: box, disc in the sample)
    `names`, the objects unchanged."""
    import json
    import shutil
    root = tmp_path / "_".join(names)
    shutil.copytree(sample, root)
    for split in ("train2017", "val2017"):
        path = root / "annotations" / f"instances_{split}.json"
        data = json.loads(path.read_text())
        assert [c["name"] for c in data["categories"]] == ["box", "disc"]
        for category, name in zip(data["categories"], names):
            category["name"] = name
        path.write_text(json.dumps(data))
    return str(root)


def test_annotation_files_without_the_classes_in_label_order_are_refused_before_any_work(sample, tmp_path, capsys):
    """MMDetection numbers the classes in the annotation file's order of its categories: other names trained on no
    object (training ended in 'need at least one array to concatenate', naming the val file 4 times; evaluation in
    an IndexError after the whole inference), swapped names scored every box as the other class (mAP 0 for a
    perfect detector). One error line naming the file once, before the work dir or the weights are touched."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    renamed = _categories_copy(sample, tmp_path, ["cat", "dog"])
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", renamed, "--work-dir", str(tmp_path / "w")])
    train_file = os.path.join(renamed, "annotations", "instances_train2017.json")
    assert f"train_dataloader reads {train_file}, which has none of the config's classes (box, disc)" in line, line
    assert line.count("instances_") == 1 and "cat, dog" in line, line
    assert not (tmp_path / "w").exists()
    swapped = _categories_copy(sample, tmp_path, ["disc", "box"])
    with pytest.raises(DetectionError, match=r"test_dataloader reads .*instances_val2017.json, which lists the "
                                             r"categories disc, box where the config's classes are box, disc: label 0 "
                                             r"\(box\) would hold disc's objects; label 1 \(disc\) would hold box's"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", swapped, "--quant",
              "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_a_checkpoint_of_other_classes_is_refused_before_inference(sample, tmp_path):
    """A checkpoint keeps the classes it was trained on (meta.dataset_meta): scored with the config's classes in
    another order, each predicted label would count as the other class."""
    from engine.detection import DetectionError, load_config
    from evaluate_detection import main
    from mmdet.registry import MODELS
    model = MODELS.build(load_config([SAMPLE_CONFIG]).model)
    path = tmp_path / "swapped.pth"
    torch.save({"state_dict": model.state_dict(), "meta": {"dataset_meta": {"classes": ("disc", "box")}}}, path)
    with pytest.raises(DetectionError, match=r"was trained on the classes disc, box .* the evaluated data set has "
                                             r"box, disc"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(path), "--data-root", sample, "--quant",
              "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def _random_detector(tmp_path):
    """A checkpoint of the sample detector at its initial weights, keeping the sample's classes as training does."""
    from engine.detection import load_config
    from mmdet.registry import MODELS
    model = MODELS.build(load_config([SAMPLE_CONFIG]).model)
    path = tmp_path / "random.pth"
    torch.save({"state_dict": model.state_dict(), "meta": {"dataset_meta": {"classes": ("box", "disc")}}}, path)
    return str(path)


@pytest.mark.parametrize("flags, message", [
    (["--bits", "w6a6"], "--bits with a bare --quant: no pipeline runs to use it"),
    (["--calib-images", "4", "--calib-seed", "1"], "--calib-images, --calib-seed with a bare --quant"),
    (["--quant", "repq", "--calib-images", "0"], "--calib-images 0: give at least 1"),
    (["--quant", "repq", "--calib-seed", str(2 ** 63)], r"--calib-seed 9223372036854775808: give a seed >= .* and "
                                                        r"<= 9223372036854775807")])
def test_quantization_flags_that_would_not_be_honoured_are_refused_before_any_work(mmdet_ready, tmp_path, flags,
                                                                                   message):
    """A bare --quant scores full precision only: --bits and the calibration flags were ignored; a calibration
    batch of no image was refused only after the full-precision evaluation."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--out", str(tmp_path / "x.json")]
    with pytest.raises(DetectionError, match=message):
        main(argv + (flags if "--quant" in flags else ["--quant"] + flags))


@pytest.mark.parametrize("pipeline, option, given", [("aphq", "recon_images", None), ("gplq", "stage2_images", None),
                                                     ("aphq", "recon_images", 9)])  # the user's over the recipe's
def test_more_pipeline_images_than_the_training_split_has_are_refused_before_any_work(sample, tmp_path, pipeline,
                                                                                      option, given):
    """APHQ's reconstruction set (default 256) and GPLQ's QwT set (512) come from the 8-image training split: they
    were refused after the full-precision evaluation (and GPLQ's stage-1 training), GPLQ's naming aphq.recon_images.
    A count given in --quant-options is the one checked (and run), not the detection recipe's."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    out = tmp_path / "x.json"
    count = r"\d+" if given is None else str(given)
    with pytest.raises(DetectionError, match=rf"^--quant-options {pipeline}.{option} {count}: the training split has "
                                             r"only 8 images"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample,
              "--out", str(out), "--quant", pipeline, "--quant-options", f"{pipeline}.iters=1"
              if pipeline == "aphq" else "gplq.steps=1", *([f"{pipeline}.{option}={given}"] if given else []),
              "--device", "cpu"])
    assert not out.exists() and not list(tmp_path.glob("x_*"))


def test_a_hook_argument_typo_or_a_hook_index_past_the_end_is_one_error_line(sample, tmp_path, capsys):
    """CD's hook takes **kwargs and checked them only when MMEngine's Runner built it (a TypeError traceback after
    the work dir was made); an override of a list item past the end failed in MMEngine's merge with a KeyError."""
    from engine.detection import DetectionError, load_config, parse_overrides
    cd = os.path.join(ROOT, "configs", "detection", "method", "cd.py")
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--config", cd, "--data-root", sample, "--work-dir",
                               str(tmp_path / "w"), "custom_hooks.0.lamm=0.01"])
    assert "custom_hooks.0 (ColinearityDecayHook) cannot be built" in line and "'lamm'" in line, line
    assert not (tmp_path / "w").exists()
    with pytest.raises(DetectionError, match=r"override custom_hooks.1.lam: custom_hooks has 1 item \(indices from "
                                             r"0\), so there is no custom_hooks.1"):
        load_config([SAMPLE_CONFIG, cd], parse_overrides(["custom_hooks.1.lam=0.01"]))


def test_a_hook_s_priority_is_left_to_the_runner_and_passes_the_hook_check(mmdet_ready):
    """`priority` is MMEngine's Runner's (register_hook takes it out of the dict): CD's hook passes its keyword
    arguments on to ColinearityDecay, which takes no priority, so the check must build the hook without it."""
    from engine.detection import check_hooks, load_config, parse_overrides
    cd = os.path.join(ROOT, "configs", "detection", "method", "cd.py")
    cfg = load_config([SAMPLE_CONFIG, cd], parse_overrides(["custom_hooks.0.priority=ABOVE_NORMAL"]))
    assert cfg.custom_hooks[0].priority == "ABOVE_NORMAL"
    check_hooks(cfg)


def test_evaluation_refuses_a_backbone_checkpoint_override(mmdet_ready):
    """The evaluated detector is built without the backbone's init_cfg and takes every weight from --checkpoint:
    an override of the paper config's backbone checkpoint was accepted and changed nothing."""
    from engine.detection import DetectionError, load_config, parse_overrides
    from evaluate_detection import evaluation_reads
    with pytest.raises(DetectionError, match="does not read model.backbone.init_cfg.*give --checkpoint instead"):
        load_config([os.path.join(ROOT, "configs", "detection", "mask_rcnn_swin_t_1x.py")],
                    parse_overrides(["model.backbone.init_cfg.checkpoint=/w/swin.pth"]),
                    reads=evaluation_reads(["gplq"]))


def test_a_full_precision_evaluation_needs_no_training_annotations(sample, tmp_path):
    """A root with the val split only (no train2017/, no instances_train2017.json) serves a bare --quant: every
    loader's annotation file was checked, so it was refused; a pipeline, which reads the training split, is."""
    import shutil
    from engine.detection import DetectionError
    from evaluate_detection import main
    root = tmp_path / "valonly"
    shutil.copytree(sample, root)
    shutil.rmtree(root / "train2017")
    (root / "annotations" / "instances_train2017.json").unlink()
    common = ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", str(root),
              "--out", str(tmp_path / "x.json")]
    with pytest.raises(DetectionError, match="train_dataloader reads .*instances_train2017.json, which does not exist"):
        main(common + ["--quant", "repq"])
    with pytest.raises(DetectionError, match=r"--checkpoint .*w.pth: no such file"):  # past every data check
        main(common + ["--quant"])


@pytest.mark.parametrize("flags, quant, bits", [
    (["--quant", "val_dataloader.batch_size=1"], [], None),
    (["--quant", "repq", "val_dataloader.batch_size=1"], ["repq"], None),
    (["--quant", "repq", "--bits", "w6a6", "val_dataloader.batch_size=1"], ["repq"], ["w6a6"])])
def test_a_key_value_word_after_quant_or_bits_is_an_override(mmdet_ready, tmp_path, flags, quant, bits):
    """`--quant` and `--bits` take every word after them: a key=value override there was read as a pipeline
    (`--quant val_dataloader.x=1`: "no such pipeline") or a bit-width. As in evaluate.py it is an override (a bare
    --quant stays full precision only), here one the evaluation refuses, which shows it was read as one. A --bits
    left with no bit-width by it is refused (tests/test_cli.py)."""
    from engine.detection import DetectionError
    from evaluate_detection import main, parse_args
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--out", str(tmp_path / "x.json"),
            *flags]
    args = parse_args(argv)
    assert (args.quant, args.bits, args.overrides) == (quant, bits, ["val_dataloader.batch_size=1"])
    with pytest.raises(DetectionError, match="override val_dataloader.batch_size: .*test_dataloader"):
        main(argv)
    assert not (tmp_path / "x.json").exists()


def test_an_out_that_is_no_result_file_names_another_out(sample, tmp_path):
    """`--out` at an existing file that is not a result JSON (here the checkpoint itself) is refused and left as
    it is; the fix is another --out path (the message said "use --out", which the user had done)."""
    from engine.eval_results import ResultsError
    from evaluate_detection import main
    checkpoint = _random_detector(tmp_path)
    before = open(checkpoint, "rb").read()
    with pytest.raises(ResultsError, match=r"cannot be read as JSON .*; move it away or give --out another file$"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", checkpoint, "--data-root", sample, "--quant",
              "--out", checkpoint])
    assert open(checkpoint, "rb").read() == before


@pytest.mark.parametrize("override, named", [
    ("train_dataloader.dataset.pipeline.2.scale=abc", "train_dataloader.dataset.pipeline.2 (Resize)"),
    ("val_dataloader.dataset.pipeline.1.scale=abc", "val_dataloader.dataset.pipeline.1 (Resize)")])
def test_a_transform_setting_that_fails_on_an_image_is_one_error_line_before_training(sample, tmp_path, capsys,
                                                                                      override, named):
    """A transform builds from a setting of the wrong type (Resize keeps scale="abc") and failed with mmcv's
    TypeError traceback at the first step, after the config dump and the settings file were written (the val
    loader's: after a training epoch). One line names the transform and the image; neither file is left."""
    work = tmp_path / "w"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(work),
                               "train_cfg.max_epochs=1", override])
    assert f"error: {named} fails on " in line and "Scale must be a number" in line, line
    assert not (work / "train_detection_config.json").exists() and not (work / os.path.basename(SAMPLE_CONFIG)).exists()


def test_an_evaluation_refuses_a_test_transform_that_fails_on_an_image(sample, tmp_path):
    """The same for the scored loader: refused before the full-precision evaluation, nothing written."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    with pytest.raises(DetectionError, match=r"^test_dataloader.dataset.pipeline.1 \(Resize\) fails on .*val2017"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample,
              "--quant", "--out", str(tmp_path / "x.json"), "test_dataloader.dataset.pipeline.1.scale=abc"])
    assert not (tmp_path / "x.json").exists()


def test_checking_a_pipeline_leaves_the_random_state_as_it_was(sample):
    """The check runs an image through the training pipeline (its RandomFlip draws): a run must draw afterwards
    what it would have drawn without it."""
    import random
    import numpy as np
    from engine.detection import build_loader, check_pipeline, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    cfg.test_dataloader = {**cfg.train_dataloader, "sampler": dict(type="DefaultSampler", shuffle=False)}
    loader = build_loader(cfg, "test")
    assert any(type(t).__name__ == "RandomFlip" for t in loader.dataset.pipeline.transforms)
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    check_pipeline(loader.dataset, "train_dataloader")
    after = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    assert torch.equal(after[0], torch.rand(4)) and np.array_equal(after[1], np.random.rand(4))
    assert after[2] == [random.random() for _ in range(4)]


def test_a_config_file_given_twice_is_refused_before_any_work(sample, tmp_path, capsys):
    """A method fragment given twice (here under two spellings of its path) added its hook twice: two CD hooks on
    one backbone failed with a RuntimeError traceback at the first step, after the config dump and the settings
    file were written (which then refused the corrected command in the same --work-dir)."""
    cd = os.path.join("configs", "detection", "method", "cd.py")
    work = tmp_path / "w"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--config", cd, "--config", os.path.join(ROOT, cd),
                               "--data-root", sample, "--work-dir", str(work), "train_cfg.max_epochs=1"])
    assert line == f"error: --config names {os.path.realpath(os.path.join(ROOT, cd))} twice: give each once", line
    assert not work.exists()


@pytest.mark.parametrize("hours", ["inf", "nan", "1e300", "3e6", "0"])
def test_a_main_rank_wait_that_is_no_positive_number_of_hours_is_one_error(mmdet_ready, tmp_path, monkeypatch,
                                                                           hours):
    """Infinity failed with an OverflowError traceback and NaN with "cannot convert float NaN to integer", naming
    no flag (in datetime.timedelta); 3e6 hours, a valid timedelta, makes gloo's wait group fail under torchrun
    (its timeout in int64 nanoseconds overflows). Under torchrun: one process refuses the flag whatever its value
    (tests/test_detection_refusals.py)."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DetectionError,
                       match=rf"^--main-rank-wait-hours {re.escape(str(float(hours)))}: give a positive number"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--quant",
              "--main-rank-wait-hours", hours])


@pytest.mark.parametrize("count, message", [("5", "the test split has only 4 images"),
                                            ("0", "give at least 1")])  # MMEngine keeps the first 0: none
def test_more_max_images_than_the_test_split_has_are_refused(sample, tmp_path, count, message):
    """MMEngine keeps the images there are: `--max-images 5` on the 4-image split scored all 4 and marked the
    result partial, another evaluation than the full one of the same images; and no image is no evaluation."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    with pytest.raises(DetectionError, match=rf"^--max-images {count}: {message}"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample,
              "--quant", "--max-images", count, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("indices", ["[3,1,2]", "2", "-3"])
def test_max_images_keeps_the_first_images_of_the_test_indices_given(sample, indices):
    """A test split given `indices` (a list of images, the first N, or the last N) is those images: --max-images keeps
    the first of them. It kept the first of the whole split (`indices=[3,1,2] --max-images 1` scored image 0), scored 3
    images of a 2-image subset, and all 3 of `indices=-3 --max-images 1`; the annotation check
    (annotation_contents.scored_images) counts the objects of the images scored."""
    import json
    from engine.detection import DetectionError, build_loader, load_config, parse_overrides, scored_images
    with open(os.path.join(sample, "annotations", "instances_val2017.json")) as f:
        images = json.load(f)["images"]
    ids = [image["id"] for image in images]  # the split in file order, read outside MMDetection
    given = json.loads(indices)
    asked = [ids[i] for i in given] if isinstance(given, list) else ids[:given] if given >= 0 else ids[given:]
    cfg = load_config([SAMPLE_CONFIG], parse_overrides([f"test_dataloader.dataset.indices={indices}"]),
                      data_root=sample)

    def scored(max_images):
        return [s.img_id for batch in build_loader(cfg, "test", max_images) for s in batch["data_samples"]]
    assert scored(None) == asked
    assert scored(1) == asked[:1] and scored(2) == asked[:2]
    assert all(scored(n) == scored_images(images, given)[:n] for n in (1, 2, len(asked)))
    with pytest.raises(DetectionError, match=rf"^--max-images {len(asked) + 1}: the test split has only {len(asked)} "
                                             "images"):
        build_loader(cfg, "test", len(asked) + 1)


def test_pipeline_options_with_a_bare_quant_say_that_no_pipeline_runs(mmdet_ready, tmp_path):
    """The message listed the pipelines that run as "()"."""
    from evaluate_detection import main
    with pytest.raises(ValueError, match=r"for a pipeline that runs \(none: a bare --quant scores full precision "
                                         r"only\)$"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--quant", "--quant-options",
              "repq.round_zero_point=true"])


def test_an_evaluation_without_quant_runs_every_detection_pipeline(mmdet_ready, tmp_path):
    """Without --quant the evaluation runs every pipeline that quantizes detectors (Table 2's four: percentile,
    RepQ-ViT, APHQ, GPLQ): the refusal of a --quant-options word that is no PIPELINE.KEY=VALUE lists those that run,
    before any file is read; a bare --quant runs none."""
    from evaluate_detection import main
    common = ["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--quant-options", "aphq"]
    with pytest.raises(ValueError, match=r"for a pipeline that runs \(percentile, repq, aphq, gplq\)$"):
        main(common)
    with pytest.raises(ValueError, match=r"for a pipeline that runs \(none: a bare --quant"):
        main(common + ["--quant"])


def test_device_cuda_without_a_visible_gpu_is_refused_first(mmdet_ready, tmp_path, monkeypatch):
    """--device cuda on a machine that shows no GPU is refused first, naming the ways out (not a CUDA error from
    deep inside the model's build, nor an error about a file the run never got to)."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DetectionError, match=r"^--device cuda but no CUDA device is visible; use --device cpu or "
                                             r"auto$"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--quant", "--device", "cuda",
              "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_recompute_scores_the_full_precision_detector_again(sample, tmp_path):
    """--recompute replaces the full-precision score a results file holds (a file whose FP pass is marked by a
    seconds value no pass takes: -1), and without it the stored score stays. Where no pipeline runs and the file
    holds no score to replace (none there yet), it would change nothing, and is refused as evaluate.py refuses it:
    no file written."""
    import json
    from configs import ConfigError
    from evaluate_detection import main
    out = tmp_path / "eval.json"
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample, "--quant",
            "--max-images", "1", "--out", str(out)]
    with pytest.raises(ConfigError, match=rf"^--recompute would be ignored: this evaluation runs no pipeline .*"
                                          rf"{re.escape(str(out))} holds no full-precision score to replace"):
        main(argv + ["--recompute"])
    assert not out.exists()
    main(argv)
    stored = json.loads(out.read_text())
    stored["fp"]["seconds"] = -1.0
    out.write_text(json.dumps(stored))
    assert main(argv)["fp"]["seconds"] == -1.0
    assert main(argv + ["--recompute"])["fp"]["seconds"] >= 0.0
    assert json.loads(out.read_text())["fp"]["seconds"] >= 0.0


@pytest.mark.parametrize("config", ["configs/debug/tiny.yaml", "configs/detection/method/cd.py"])
def test_a_config_without_a_detector_is_one_error_line_before_any_work(sample, tmp_path, capsys, config):
    """A train.py recipe failed with MMEngine's KeyError traceback (its model has no `type`) after the work dir was
    made; a method fragment alone with a cd_budget message about a weight decay it never had."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    work = tmp_path / "w"
    line = error_line(capsys, ["--config", config, "--data-root", sample, "--work-dir", str(work)])
    assert line.startswith(f"error: --config {config}: no MMDetection detector in it"), line
    assert not work.exists()
    with pytest.raises(DetectionError, match=f"^--config {config}: no MMDetection detector in it"):
        main(["--config", config, "--data-root", sample, "--checkpoint", str(tmp_path / "w.pth"), "--quant"])


def test_overrides_may_stand_between_the_flags(mmdet_ready):
    """`a=b --work-dir w c=d`: argparse took only the first run of overrides and refused the rest as "unrecognized
    arguments"; evaluate.py (parse_known_intermixed_args) reads them all, and so do the detection scripts."""
    import train_detection
    from evaluate_detection import parse_args
    args = train_detection.parse_args(["--config", "c", "a=1", "--work-dir", "w", "b=2", "--resume", "c=3"])
    assert (args.work_dir, args.resume, args.overrides) == ("w", True, ["a=1", "b=2", "c=3"])
    args = parse_args(["--config", "c", "a=1", "--checkpoint", "k", "b=2", "--quant", "repq", "c=3"])
    assert (args.checkpoint, args.quant, args.overrides) == ("k", ["repq"], ["a=1", "b=2", "c=3"])


@pytest.mark.parametrize("override", ["model.roi_head.bbox_head.num_classes=5",
                                      "model.roi_head.mask_head.num_classes=3",
                                      "model.roi_head.bbox_head.num_classes=1"])  # fewer: one class never learnt
def test_a_head_of_another_number_of_classes_than_the_data_is_refused_before_training(sample, tmp_path, capsys,
                                                                                      override):
    """A box head of 5 classes on the sample's 2 trained an epoch and failed with an IndexError traceback in the
    validation after it (its checkpoint written)."""
    key, count = override.split("=")
    work = tmp_path / "w"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(work), override])
    assert line.startswith(f"error: {override}, but train_dataloader has 2 classes (box, disc): set {key}=2"), line
    assert not work.exists()


@pytest.mark.parametrize("seed", ["abc", "-1", "4294967296", "1.5"])
def test_a_seed_numpy_cannot_take_is_one_error_line_before_any_work(sample, tmp_path, capsys, seed):
    """MMEngine's Runner seeds numpy with randomness.seed: text or a negative number failed with a traceback from
    inside it, after the work dir was made."""
    work = tmp_path / "w"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(work),
                               f"randomness.seed={seed}"])
    assert line.startswith("error: randomness.seed=") and "give a whole number from 0 to 2**32 - 1" in line, line
    assert not work.exists()


def test_a_bad_bit_width_names_the_flag_and_an_out_folder_is_not_to_be_moved(sample, tmp_path):
    """`--bits w4` said "bit-width 'w4' is not of the form 'w4a4'" (evaluate.py names --bits); `--out` at a folder
    (a run's) was told to "move it away"."""
    from engine.detection import DetectionError
    from engine.eval_results import ResultsError
    from evaluate_detection import main
    with pytest.raises(DetectionError, match=r"^--bits: bit-width 'w4' is not of the form"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--quant", "repq", "--bits", "w4"])
    folder = tmp_path / "run"
    folder.mkdir()
    with pytest.raises(ResultsError,
                       match=rf"^{folder} is a folder: give --out a file path, e\.g\. {folder}/eval\.json"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample, "--quant",
              "--out", str(folder)])


def test_an_out_naming_a_folder_is_refused_before_the_config_data_or_checkpoint_are_read(tmp_path):
    """`--out new/` (a folder still to be made) failed at the first write, after the detector was scored; an
    existing folder only after the detector and test split loaded. The checkpoint here does not exist, so a refusal
    of anything read later would name it instead; nothing is written."""
    from engine.eval_results import ResultsError
    from evaluate_detection import main
    missing = str(tmp_path / "missing.pth")
    (tmp_path / "run").mkdir()
    for out, refused in ((str(tmp_path / "new") + os.sep, "names a folder (it ends in a path separator)"),
                         (str(tmp_path / "run"), "is a folder: give --out a file path")):
        with pytest.raises(ResultsError, match=re.escape(refused)):
            main(["--config", SAMPLE_CONFIG, "--checkpoint", missing, "--quant", "--out", out])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not any((tmp_path / "run").iterdir())


def test_the_class_count_check_reads_box_and_mask_heads_only(mmdet_ready):
    """A cascade's box heads are checked each; a head that counts other classes (an HTC semantic head's stuff
    classes) keeps its own count."""
    from engine.detection import DetectionError, check_head_classes, load_config
    cfg = load_config([SAMPLE_CONFIG])
    cfg.model.semantic_head = dict(type="FusedSemanticHead", num_classes=183)
    check_head_classes(cfg)  # the sample's 2 classes in its box and mask heads
    box = dict(cfg.model.roi_head.bbox_head)
    cfg.model.roi_head.bbox_head = [box, {**box, "num_classes": 80}, box]
    with pytest.raises(DetectionError, match=r"^model\.roi_head\.bbox_head\.1\.num_classes=80, but train_dataloader "
                                             r"has 2 classes"):
        check_head_classes(cfg)


def test_a_seed_that_diff_rank_seed_carries_past_numpy_s_range_is_refused(mmdet_ready, monkeypatch):
    """With randomness.diff_rank_seed each rank seeds numpy with seed + rank: 2**32 - 2 on 4 ranks failed inside
    the Runner of ranks 2 and 3."""
    from engine.detection import DetectionError
    from train_detection import check_seed
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_seed({"randomness": {"seed": 2 ** 32 - 4, "diff_rank_seed": True}})
    check_seed({"randomness": {"seed": 2 ** 32 - 2}})  # one seed for every rank
    with pytest.raises(DetectionError, match=r"randomness.seed=4294967294: give a whole number from 0 to 2\*\*32 - 4 "
                                             r"\(randomness.diff_rank_seed adds each of the 4 ranks' index\)"):
        check_seed({"randomness": {"seed": 2 ** 32 - 2, "diff_rank_seed": True}})


def test_an_unknown_test_metric_is_named_as_a_setting_not_blamed_on_the_annotation_file(sample, tmp_path):
    """`test_evaluator.metric=bboxx` fails in CocoMetric's constructor with a KeyError, which was reported as the
    annotation file that "cannot be read as a COCO annotation file"; the file is the test loader's, which reads it."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    out = tmp_path / "x.json"
    with pytest.raises(DetectionError) as refused:
        main(["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample, "--quant",
              "--max-images", "1", "--out", str(out), "test_evaluator.metric=bboxx"])
    message = str(refused.value)
    assert message.startswith("test_evaluator could not be built from the config (KeyError: \"metric should be one "
                              "of 'bbox', "), message
    assert "but got bboxx" in message and "cannot be read as a COCO annotation file" not in message, message
    assert not out.exists()


def test_an_evaluation_with_a_list_of_test_metrics_scores(sample, tmp_path):
    """test_evaluator may be a list of metrics, as MMEngine's Evaluator takes it (the scoring handles one): the
    result's identity read `.get` of the list and failed with an AttributeError after the weights were read."""
    from evaluate_detection import main
    fragment = tmp_path / "metrics.py"
    fragment.write_text("test_evaluator = [dict(type='CocoMetric', ann_file='data/coco/annotations/"
                        "instances_val2017.json', metric=['bbox', 'segm'], format_only=False)]\n")
    data = main(["--config", SAMPLE_CONFIG, "--config", str(fragment), "--checkpoint", _random_detector(tmp_path),
                 "--data-root", sample, "--quant", "--max-images", "1", "--out", str(tmp_path / "x.json")])
    assert data["fp"]["images"] == 1 and 0.0 <= data["fp"]["bbox_mAP"] <= 1.0
    assert data["data"]["ann_file"] == os.path.join(sample, "annotations", "instances_val2017.json")


def test_the_training_images_drawn_follow_the_seed_given_and_repeat_with_it(sample):
    """TrainingImages.draw: `count` distinct images of the training split, the same set for the same seed (also from
    a split built afresh, as each evaluation builds its own), another for another seed; DetectorFeed (the calibration
    batch, --calib-seed) and DetectorSamples (APHQ's / GPLQ's own images) draw with the seed they are given."""
    import json

    from engine.detection import DetectorFeed, DetectorSamples, TrainingImages, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    images = TrainingImages(cfg)
    with open(os.path.join(sample, "annotations", "instances_train2017.json")) as f:
        ids = {image["id"] for image in json.load(f)["images"]}  # the split, read outside MMDetection
    assert len(images) == len(ids) == 8

    def drawn(seed, source=images):
        indices, samples = source.draw(3, seed, "--calib-images")
        return indices, [s["data_samples"].img_id for s in samples]

    sets = {}
    for seed in range(6):
        indices, img_ids = drawn(seed)
        assert len(set(indices)) == 3 and len(set(img_ids)) == 3 and set(img_ids) <= ids
        assert drawn(seed) == (indices, img_ids) == drawn(seed, TrainingImages(cfg))
        sets[seed] = tuple(indices)
    assert len(set(sets.values())) > 1  # 6 seeds, C(8, 3) = 56 sets: one set for every seed means the seed is unused
    negative = {seed: drawn(-seed)[0] for seed in range(1, 6)}  # random.Random(-s) is random.Random(s)
    assert any(tuple(negative[seed]) != sets[seed] for seed in negative)
    assert all(drawn(-seed)[0] == negative[seed] for seed in negative)
    for seed in (0, 1, 2):
        assert tuple(DetectorFeed(cfg, 3, seed, images).indices) == sets[seed]
        assert tuple(DetectorSamples(cfg, 3, seed, "--quant-options aphq.recon_images", images).indices) == sets[seed]


def test_the_training_split_check_refuses_no_images_and_more_than_it_has(sample):
    """TrainingImages.check, which evaluate_detection.py runs on each image count before any work: at least 1
    image, at most the split's 8 (counted by hand in the sample), each refusal naming the flag that asked."""
    from engine.detection import DetectionError, TrainingImages, load_config
    images = TrainingImages(load_config([SAMPLE_CONFIG], data_root=sample))
    images.check(1, "--calib-images")
    images.check(8, "--calib-images")
    with pytest.raises(DetectionError, match=r"^--quant-options aphq.recon_images 0: give at least 1$"):
        images.check(0, "--quant-options aphq.recon_images")
    with pytest.raises(DetectionError, match=r"^--calib-images 9: the training split has only 8 images$"):
        images.check(9, "--calib-images")


def test_a_calibration_feed_runs_its_images_in_one_test_step_and_counts_them(sample):
    """DetectorFeed.feed: one test step of the detector on all `count` images at once, and the number of images it
    calibrated on (what calibrate() reports) is that count; a detector that records its calls stands in."""
    from engine.detection import DetectorFeed, load_config

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.batches = []

        def test_step(self, batch):
            self.batches.append(len(batch["inputs"]))
    feed, model = DetectorFeed(load_config([SAMPLE_CONFIG], data_root=sample), 3, 0), Recorder()
    assert len(feed) == 1 and feed.feed(model) == 3 and model.batches == [3]


def test_the_rpn_outputs_of_a_reconstruction_image_are_those_of_its_test_step_input(sample):
    """APHQ weighs a unit by the RPN outputs of the image as the detector scores it: the data preprocessor in test
    mode, so a config's training-only batch augmentation (here a fixed 128-pixel pad) is not applied; the first
    FPN level (stride 4) of a 64-pixel image padded to a multiple of 32 is 16 x 16, by hand."""
    from engine.detection import DetectorSamples, load_config
    from mmdet.registry import MODELS
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    cfg.model.data_preprocessor.batch_augments = [dict(type="BatchFixedSizePad", size=(128, 128))]
    samples = DetectorSamples(cfg, 1, 0)
    assert tuple(samples.batches[0]["inputs"][0].shape[-2:]) == (64, 64)
    with torch.no_grad():
        logits, deltas = samples.rpn_outputs(MODELS.build(cfg.model).eval(), 0)
    assert tuple(logits[0].shape[-2:]) == (16, 16) == tuple(deltas[0].shape[-2:])


def test_the_training_images_quantization_draws_get_the_test_pipeline(sample):
    """Calibration and reconstruction images come from the training split with the TEST pipeline (no random flip):
    each is what the config's test transforms, built here one by one, make of that image."""
    import copy
    from engine.detection import TrainingImages, load_config
    from mmdet.registry import TRANSFORMS
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    images = TrainingImages(cfg)
    transforms = [TRANSFORMS.build(t) for t in copy.deepcopy(cfg.test_dataloader.dataset.pipeline)]
    for index in range(len(images)):
        expected = images.dataset.get_data_info(index)
        for transform in transforms:
            expected = transform(expected)
        got = images.dataset[index]
        assert torch.equal(got["inputs"], expected["inputs"]), index
        assert got["data_samples"].metainfo == expected["data_samples"].metainfo, index
    # the whole split may be asked for (--calib-images 8 on these 8 images): every image, once
    assert images.draw(len(images), 0, "--calib-images")[0] == list(range(len(images)))


@pytest.mark.parametrize("qwt", [True, False])
def test_gplq_qwt_images_count_against_the_split_only_with_qwt_on(sample, qwt):
    """GPLQ draws stage2_images (default 512) only for QwT: with gplq.qwt=false the 8-image split is no reason to
    refuse it; with QwT on it is refused before any work."""
    from engine.detection import DetectionError, TrainingImages, load_config
    from evaluate_detection import check_image_counts
    images = TrainingImages(load_config([SAMPLE_CONFIG], data_root=sample))
    todo = [("gplq", "w4a4")]
    if qwt:
        with pytest.raises(DetectionError, match=r"^--quant-options gplq.stage2_images 512: the training split has "
                                                 r"only 8 images"):
            check_image_counts(images, todo, {"gplq": {"qwt": True}}, 1)
        check_image_counts(images, todo, {"gplq": {"qwt": True, "stage2_images": 8}}, 1)  # the whole split fits
    else:
        check_image_counts(images, todo, {"gplq": {"qwt": False}}, 1)
    with pytest.raises(DetectionError, match=r"^--calib-images 9: the training split has only 8 images"):
        check_image_counts(images, todo, {"gplq": {"qwt": qwt, "stage2_images": 1}}, 9)


@pytest.mark.parametrize("qwt", [[], ["gplq.qwt=false"]])
@pytest.mark.parametrize("steps_first", [True, False])
def test_gplq_batch_at_steps_0_is_one_error_line(mmdet_ready, tmp_path, capsys, qwt, steps_first):
    """A detector's gplq.batch_size_per_gpu is stage 1's loader batch alone (its QwT feeds one image at a time):
    at gplq.steps=0, QwT on or off, it was taken and recorded as a setting of the result while nothing read it.
    Given before gplq.steps=0 it was taken still (each item was checked against the defaults of those after it)."""
    from tests.conftest import run_entry
    given = [*qwt, "gplq.batch_size_per_gpu=4"]
    given = ["gplq.steps=0", *given] if steps_first else [*given, "gplq.steps=0"]
    code, _, err = run_entry("evaluate_detection.py", [
        "--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--out", str(tmp_path / "x.json"),
        "--quant", "gplq", "--quant-options", *given], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: --quant-options gplq.batch_size_per_gpu=4: quant.gplq.batch_size_per_gpu=4 "
                               "would be ignored: quant.gplq.batch_size_per_gpu is read only when quant.gplq.steps "
                               "is nonzero"), lines[0]
    assert not (tmp_path / "x.json").exists()


def test_a_result_recording_the_batch_at_steps_0_is_extended(sample, tmp_path):
    """Before gplq.batch_size_per_gpu was refused at gplq.steps=0 on a detector (configs/loader.py DETECTOR_ONLY),
    result files recorded it there; such a file could no longer be extended ('computed with other settings
    (options.batch_size_per_gpu 2 -> None)', and giving the batch again is refused as unread). Its entry compares
    by the rules the command line applies: the stored w4a4 is kept as it was, and w8a8 is added beside it."""
    import json

    from evaluate_detection import main
    out = tmp_path / "x.json"
    argv = ["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample,
            "--out", str(out), "--quant", "gplq", "--quant-options", "gplq.steps=0", "gplq.qwt=false",
            "--max-images", "1", "--device", "cpu"]
    main([*argv, "--bits", "w4a4"])
    old = json.loads(out.read_text())  # as written before the refusal: the batch recorded beside steps=0
    old["quant"]["gplq"]["w4a4"]["settings"]["options"]["batch_size_per_gpu"] = 2
    out.write_text(json.dumps(old))
    result = main([*argv, "--bits", "w4a4", "w8a8"])
    assert result["quant"]["gplq"]["w4a4"] == old["quant"]["gplq"]["w4a4"]
    # every option it read (as recorded since): none of stage 1's updates nor of QwT's fits
    stage1 = ("batch_size_per_gpu", "lr", "scale_lr", "weight_decay", "amp", "log_every", "ckpt_every",
              "pca_variance", "pca_multiple", "pca_images")
    expected = {k: v for k, v in GPLQ_RECIPE.items() if k not in QWT_OPTIONS + stage1} | {"steps": 0, "qwt": False}
    assert result["quant"]["gplq"]["w8a8"]["settings"]["options"] == as_stored(expected)


def test_gplq_without_qwt_runs_on_a_detector(sample, tmp_path):
    """`--quant-options gplq.qwt=false` was refused ("stage2_train_transform=True: a detector's QwT images get the
    test pipeline"): at qwt=false the recipe's stage2_train_transform=False is left out (nothing reads it) and the
    class default came back, and giving it false beside qwt=false is refused as unread. GPLQ without QwT ran on
    no detector at all; it now trains its stage 1 and fits no block."""
    from evaluate_detection import main
    result = main(["--config", SAMPLE_CONFIG, "--checkpoint", _random_detector(tmp_path), "--data-root", sample,
                   "--out", str(tmp_path / "x.json"), "--quant", "gplq", "--quant-options", "gplq.qwt=false",
                   "gplq.steps=1", "--max-images", "1", "--device", "cpu"])
    entry = result["quant"]["gplq"]["w4a4"]
    assert entry["stage1"]["steps"] == 1 and entry["qwt"]["blocks"] == [] and entry["qwt"]["images"] == 0
    # every option it read, with the lr used (07ef5a4b): the paper's 1e-6 below a global batch of 64 (the detection
    # recipe's 1), scale_lr falling back to it; not the teacher PCA's (off at the recipe's pca_weight 0)
    pca = ("pca_variance", "pca_multiple", "pca_images")
    expected = {k: v for k, v in GPLQ_RECIPE.items() if k not in QWT_OPTIONS + pca} | {
        "qwt": False, "steps": 1, "lr": 1e-6, "scale_lr": 1e-6}
    assert entry["settings"]["options"] == as_stored(expected)


def test_a_checkpoint_saved_from_a_ddp_wrapped_detector_loads_as_the_detector(mmdet_ready, tmp_path):
    """A state_dict saved from the DDP-wrapped model has every key under `module.`: build_detector strips that prefix
    (once, at the start of a key) and loads the same weights as the unwrapped checkpoint's."""
    from engine.detection import build_detector, load_config
    cfg = load_config([SAMPLE_CONFIG])
    payload = torch.load(_random_detector(tmp_path), map_location="cpu", weights_only=False)
    state = payload["state_dict"]
    torch.manual_seed(0)  # weights unlike the freshly built model's, so that a load that did nothing shows
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()}
    wrapped = tmp_path / "ddp.pth"
    torch.save({**payload, "state_dict": {f"module.{k}": v for k, v in state.items()}}, wrapped)
    loaded = build_detector(cfg, str(wrapped), torch.device("cpu")).state_dict()
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_a_detector_built_from_a_checkpoint_is_in_eval_mode(mmdet_ready, tmp_path):
    """build_detector hands back the detector ready to score or quantize: every module in eval mode (MMDetection
    builds it in training mode, and a calibration hands a model back in the mode it was given), with the classes
    its checkpoint keeps."""
    from engine.detection import build_detector, load_config
    model = build_detector(load_config([SAMPLE_CONFIG]), _random_detector(tmp_path), torch.device("cpu"))
    assert [name for name, module in model.named_modules() if module.training] == []
    assert model.dataset_meta == {"classes": ("box", "disc")}


def test_a_backbone_loading_through_mmengine_s_pretrained_init_is_left_to_it(mmdet_ready, tmp_path):
    """A backbone whose init_weights loads with MMEngine's PretrainedInit (a ResNet: it logs the weights it leaves)
    never calls the backbone's load_state_dict, so nothing is compared and its own checkpoint passes (it is not
    refused as holding none of the backbone's weights); the file then really loads into it."""
    from engine.detection import check_backbone_init, load_config
    from mmdet.registry import MODELS
    resnet = dict(type="ResNet", depth=18, num_stages=4, out_indices=(0, 1, 2, 3), norm_eval=True)
    torch.manual_seed(0)
    state = MODELS.build(resnet).state_dict()
    path = tmp_path / "resnet18.pth"
    torch.save({"state_dict": state}, path)
    cfg = load_config([SAMPLE_CONFIG])
    cfg.model.backbone = dict(resnet, init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    check_backbone_init(cfg)
    backbone = MODELS.build(cfg.model.backbone)
    backbone.init_weights()
    assert torch.equal(backbone.conv1.weight, state["conv1.weight"])


@pytest.mark.parametrize("pipelines, override, message", [
    (["gplq"], "train_dataloader.batch_size=4", "does not read train_dataloader.batch_size.*gplq.batch_size_per_gpu=N"),
    (["percentile", "repq"], "train_dataloader.num_workers=4", "does not read train_dataloader.num_workers.*drop it"),
    (["aphq"], "train_dataloader.sampler.shuffle=False", "does not read train_dataloader.sampler.*drop it"),
    (["repq"], "train_dataloader.dataset.indices=[0]", "does not read train_dataloader.dataset.indices.*drop it"),
    (["percentile"], "train_dataloader.dataset.pipeline=[]",
     "test pipeline .*does not read train_dataloader.dataset.pipeline.*give test_dataloader.dataset.pipeline")])
def test_evaluation_refuses_training_loader_settings_its_pipelines_do_not_read(mmdet_ready, pipelines, override,
                                                                                message):
    """Percentile, RepQ-ViT and APHQ draw their images from the whole training dataset with the test pipeline
    (engine/detection/feeds.py); only GPLQ's stage 1 loads batches with train_dataloader, at a batch size of its
    own: any other override of the training loader was accepted and changed nothing."""
    from engine.detection import DetectionError, load_config, parse_overrides
    from evaluate_detection import evaluation_reads
    with pytest.raises(DetectionError, match=f"override {override.split('=')[0]}: .*{message}"):
        load_config([SAMPLE_CONFIG], parse_overrides([override]), reads=evaluation_reads(pipelines))


@pytest.mark.parametrize("pipelines, override", [
    (["percentile"], "train_dataloader.dataset.ann_file=annotations/instances_val2017.json"),  # which images
    (["gplq"], "train_dataloader.num_workers=0"),  # GPLQ's stage 1 loads with it
    (["gplq", "repq"], "train_dataloader.dataset.pipeline=[]")])
def test_evaluation_takes_training_loader_settings_a_pipeline_reads(mmdet_ready, pipelines, override):
    from engine.detection import load_config, parse_overrides
    from evaluate_detection import evaluation_reads
    (key, value), = parse_overrides([override]).items()
    cfg = load_config([SAMPLE_CONFIG], {key: value}, reads=evaluation_reads(pipelines))
    node = cfg
    for part in key.split("."):
        node = node[part]
    assert node == value


def test_an_evaluator_annotation_file_given_as_an_override_is_kept_under_a_new_root(sample, tmp_path):
    """--data-root moves every evaluator to the root's annotations/, except one whose ann_file the user overrides:
    that file is what was asked for (a relabelled copy, say), and it stays as given while the loaders move."""
    from engine.detection import load_config
    given = str(tmp_path / "relabelled.json")
    cfg = load_config([SAMPLE_CONFIG], {"test_evaluator.ann_file": given}, data_root=sample)
    assert cfg.test_evaluator.ann_file == given
    assert cfg.val_evaluator.ann_file == os.path.join(os.path.abspath(sample), "annotations",
                                                      "instances_val2017.json")
    assert cfg.test_dataloader.dataset.data_root == os.path.join(os.path.abspath(sample), "")


def test_a_data_root_that_is_no_folder_is_refused_naming_it(mmdet_ready, tmp_path):
    from mmengine.config import Config
    from engine.detection import DetectionError
    from engine.detection.data_checks import set_data_root
    missing = tmp_path / "coco"
    with pytest.raises(DetectionError, match=rf"^--data-root {missing}/: no such folder"):
        set_data_root(Config(dict(data_root="data/coco/")), str(missing))


def test_the_pipeline_check_stops_where_a_transform_drops_the_image(mmdet_ready):
    """As MMEngine's Compose: a transform that returns None drops the image and the ones after it never run."""
    from types import SimpleNamespace
    from engine.detection import check_pipeline
    ran = []

    def later(results):
        ran.append(results)
        return results["img_path"]  # fails on None

    class OneImage:
        pipeline = SimpleNamespace(transforms=[lambda results: None, later])

        def get_data_info(self, index):
            return {"img_path": "a.jpg"}

        def __len__(self):
            return 1
    dataset = OneImage()
    check_pipeline(dataset, "train_dataloader")
    assert ran == []


def test_an_evaluator_of_one_of_the_files_a_concatenated_loader_reads_is_not_compared_with_the_first(mmdet_ready):
    """A loader that concatenates data sets reads several files: its evaluator is not held to the first of them;
    one loader file and another evaluator file are refused."""
    from mmengine.config import Config
    from engine.detection import DetectionError, check_evaluator_annotations
    concat = Config(dict(test_dataloader=dict(dataset=dict(type="ConcatDataset", datasets=[
        dict(ann_file="/d/a.json"), dict(ann_file="/d/b.json")])), test_evaluator=dict(ann_file="/d/b.json")))
    check_evaluator_annotations(concat)
    single = Config(dict(test_dataloader=dict(dataset=dict(ann_file="/d/a.json")),
                         test_evaluator=dict(ann_file="/d/b.json")))
    with pytest.raises(DetectionError, match=r"^test_evaluator.ann_file=/d/b.json but test_dataloader reads /d/a.json"):
        check_evaluator_annotations(single)


@pytest.mark.parametrize("pipelines, override, world, message", [
    (["repq"], "env_cfg.cudnn_benchmark=True", "1", "does not read env_cfg"),
    (["percentile", "aphq"], "log_processor.window_size=5", "1", "does not read log_processor"),
    ([], "find_unused_parameters=True", "2", "does not read find_unused_parameters"),
    (["repq"], "find_unused_parameters=True", "2", "does not read find_unused_parameters"),
    # GPLQ's stage 1 wraps the detector in DDP under torchrun only
    (["gplq"], "find_unused_parameters=True", "1", r"in this one process, without DDP\) and does not read "
                                                   "find_unused_parameters"),
    (["gplq"], "env_cfg.dist_cfg.timeout=60", "2", "does not read env_cfg.dist_cfg")])  # its Runner joins the ranks
def test_evaluation_refuses_runner_settings_only_gplq_s_stage_1_reads_where_it_would_not_read_them(
        mmdet_ready, monkeypatch, pipelines, override, world, message):
    """env_cfg, log_processor and find_unused_parameters are read by GPLQ's stage-1 Runner alone
    (engine/detection/qat.py): an evaluation without GPLQ took them and changed nothing."""
    from engine.detection import DetectionError, load_config, parse_overrides
    from evaluate_detection import evaluation_reads
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(DetectionError, match=rf"override {override.split('=')[0]}: .*{message}, so it would change "
                                             "nothing; drop it"):
        load_config([SAMPLE_CONFIG], parse_overrides([override]), reads=evaluation_reads(pipelines))


@pytest.mark.parametrize("pipelines, overrides, world", [
    (["gplq"], ["env_cfg.cudnn_benchmark=True", "log_processor.window_size=5"], "1"),
    (["gplq", "repq"], ["find_unused_parameters=True"], "2")])
def test_evaluation_takes_the_runner_settings_gplq_s_stage_1_reads(mmdet_ready, monkeypatch, pipelines, overrides,
                                                                   world):
    from engine.detection import load_config, parse_overrides
    from evaluate_detection import evaluation_reads
    monkeypatch.setenv("WORLD_SIZE", world)
    load_config([SAMPLE_CONFIG], parse_overrides(overrides), reads=evaluation_reads(pipelines))


@pytest.mark.parametrize("override, instead", [
    ("test_dataloader.batch_size=1", "give it to evaluate_detection.py, which scores test_dataloader"),
    ("test_evaluator.metric=bbox", "give it to evaluate_detection.py"),
    ("test_cfg.type=TestLoop", "drop it")])
def test_training_refuses_an_override_of_the_test_loop_it_never_builds(sample, tmp_path, capsys, override, instead):
    """Runner.train() builds the train and val loops only: a test_* override was stored in the run's settings and
    read by nothing."""
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(tmp_path / "w"),
                               "train_cfg.max_epochs=1", override])
    key = override.split("=")[0]
    assert line.startswith(f"error: override {key}: the training trains on train_dataloader") and \
        f"does not read {key.split('.')[0]}, so it would change nothing; {instead}" in line, line
    assert not (tmp_path / "w").exists()


def test_a_resume_takes_every_weight_from_the_checkpoint_without_the_backbone_file_the_run_started_from(
        sample, tmp_path, monkeypatch):
    """Runner.train() initialises the weights (the backbone from its Pretrained file) before it resumes: a run
    whose ImageNet checkpoint had moved since it started failed to resume with a FileNotFoundError traceback,
    though the run's checkpoint holds every weight. It resumes, every weight the checkpoint's, and its config
    still names the file."""
    import engine.detection
    from train_detection import main
    backbone = _official_swin_checkpoint(tmp_path / "swin.pth")
    config = tmp_path / "pretrained.py"
    config.write_text(f"_base_ = {os.path.join(ROOT, SAMPLE_CONFIG)!r}\nmodel = dict(backbone=dict(init_cfg=dict("
                      f"_delete_=True, type='Pretrained', checkpoint={backbone!r})))\n")
    work = tmp_path / "run"
    argv = ["--config", str(config), "--data-root", sample, "--work-dir", str(work), "randomness.seed=0",
            "train_cfg.val_interval=100"]
    assert main([*argv, "train_cfg.max_epochs=1"]) == 0
    os.rename(backbone, tmp_path / "moved.pth")
    started = {}

    class Recording(engine.detection.RngStateHook):
        def before_train(self, runner):  # after the resume
            super().before_train(runner)
            started.update({k: v.clone() for k, v in runner.model.state_dict().items()})  # training moves them
    monkeypatch.setattr(engine.detection, "RngStateHook", Recording)
    assert main([*argv, "train_cfg.max_epochs=2", "--resume"]) == 0
    saved = torch.load(work / "epoch_1.pth", map_location="cpu", weights_only=False)["state_dict"]
    assert started.keys() == saved.keys()
    assert [k for k in saved if not torch.equal(started[k], saved[k])] == []
    assert backbone in (work / "pretrained.py").read_text()  # the run's config dump keeps the Pretrained file


@pytest.mark.parametrize("method, hook", [("cd", "ColinearityDecayHook"), ("noise", "WeightNoiseHook")])
def test_a_method_hook_given_twice_is_one_error_line_naming_both_files(sample, tmp_path, capsys, method, hook):
    """A method fragment in the first config's _base_ list and given as a --config as well: both hooks were built
    and training failed at the first step with a RuntimeError traceback (CD's second update in the optimizer's
    step, WeightNoise's second hooks on the same layers)."""
    fragment = os.path.join(ROOT, f"configs/detection/method/{method}.py")
    config = tmp_path / "with_method.py"
    config.write_text(f"_base_ = [{os.path.join(ROOT, SAMPLE_CONFIG)!r}, {fragment!r}]\n")
    line = error_line(capsys, ["--config", str(config), "--config", fragment, "--data-root", sample, "--work-dir",
                               str(tmp_path / "w"), "train_cfg.max_epochs=1"])
    assert line == (f"error: custom_hooks.0 and custom_hooks.1 are both {hook}s on backbone (--config {config} adds "
                    f"one, --config {fragment} another): the method would apply twice in each step; give its fragment "
                    "once (drop the repeated --config, or the fragment from the _base_ list)"), line
    assert not (tmp_path / "w").exists()


def test_method_hooks_on_parts_that_do_not_overlap_both_run(mmdet_ready, tmp_path):
    """CD on the backbone and on the neck, the noise on the backbone's Linear and Conv2d layers by two hooks: each
    applies once; on overlapping parts (the whole model and the backbone) they would not."""
    from engine.detection import DetectionError, load_config
    fragment = tmp_path / "two.py"
    fragment.write_text("custom_hooks = [dict(type='ColinearityDecayHook'), dict(type='ColinearityDecayHook', "
                        "module='neck'), dict(type='WeightNoiseHook'), dict(type='WeightNoiseHook', "
                        "layer_types=['Conv2d'])]\n")
    assert len(load_config([SAMPLE_CONFIG, str(fragment)]).custom_hooks) == 4
    fragment.write_text("custom_hooks = [dict(type='TweoHook'), dict(type='TweoHook', module='')]\n")
    with pytest.raises(DetectionError, match=rf"^custom_hooks.0 and custom_hooks.1 are both TweoHooks on backbone and "
                                             rf"the whole model \(--config {fragment} adds both\)"):
        load_config([SAMPLE_CONFIG, str(fragment)])


@pytest.mark.parametrize("world, test_batch, recorded", [(2, 2, True), (2, 1, False), (1, 2, False)])
def test_a_quantized_result_at_a_test_batch_over_one_records_the_number_of_ranks(monkeypatch, world, test_batch,
                                                                                 recorded):
    """At a test batch of more than one image the ranks batch other images together than one process does, and
    4-bit codes flip with the rounding (RepQ-ViT W4A4 box mAP 0.013 vs 0.014 on the sample): a one-process entry
    was taken for a 2-rank run's. At batch 1 the scores are the same, and the entry is shared."""
    from types import SimpleNamespace
    import engine.distributed
    from evaluate_detection import settings
    monkeypatch.setattr(engine.distributed, "world_size", lambda: world)
    args = SimpleNamespace(calib_images=1, calib_seed=0)
    assert settings(args, "repq", None, test_batch) == {"calib_images": 1, "calib_seed": 0,
                                                        **({"world_size": world} if recorded else {})}
