"""The detection task in the real MMDetection 3.3 (full mmcv, CPU): a tiny Mask R-CNN + Swin on the generated
COCO-format sample (data/coco_sample.py, configs/detection/debug/mask_rcnn_swin_sample.py), trained by
scripts/train_detection.py with and without CD, and scored by evaluate_detection.py in full precision and
under the detection pipelines, with mAP from pycocotools.

Marked `detection`: deselected by default (full mmcv builds from source, scripts/install_mmcv.sh); CI runs them
in a second step with `python -m pytest -m detection`.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from detection_runs import SAMPLE_CONFIG, error_line, train  # its fixtures (sample, trained) come through conftest.py

pytestmark = pytest.mark.detection

CD_FRAGMENT = """custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
custom_hooks = [dict(type="ColinearityDecayHook", lam=0.5, input_shape=(1, 3, 64, 64))]
"""


def _state(path):
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def test_the_cd_hook_moves_exactly_the_backbone_matrices_it_decays(sample, tmp_path):
    """ONE update (the 8 training images in one batch) with and without CD, from the same seed: the neck, the
    heads and every weight CD does not decay come out bit-equal; every downstream matrix W2 of a pair of the
    Swin backbone moved. So the hook found the detector's backbone, and decayed it at the update."""
    from cd import find_pairs
    from engine.detection import load_config
    from mmdet.registry import MODELS
    one_update = ("train_dataloader.batch_size=8", "param_scheduler=[]")
    base = _state(train(sample, tmp_path / "base", *one_update))
    fragment = tmp_path / "cd_hook.py"
    fragment.write_text(CD_FRAGMENT)
    with_cd = _state(train(sample, tmp_path / "cd", *one_update, configs=[str(fragment)]))
    backbone = MODELS.build(load_config([SAMPLE_CONFIG]).model).backbone
    decayed = {f"backbone.{p.name}" for p in find_pairs(backbone, example_input=torch.zeros(1, 3, 64, 64))}
    roles = {p.role for p in find_pairs(backbone, example_input=torch.zeros(1, 3, 64, 64))}
    assert roles == {"qkv", "proj", "fc1", "fc2", "reduction"}, roles
    moved = {k for k in base if base[k].is_floating_point() and not torch.equal(base[k], with_cd[k])}
    assert moved == decayed, (sorted(moved - decayed)[:5], sorted(decayed - moved)[:5])


@pytest.mark.parametrize("method", ["cd", "tweo", "noise"])
def test_each_method_config_trains_the_detector(sample, tmp_path, method):
    """configs/detection/method/<method>.py as a second --config: the detector trains an epoch with the method's
    hook on its backbone, and the weights differ from a plain run's from the same seed (TWEO also logs its term;
    CD's fragment lowers the weight decay by lam, the budget rule)."""
    from engine.detection import method_of, training_config
    base_checkpoint = train(sample, tmp_path / "base")
    base = _state(base_checkpoint)
    work = tmp_path / method
    method_checkpoint = train(sample, work, configs=[f"configs/detection/method/{method}.py"])
    with_method = _state(method_checkpoint)
    # the method as evaluate_detection.py records it, from the training config the checkpoint keeps
    meta = [torch.load(path, map_location="cpu", weights_only=False)["meta"]
            for path in (base_checkpoint, method_checkpoint)]
    assert [method_of(training_config(m)) for m in meta] == ["Baseline",
                                                           dict(cd="CD", tweo="TWEO", noise="Noise")[method]]
    assert training_config({}) is None and training_config({"cfg": "not python ("}) is None
    assert any(not torch.equal(base[k], with_method[k]) for k in base if base[k].is_floating_point())
    assert all(torch.isfinite(v).all() for v in with_method.values() if v.is_floating_point())
    saved = (work / "mask_rcnn_swin_sample.py").read_text()
    assert f"type='{dict(cd='ColinearityDecayHook', tweo='TweoHook', noise='WeightNoiseHook')[method]}'" in saved
    if method == "cd":
        assert "weight_decay=0.045" in saved
    if method == "tweo":
        log = next(work.glob("*/*.log")).read_text()
        assert "loss_tweo:" in log


def test_evaluate_detection_scores_fp_and_the_detection_pipelines(sample, trained, tmp_path):
    """evaluate_detection.py on the trained sample detector: FP box / mask mAP equal pycocotools run directly on
    the detector's own boxes (an independent COCOeval), the activation maxima are positive, and percentile and
    RepQ-ViT W4A4 produce scored, quantized detectors; a second call adds nothing and a JSON of other weights is
    refused."""
    from evaluate_detection import main
    out = tmp_path / "eval.json"
    data = main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--out", str(out),
                 "--quant", "percentile", "repq"])
    on_disk = json.loads(out.read_text())
    assert on_disk["quant"].keys() == {"percentile", "repq"} and data["quant"] == on_disk["quant"]
    for key in ("bbox_mAP", "segm_mAP"):
        assert 0.0 <= data["fp"][key] <= 1.0
    assert data["fp"]["images"] == 4
    assert data["max_act"]["backbone"] > 0 and data["max_act"]["head"] > 0
    assert data["fp"]["bbox_mAP"] == pytest.approx(direct_bbox_map(sample, trained), abs=1e-3)
    for pipeline in ("percentile", "repq"):
        entry = data["quant"][pipeline]["w4a4"]
        assert 0.0 <= entry["bbox_mAP"] <= 1.0 and 0.0 <= entry["segm_mAP"] <= 1.0
        assert entry["summary"], entry
    assert on_disk["method"] == "Baseline"  # from the checkpoint's training config (no method hook)
    # the file as Fig. 1's detection half reads it (scripts/motivation_figure.py)
    import motivation_figure
    row, = motivation_figure.main([str(out), "--out", str(tmp_path / "fig")])
    assert (row["model"], row["method"]) == ("mask_rcnn_swin_sample", "Baseline")
    assert row["quantized"] == pytest.approx(100 * data["quant"]["repq"]["w4a4"]["bbox_mAP"])
    assert row["max_act"] == data["max_act"]["backbone"]


def test_the_detection_result_file_names_the_software_that_scored_it(sample, trained, tmp_path):
    """evaluate.py's result file records the software {commit, torch, timm, python} of the call that computed its
    numbers, evaluate_detection.py's did not; its full-precision score and maxima and each quantized entry now do,
    and a file scored by other software is still reused (software is no setting of the evaluation)."""
    import platform

    import timm
    from evaluate_detection import main
    out = tmp_path / "eval.json"
    args = ["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--out", str(out),
            "--quant", "percentile", "--bits", "w8a8"]
    main(args)
    saved = json.loads(out.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), capture_output=True, text=True).stdout.strip()
    for software in (saved["software"], saved["quant"]["percentile"]["w8a8"]["software"]):
        assert software["torch"] == torch.__version__ and software["timm"] == timm.__version__
        assert software["python"] == platform.python_version()
        assert software["commit"].partition("+")[0] == commit
    other = {"commit": "0000000", "torch": "0.0", "timm": "0.0", "python": "0.0"}
    saved["software"] = saved["quant"]["percentile"]["w8a8"]["software"] = other
    out.write_text(json.dumps(saved))
    again = main(args)  # nothing scored again: the file's numbers, and the software that scored them, stay
    assert again["software"] == other and again["quant"]["percentile"]["w8a8"] == saved["quant"]["percentile"]["w8a8"]
    assert again["fp"] == saved["fp"]


def test_max_images_scores_a_marked_partial_set_in_its_own_file(sample, trained, tmp_path):
    from evaluate_detection import main
    out = tmp_path / "partial.json"
    data = main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--quant",
                 "--max-images", "2", "--out", str(out)])
    assert data["fp"]["images"] == 2 and data["data"]["partial"] is True and data["quant"] == {}
    # a file written before the method was recorded: the same command adds it and recomputes nothing
    old = json.loads(out.read_text())
    del old["method"]
    old["fp"]["seconds"] = -1.0  # a recomputed FP pass would replace it
    out.write_text(json.dumps(old))
    again = main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--quant",
                  "--max-images", "2", "--out", str(out)])
    assert json.loads(out.read_text())["method"] == again["method"] == "Baseline"
    assert again["fp"]["seconds"] == -1.0
    from engine.eval_results import ResultsError
    with pytest.raises(ResultsError, match="another evaluation"):  # the full set is another evaluation
        main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--quant",
              "--out", str(out)])


def test_a_result_file_of_other_annotations_at_the_same_path_is_refused_and_an_older_one_takes_their_hash(
        sample, trained, tmp_path):
    """The identity named the annotation file by its path: one edited at the same path (another export, a fixed
    box) had its results added to those scored against the old ground truth."""
    import hashlib
    import shutil

    from engine.eval_results import ResultsError
    from evaluate_detection import main
    root, out = tmp_path / "coco", tmp_path / "eval.json"
    shutil.copytree(sample, root)
    ann = root / "annotations" / "instances_val2017.json"
    score = lambda: main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", str(root), "--quant",
                          "--max-images", "2", "--out", str(out)])
    score()
    first = json.loads(out.read_text())
    assert first["annotations_sha256"] == hashlib.sha256(ann.read_bytes()).hexdigest()  # by hand
    original = ann.read_bytes()
    coco = json.loads(original)
    coco["annotations"][0]["bbox"][0] += 1.0  # a fixed box: the same images, other ground truth
    ann.write_text(json.dumps(coco))
    before = out.read_bytes()
    with pytest.raises(ResultsError, match=r"another evaluation \(annotations_sha256: '[0-9a-f]{64}' in the file"):
        score()
    assert out.read_bytes() == before
    # a file written before the hash was recorded is taken as of the annotations there now (it takes the hash at
    # its next write; this call has nothing to add)
    ann.write_bytes(original)
    out.write_text(json.dumps({k: v for k, v in first.items() if k != "annotations_sha256"}))
    assert score()["fp"] == first["fp"]


def direct_bbox_map(sample, checkpoint):
    """Box mAP of the checkpoint by pycocotools' COCOeval on its own predictions, outside MMDetection's metric."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from engine.detection import build_detector, build_loader, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    model = build_detector(cfg, checkpoint, torch.device("cpu"))
    gt = COCO(os.path.join(sample, "annotations", "instances_val2017.json"))
    cat_ids = sorted(gt.getCatIds())
    dets = []
    with torch.no_grad():
        for batch in build_loader(cfg, "test"):
            for sample_out in model.test_step(batch):
                inst = sample_out.pred_instances
                for box, score, label in zip(inst.bboxes.tolist(), inst.scores.tolist(), inst.labels.tolist()):
                    x0, y0, x1, y1 = box
                    dets.append({"image_id": sample_out.img_id, "category_id": cat_ids[label],
                                 "bbox": [x0, y0, x1 - x0, y1 - y0], "score": score})
    evaluation = COCOeval(gt, gt.loadRes(dets), "bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    return float(evaluation.stats[0])


def test_training_refuses_what_it_cannot_do_as_asked(sample, tmp_path, capsys):
    """One `error:` line before any work: an unset, remote or missing backbone checkpoint, a data root without
    COCO's files, a work dir holding another run's checkpoints (nothing is overwritten), --resume with nothing
    to resume."""
    full = ["--config", "configs/detection/mask_rcnn_swin_t_1x.py", "--data-root", sample]
    # the paper's config reads the sample with the sample's classes (its 80 COCO classes are not in the sample),
    # its heads sized for them
    classes = [f"{loader}.dataset.metainfo.classes=('box','disc')" for loader in ("train_dataloader", "val_dataloader")]
    classes += [f"model.roi_head.{head}.num_classes=2" for head in ("bbox_head", "mask_head")]
    classes += ["optim_wrapper.type=OptimWrapper"]  # its AMP runs on a GPU only (check_amp refuses it first here)

    def error(argv):
        return error_line(capsys, argv + (classes if argv[:len(full)] == full else []))

    unset = error(full + ["--work-dir", str(tmp_path / "a")])
    assert "model.backbone.init_cfg.checkpoint is not set" in unset and "model.backbone.init_cfg=None" in unset
    from engine.detection import check_backbone_init, load_config
    check_backbone_init(load_config(["configs/detection/mask_rcnn_swin_t_1x.py"],
                                    {"model.backbone.init_cfg": None}))  # the way out it names is accepted
    assert "is a URL" in error(full + ["--work-dir", str(tmp_path / "b"),
                                       "model.backbone.init_cfg.checkpoint=https://example.com/swin.pth"])
    assert "no such file" in error(full + ["--work-dir", str(tmp_path / "c"),
                                           "model.backbone.init_cfg.checkpoint=/nonexistent/swin.pth"])
    assert "did you mean train_cfg" in error(["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir",
                                              str(tmp_path / "t"), "train_cgf.max_epochs=1"])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "--data-root" in error(["--config", SAMPLE_CONFIG, "--data-root", str(empty), "--work-dir",
                                   str(tmp_path / "d")])
    done = tmp_path / "done"
    checkpoint = train(sample, done)
    before = os.path.getmtime(checkpoint)
    assert "holds checkpoints of an earlier run" in error(["--config", SAMPLE_CONFIG, "--data-root", sample,
                                                           "--work-dir", str(done)])
    assert os.path.getmtime(checkpoint) == before
    assert "no last_checkpoint" in error(["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir",
                                          str(tmp_path / "e"), "--resume"])


def test_evaluation_refuses_weights_of_another_model_and_non_finite_weights(sample, trained, tmp_path):
    from engine.detection import DetectionError, build_detector, load_config
    cfg = load_config([SAMPLE_CONFIG], {"model.neck.out_channels": 48, "model.rpn_head.in_channels": 48},
                      data_root=sample)
    with pytest.raises(DetectionError, match="does not fit the model"):
        build_detector(cfg, trained, torch.device("cpu"))
    with pytest.raises(DetectionError, match=r"is a folder: give a checkpoint file in it \(epoch_<N>.pth"):
        build_detector(cfg, os.path.dirname(trained), torch.device("cpu"))
    classifier = tmp_path / "best.pt"  # train.py's: the classifier's weights and its config
    torch.save({"model": {"head.weight": torch.zeros(10, 4)}, "config": {"model": {"name": "vit_nano"}}}, classifier)
    with pytest.raises(DetectionError, match=r"is a checkpoint of train.py \(an image classifier or language "
                                             r"model\), not of a detector"):
        build_detector(cfg, str(classifier), torch.device("cpu"))
    payload = torch.load(trained, map_location="cpu", weights_only=False)
    payload["state_dict"]["backbone.stages.0.blocks.0.ffn.layers.1.weight"][0, 0] = float("nan")
    broken = tmp_path / "nan.pth"
    torch.save(payload, broken)
    with pytest.raises(DetectionError, match="non-finite weights: backbone.stages.0.blocks.0.ffn.layers.1.weight"):
        build_detector(load_config([SAMPLE_CONFIG], data_root=sample), str(broken), torch.device("cpu"))


def test_aphq_reconstructs_the_backbone_and_neck_and_switches_on_the_calibrated_heads(sample, trained, tmp_path):
    """APHQ on the sample detector, as the official detection code: units stem, blocks, patch mergings (APH loss
    from the RPN) and the FPN neck (MSE), one image per iteration; the RPN and RoI heads calibrated only; every
    quantizer on and calibrated at the end; then evaluate_detection scores it with pycocotools."""
    from engine.detection import DetectorFeed, DetectorSamples, build_detector, load_config
    from evaluate_detection import main
    from quant import PIPELINES
    from quant.modes import named_quantizers
    from quant.pipeline_data import PipelineData
    from configs.quant import APHQ_DETECTION, APHQOptions
    from engine.eval_results import as_stored
    from quant.aphq.detector import MLP_OPTIONS
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    model = build_detector(cfg, trained, torch.device("cpu"))
    data = PipelineData(detector_samples=lambda count, seed: DetectorSamples(cfg, count, seed))
    options = {**APHQ_DETECTION, "calib_images": 1, "recon_images": 3, "iters": 3, "log_every": 0}
    quantized, report = PIPELINES["aphq"](model, DetectorFeed(cfg, 1), "w4a4", options, data=data)
    units = [(u["unit"], u["kind"], u["loss"]) for u in report["units"]]
    blocks = [n for n, _ in model.named_modules() if n.count(".") == 4 and ".blocks." in n]
    merges = [n for n, m in model.named_modules() if n.endswith(".downsample") and m is not None]
    assert units[0] == ("backbone.patch_embed", "stem", "aph") and units[-1] == ("neck", "neck", "mse")
    assert {u[0] for u in units[1:-1]} == set(blocks + merges) and all(u[2] == "aph" for u in units[1:-1])
    assert report["calibrated_only"] == ["rpn_head", "roi_head"]
    assert report["data"]["reconstruction_images"] == 3
    quantizers = dict(named_quantizers(quantized))
    assert any(n.startswith("rpn_head.") for n in quantizers) and any(n.startswith("roi_head.") for n in quantizers)
    assert all(q.enabled and q.calibrated for q in quantizers.values()), [n for n, q in quantizers.items()
                                                                         if not (q.enabled and q.calibrated)]
    assert model.backbone.stages[0].blocks[0].attn.w_msa.qkv.weight.dtype == torch.float32  # float untouched

    out = tmp_path / "eval.json"
    result = main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--out", str(out),
                   "--quant", "aphq", "--quant-options", "aphq.iters=2", "aphq.recon_images=2"])
    entry = result["quant"]["aphq"]["w4a4"]
    assert 0.0 <= entry["bbox_mAP"] <= 1.0 and len(entry["units"]) == len(units)
    # every option it ran with: the options given over the detection recipe (of --calib-images 1) and the
    # perturbation used; the MLP reconstruction's, off on a detector, are read by none
    recipe = {**vars(APHQOptions()), **APHQ_DETECTION, "calib_images": 1}
    expected = {**{k: v for k, v in recipe.items() if k not in MLP_OPTIONS}, "iters": 2, "recon_images": 2,
                "hessian_eps": 1e-3}
    assert json.loads(out.read_text())["quant"]["aphq"]["w4a4"]["settings"]["options"] == as_stored(expected)


def test_aphq_weights_backbone_units_by_the_sigmoid_rpn_outputs_and_keeps_qdrop_off_the_neck(sample, monkeypatch):
    """What APHQ hands each unit's reconstruction, against the official detection code: the APH weight for the
    backbone units only, computed against the float detector's RPN objectness PROBABILITIES (sigmoid of its
    logits, the official raw_cls) and box deltas; the neck without APH and without QDrop (set_qdrop reaches no
    convolution), every other unit with the options' drop_prob."""
    import quant.aphq.detector as aphq_detector
    from engine.detection import DetectorFeed, DetectorSamples, load_config
    from mmdet.registry import MODELS
    from quant import PIPELINES
    from quant.calibrate import calibrate
    from quant.pipeline_data import PipelineData
    from configs.quant import APHQ_DETECTION
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    torch.manual_seed(0)
    model = MODELS.build(cfg.model).eval()
    made = []
    data = PipelineData(detector_samples=lambda count, seed: made.append(DetectorSamples(cfg, count, seed)) or made[-1])
    hessian_calls, recon_calls = [], []

    def hessians(frozen, unit, samples, rpn_outputs, refs, eps):  # only what it is given is checked here
        hessian_calls.append((unit, refs, eps))
        return [[torch.ones(1)] for _ in refs]

    def recon(module, fp_calls, q_calls, weights, settings, name=""):
        recon_calls.append((name, weights is not None, settings.drop_prob))
        return {"rec_first": 0.0, "rec_last": 0.0, "seconds": 0.0}
    monkeypatch.setattr(aphq_detector, "detector_hessians", hessians)
    monkeypatch.setattr(aphq_detector, "reconstruct_unit_calls", recon)
    # min/max instead of APHQ's search: the search is tested in test_aphq_detector_parts.py
    monkeypatch.setattr(aphq_detector, "calibrate_aphq", lambda model, units, calib, search, generator: calibrate(
        model, calib))
    options = {**APHQ_DETECTION, "calib_images": 1, "recon_images": 1, "iters": 1, "log_every": 0, "drop_prob": 0.5}
    PIPELINES["aphq"](model, DetectorFeed(cfg, 1), "w4a4", options, data=data)

    with torch.no_grad():
        logits, deltas = made[0].rpn_outputs(model, 0)
    assert hessian_calls and all(unit.startswith("backbone.") for unit, _, _ in hessian_calls)
    for _, refs, eps in hessian_calls:
        (cls, box), = refs
        assert eps == 1e-3
        assert all(torch.allclose(c, torch.sigmoid(l)) for c, l in zip(cls, logits))
        assert all(torch.allclose(b, d) for b, d in zip(box, deltas))
    assert recon_calls[-1] == ("neck", False, 1.0)  # 1: every element quantized, QDrop off
    assert all(aph and drop == 0.5 for name, aph, drop in recon_calls[:-1]), recon_calls


class _Stage1Started(Exception):
    pass


def test_gplq_stage1_trains_lsq_scales_on_float_weights_at_the_papers_lr(sample):
    """What GPLQ hands its stage 1 on a detector (the paper's W32A4 stage): every weight quantizer off, every
    activation quantizer on with its scale an nn.Parameter in the scale group, at the paper's lr for the global
    batch (quant.gplq.pipeline.default_lr) and the scale lr equal to it when none is given."""
    from engine.detection import DetectorFeed, load_config
    from mmdet.registry import MODELS
    from quant import PIPELINES
    from quant.gplq.pipeline import default_lr
    from quant.modes import named_quantizers
    from quant.pipeline_data import PipelineData
    from configs.quant import GPLQ_DETECTION
    from quant_models import unread_samples
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    torch.manual_seed(0)
    model = MODELS.build(cfg.model).eval()
    seen = {}

    def stage1(student, settings, work_dir):
        seen.update(settings=settings, weight=[q.enabled for _, q in named_quantizers(student, "weight")],
                    act=[(q.enabled, q.calibrated, isinstance(q.scale, torch.nn.Parameter) and q.scale.requires_grad)
                         for _, q in named_quantizers(student, "activation")],
                    scales={id(q.scale) for _, q in named_quantizers(student, "activation")})
        raise _Stage1Started
    data = PipelineData(train_detector=stage1, detector_samples=unread_samples)  # stage 2 never runs
    with pytest.raises(_Stage1Started):
        PIPELINES["gplq"](model, DetectorFeed(cfg, 1), "w4a4", {**GPLQ_DETECTION, "init_images": 1}, data=data)
    settings = seen["settings"]
    assert seen["weight"] and not any(seen["weight"])
    assert seen["act"] and all(all(a) for a in seen["act"]), seen["act"][:3]
    assert settings["lr"] == pytest.approx(default_lr(1)) and settings["scale_lr"] == settings["lr"]
    weights, scales = settings["param_groups"]
    assert {id(p) for p in scales["params"]} == seen["scales"] and scales["lr"] == settings["lr"]
    assert scales["weight_decay"] == 0.0 and weights["lr"] == settings["lr"]


def test_gplq_trains_the_detector_on_its_own_loss_resumes_its_stage1_and_compensates_the_backbone(
        sample, trained, tmp_path):
    """GPLQ on the sample detector: stage 1 through MMEngine's runner on the detection loss (lr 0 leaves every
    float weight as it was: the runner did not re-initialise the detector; a positive lr moves them), its folder
    resumed by the same run and refused to another, QwT on every backbone block; evaluate_detection scores it."""
    from engine.detection import DetectionError, DetectorFeed, DetectorSamples, build_detector, load_config, \
        train_activation_qat
    from evaluate_detection import main
    from quant import PIPELINES
    from quant.gplq.qwt import is_compensated
    from quant.pipeline_data import PipelineData
    from configs.quant import GPLQ_DETECTION
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    model = build_detector(cfg, trained, torch.device("cpu"))
    data = PipelineData(detector_samples=lambda count, seed: DetectorSamples(cfg, count, seed),
                        train_detector=lambda student, stage1, work: train_activation_qat(student, cfg, stage1, work),
                        work_prefix=str(tmp_path / "eval"))
    # lr 0 keeps the float weights where they were (only the LSQ scales train at scale_lr): the runner must not
    # re-initialise the detector; scale_lr 0 too would be refused as a stage 1 that updates nothing
    options = {**GPLQ_DETECTION, "init_images": 1, "steps": 2, "stage2_images": 2, "lr": 0.0, "scale_lr": 1e-3}
    quantized, report = PIPELINES["gplq"](model, DetectorFeed(cfg, 1), "w4a4", options, data=data)
    fp = dict(model.named_parameters())
    moved = [n for n, p in quantized.named_parameters() if n in fp and not torch.equal(p, fp[n])]
    assert not moved, moved[:4]
    assert report["stage1"]["steps"] == 2 and report["stage1"]["resumed"] is False
    blocks = [n for n, _ in model.named_modules() if n.count(".") == 4 and ".blocks." in n]
    assert [b["unit"] for b in report["qwt"]["blocks"]] == blocks
    for stats in report["qwt"]["blocks"]:
        assert is_compensated(quantized.get_submodule(stats["unit"])) == stats["kept"]
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    assert (folder / "last_checkpoint").is_file() and (folder / "gplq_stage1.json").is_file()

    _, again = PIPELINES["gplq"](model, DetectorFeed(cfg, 1), "w4a4", options, data=data)
    assert again["stage1"]["resumed"] is True and again["stage1"]["steps"] == 2
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(DetectionError, match="another run"):
        PIPELINES["gplq"](model, DetectorFeed(cfg, 1), "w4a4", {**options, "steps": 3}, data=data)
    assert sorted(p.name for p in folder.iterdir()) == before
    # the checkpoint last_checkpoint names is gone: refused, never a silent start from iteration 0
    latest = (folder / "last_checkpoint").read_text().strip()
    os.rename(latest, latest + ".moved")
    with pytest.raises(DetectionError, match="which does not exist"):
        PIPELINES["gplq"](model, DetectorFeed(cfg, 1), "w4a4", options, data=data)
    os.rename(latest + ".moved", latest)

    out = tmp_path / "trained.json"
    result = main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--out", str(out),
                   "--quant", "gplq", "--quant-options", "gplq.steps=2", "gplq.stage2_images=2", "gplq.lr=0.001"])
    entry = result["quant"]["gplq"]["w4a4"]
    assert 0.0 <= entry["bbox_mAP"] <= 1.0 and entry["stage1"]["steps"] == 2 and entry["qwt"]["blocks"]
    stage1 = tmp_path / "trained_gplq_w4a4_stage1"
    written = (stage1 / "last_checkpoint").read_text().strip()
    after = torch.load(written, map_location="cpu", weights_only=False)["state_dict"]
    key = "backbone.stages.0.blocks.0.attn.w_msa.qkv.weight"
    assert not torch.equal(after[key], fp[key].detach())  # lr 1e-3: stage 1 trained the float weights
    # evaluate_detection's own check before the full-precision score accepts the folder the same settings wrote
    again = main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--out", str(out),
                  "--quant", "gplq", "--quant-options", "gplq.steps=2", "gplq.stage2_images=2", "gplq.lr=0.001",
                  "--recompute"])
    assert again["quant"]["gplq"]["w4a4"]["stage1"]["resumed"] is True


def test_gplq_stage1_of_one_epoch_resumes_at_its_iteration_and_a_finished_one_trains_no_more(sample, tmp_path):
    """Stage 1 by default trains one epoch: its checkpoints are by iteration, and MMEngine resumed an epoch loop at
    the start of the epoch (an interrupted stage 1 trained its first iterations twice, a finished one a whole second
    epoch after a later stage failed: 16 steps recorded for an 8-image epoch). One epoch is the training set's
    images at batch 1 (counted on the data set itself), however often the run is resumed."""
    from engine.detection import load_config, train_activation_qat
    from mmdet.registry import DATASETS, MODELS
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    epoch = len(DATASETS.build(cfg.train_dataloader.dataset))  # images after the config's filter, batch 1
    model = MODELS.build(cfg.model)
    settings = {"steps": None, "batch_size_per_gpu": 1, "lr": 1e-4, "weight_decay": 0.0, "amp": "none",
                "param_groups": [{"params": list(model.parameters())}], "log_every": 100, "ckpt_every": 2,
                "seed": 0, "identity": {"test": "one epoch"}}
    work = tmp_path / "stage1"
    first = train_activation_qat(model, cfg, settings, str(work))
    assert epoch > 4 and first["steps"] == epoch and not first["resumed"]
    (work / "last_checkpoint").write_text(str(work / "iter_4.pth"))  # as if stopped after iteration 4
    resumed = train_activation_qat(model, cfg, settings, str(work))
    assert resumed["steps"] == epoch and resumed["resumed"]
    assert not (work / f"iter_{epoch + 2}.pth").exists()
    latest = _state(work / f"iter_{epoch}.pth")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    again = train_activation_qat(model, cfg, settings, str(work))  # finished: loads its weights, trains nothing
    assert again["steps"] == epoch and again["resumed"] and again["loss"] is None
    assert all(torch.equal(value, latest[name]) for name, value in model.state_dict().items())
    assert not (work / f"iter_{epoch + 2}.pth").exists()


def test_evaluation_refuses_pipeline_options_it_would_not_honour(sample, trained, tmp_path):
    from evaluate_detection import main
    base = ["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample,
            "--out", str(tmp_path / "x.json")]
    for options, message in ((["aphq.calib_images=2"], "--calib-images"),
                             (["aphq.mlp_reconstruct=True"], "mlp_reconstruct"),
                             (["aphq.batch_size=2"], "one image per batch"),
                             (["aphq.iter=2"], "did you mean 'aphq.iters'"),
                             (["aphq.iters=abc"], "'aphq.iters' expects int"),
                             (["repq.x=1"], "for a pipeline that runs"),
                             (["gplq.pca_weight=1.0"], "without the PCA loss"),
                             (["gplq.pca_images=100"], "pca_images is read only when quant.gplq.pca_weight is nonzero"),
                             (["aphq.temperature=10"], "has none"),
                             (["gplq.init_images=4"], "--calib-images"),
                             (["iters=1"], "PIPELINE.KEY=VALUE")):
        with pytest.raises(ValueError, match=message):
            main(base + ["--quant", "aphq", "gplq", "--quant-options", *options])
    assert not (tmp_path / "x.json").exists()


def test_gplq_on_the_cpu_is_refused_while_a_gpu_is_visible(sample, trained, tmp_path, monkeypatch):
    """MMEngine's runner would train stage 1 on the visible GPU while the rest stays on the CPU: refused before
    any work (a CPU machine pretends to see a GPU)."""
    from engine.detection import DetectionError
    from evaluate_detection import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(DetectionError, match="CUDA_VISIBLE_DEVICES="):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--quant", "gplq",
              "--device", "cpu", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_evaluation_refuses_a_pipeline_that_does_not_quantize_detectors(sample, trained, tmp_path):
    from engine.detection import DetectionError
    from evaluate_detection import main
    for pipeline, message in (("gptq", "does not quantize detectors"), ("nope", "no such pipeline")):
        with pytest.raises(DetectionError, match=message):
            main(["--config", SAMPLE_CONFIG, "--checkpoint", trained, "--data-root", sample, "--quant", pipeline,
                  "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_method_fragments_add_their_hooks_to_the_earlier_files(mmdet_ready, tmp_path):
    """Two method fragments both run (MMEngine alone replaces custom_hooks, keeping the first fragment's weight
    decay and the second one's hook), and a base config's own hooks stay."""
    from engine.detection import load_config
    cfg = load_config([SAMPLE_CONFIG, "configs/detection/method/cd.py", "configs/detection/method/tweo.py"])
    assert [h["type"] for h in cfg.custom_hooks] == ["ColinearityDecayHook", "TweoHook"]
    assert cfg.optim_wrapper.optimizer.weight_decay == 0.045
    assert list(cfg.custom_imports.imports) == ["cd.integrations.mmengine"]
    own = tmp_path / "own_hooks.py"
    own.write_text(f"_base_ = {os.path.abspath(SAMPLE_CONFIG)!r}\ncustom_hooks = [dict(type='EMAHook')]\n"
                   "custom_imports = dict(imports=['mmdet.models'], allow_failed_imports=False)\n")
    cfg = load_config([str(own), "configs/detection/method/noise.py"])
    assert [h["type"] for h in cfg.custom_hooks] == ["EMAHook", "WeightNoiseHook"]
    assert list(cfg.custom_imports.imports) == ["mmdet.models", "cd.integrations.mmengine"]


@pytest.mark.parametrize("overrides, weight_decay", [
    ([], 0.045), (["custom_hooks.0.lam=0.01"], 0.04), (["optim_wrapper.optimizer.weight_decay=0.1"], 0.095),
    (["cd_budget=False"], 0.05), (["custom_hooks.0.lam_per_role={'fc2':0.02}"], 0.045)])
def test_the_cd_fragment_lowers_the_weight_decay_by_the_lam_the_command_gives(mmdet_ready, tmp_path, overrides,
                                                                               weight_decay):
    """The budget rule (App. A.2) follows the merged config: an override of the hook's lam or of the weight decay
    moves it (the fragment once held a fixed 0.045, whatever lam ran), cd_budget=False leaves 0.05 (the sample
    config's), per-role strengths leave it at the base lam; the config MMEngine dumps reloads to the same value."""
    from engine.detection import load_config, parse_overrides
    from mmengine.config import Config
    cfg = load_config([SAMPLE_CONFIG, "configs/detection/method/cd.py"], parse_overrides(overrides))
    assert Config.fromfile(SAMPLE_CONFIG).optim_wrapper.optimizer.weight_decay == 0.05
    assert cfg.optim_wrapper.optimizer.weight_decay == weight_decay
    dump = tmp_path / "dump.py"
    cfg.dump(str(dump))
    assert load_config([str(dump)]).optim_wrapper.optimizer.weight_decay == weight_decay
    from train_detection import run_settings  # --resume compares the weight decay, not the key's record of it
    settings = run_settings(cfg)
    assert "cd_budget" not in settings and settings["optim_wrapper.optimizer.weight_decay"] == repr(weight_decay)


@pytest.mark.parametrize("fragment, overrides, message", [
    ("configs/detection/method/cd.py", ["custom_hooks.0.lam=0.06"],
     "weight_decay 0.05 - ColinearityDecayHook lam 0.06 < 0"),
    ("configs/detection/method/cd.py", ["cd_budget=yes"], "override cd_budget=yes: the config holds true or false"),
    ("custom_hooks = [dict(type='ColinearityDecayHook', lam=0.005)]\ncd_budget = 'yes'\n", [],
     "cd_budget='yes': give True"),
    ("custom_hooks = [dict(type='ColinearityDecayHook', lam=0.005), dict(type='ColinearityDecayHook', lam=0.01, "
     "module='neck')]\ncd_budget = True\n", [], r"2 ColinearityDecayHooks of lam \[0.005, 0.01\]"),
    ("cd_budget = True\n", [], "cd_budget=True with 0 ColinearityDecayHooks: ")])
def test_a_budget_that_cannot_be_applied_is_refused(mmdet_ready, tmp_path, fragment, overrides, message):
    from engine.detection import DetectionError, load_config, parse_overrides
    if not fragment.endswith(".py"):
        (tmp_path / "fragment.py").write_text(fragment)
        fragment = str(tmp_path / "fragment.py")
    with pytest.raises(DetectionError, match=message):
        load_config([SAMPLE_CONFIG, fragment], parse_overrides(overrides))


@pytest.mark.parametrize("override, message", [
    ("work_dir=/tmp/x", "give --work-dir instead"), ("launcher=pytorch", "give --launcher instead"),
    ("resume=True", "give --resume instead"), ("data_root=/tmp/x", "give --data-root instead"),
    ("model.test_cfg.rcnn.max_per_imgg=5", "did you mean model.test_cfg.rcnn.max_per_img"),
    ("train_cfg.max_epoch=1", "EpochBasedTrainLoop .*did you mean train_cfg.max_epochs"),
    ("model.backbone.window_sizee=7", "SwinTransformer .*did you mean model.backbone.window_size"),
    ("train_dataloader.pin_memoryy=True", "DataLoader takes no argument 'pin_memoryy'")])
def test_overrides_that_would_be_ignored_are_refused(mmdet_ready, override, message):
    """An override the command overwrites from its flags, or a key nothing reads (a new key under a dict
    without a `type`, or one the registered class's __init__ does not take), is refused before any work."""
    from engine.detection import DetectionError, load_config, parse_overrides
    with pytest.raises(DetectionError, match=message):
        load_config([SAMPLE_CONFIG], parse_overrides([override]))


@pytest.mark.parametrize("override, message", [
    ("train_cfg.max_epochs=abc", "override train_cfg.max_epochs=abc: the config holds a number there"),
    ("model.backbone.with_cp=yes", "override model.backbone.with_cp=yes: the config holds true or false there"),
    ("train_cfg.max_epochs=2.5", "override train_cfg.max_epochs=2.5: train_cfg counts in whole numbers"),
    ("train_cfg.val_interval=0", "override train_cfg.val_interval=0: give at least 1"),  # a modulo by zero
    ("train_cfg.max_epochs=-1", "override train_cfg.max_epochs=-1: give at least 1")])  # after a whole epoch
def test_an_override_of_the_wrong_type_is_named(sample, tmp_path, capsys, override, message):
    """Text for a number or flag, or a fraction of an epoch count, is one error line naming the override, before
    the Runner writes anything into the work dir: MMEngine stored 'abc' and its loop's int() failed while the
    annotation files were read (blamed on them), and 2.5 failed its loop's assert with a traceback."""
    from detection_runs import error_line
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir",
                               str(tmp_path / "run"), override])
    assert line.startswith(f"error: {message}"), line
    assert not (tmp_path / "run").exists()


def test_a_start_that_fails_once_the_runner_is_built_names_the_setting_and_leaves_the_folder_usable(
        sample, tmp_path, capsys):
    """A setting that fails only when the loops are built (a batch size of 0, an unknown metric) was blamed on the
    annotation files ('cannot be read as a COCO annotation file'), which check_annotations had read whole; and the
    config dump the Runner had written made the corrected command in the same --work-dir a refusal."""
    from detection_runs import error_line
    work = ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(tmp_path / "run")]
    line = error_line(capsys, [*work, "train_dataloader.batch_size=0"])
    assert line.startswith("error: train_dataloader, val_dataloader or val_evaluator could not be built from the "
                           "config (ValueError: batch_size should be a positive integer"), line
    assert "cannot be read as a COCO annotation file" not in line
    assert not (tmp_path / "run" / os.path.basename(SAMPLE_CONFIG)).exists()
    line = error_line(capsys, [*work, "val_evaluator.metric=foo"])  # the same folder: its own error, no refusal
    assert "could not be built from the config (KeyError" in line and "but got foo" in line, line
    assert not (tmp_path / "run" / os.path.basename(SAMPLE_CONFIG)).exists()


def test_overrides_that_are_read_are_accepted_as_given(sample, tmp_path):
    """New keys their readers take (DataLoader arguments, a class's own argument, a hook's, the optim wrapper's
    builder's `constructor`, MMEngine's `_scope_` of a module, a setting of the open env_cfg) and a whole count
    written as a float pass; an explicit evaluator ann_file stays as given under --data-root instead of being
    moved into the root."""
    import shutil
    from engine.detection import load_config, parse_overrides
    cfg = load_config([SAMPLE_CONFIG], parse_overrides([
        "train_dataloader.pin_memory=False", "model.backbone.with_cp=False", "train_cfg.max_epochs=2.0",
        "default_hooks.checkpoint.max_keep_ckpts=2", "model.test_cfg.rcnn.max_per_img=5",
        "optim_wrapper.constructor=DefaultOptimWrapperConstructor", "model.neck._scope_=mmdet",
        "env_cfg.dist_cfg.timeout=1800"]))
    assert cfg.train_dataloader.pin_memory is False and cfg.model.test_cfg.rcnn.max_per_img == 5
    assert cfg.train_cfg.max_epochs == 2 and cfg.optim_wrapper.constructor == "DefaultOptimWrapperConstructor"
    assert cfg.model.neck._scope_ == "mmdet" and cfg.env_cfg.dist_cfg.timeout == 1800
    elsewhere = tmp_path / "instances_val2017.json"
    shutil.copy(os.path.join(sample, "annotations", "instances_val2017.json"), elsewhere)
    cfg = load_config([SAMPLE_CONFIG], {"test_evaluator.ann_file": str(elsewhere)}, data_root=sample)
    assert cfg.test_evaluator.ann_file == str(elsewhere)
    assert cfg.val_evaluator.ann_file == os.path.join(sample, "annotations", "instances_val2017.json")


class GroundTruthDetector(torch.nn.Module):
    """Predicts each image's ground truth (boxes, masks, labels) with score 1: a perfect detector."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.modes = []  # self.training at each test step

    def test_step(self, batch):
        from mmengine.structures import InstanceData
        self.modes.append(self.training)
        samples = batch["data_samples"]
        for sample in samples:
            gt = sample.gt_instances
            sample.pred_instances = InstanceData(
                bboxes=gt.bboxes.tensor if hasattr(gt.bboxes, "tensor") else gt.bboxes, labels=gt.labels,
                scores=torch.ones(len(gt.labels)), masks=torch.from_numpy(gt.masks.masks).bool())
        return samples


@pytest.mark.parametrize("max_images", [1, 4, None])  # 4: the whole split, asked for by count
def test_a_perfect_detector_scores_map_one_on_a_partial_set(sample, max_images):
    """--max-images scores the images it saw: the ground truth as predictions is mAP 1.0 on 1 image as on all
    (CocoMetric would otherwise count the images never fed as missed)."""
    from engine.detection import build_loader, evaluate_detector, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    model = GroundTruthDetector().train()  # scored in eval mode whatever mode it comes in
    result = evaluate_detector(model, cfg, build_loader(cfg, "test", max_images), progress=False)
    assert result["images"] == (max_images or 4)
    assert result["bbox_mAP"] == pytest.approx(1.0) and result["segm_mAP"] == pytest.approx(1.0), result
    assert model.modes and not any(model.modes)


def test_every_test_metric_of_a_list_is_scored_and_a_failed_test_step_is_raised(sample):
    """A test_evaluator list of a box and a mask metric gives both scores (the perfect detector's 1.0); a test step
    that fails (an image the model cannot take) ends the evaluation with its own error, not a score of the rest."""
    import copy
    from engine.detection import build_loader, evaluate_detector, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    cfg.test_evaluator = [dict(copy.deepcopy(cfg.test_evaluator), metric=metric) for metric in ("bbox", "segm")]
    result = evaluate_detector(GroundTruthDetector(), cfg, build_loader(cfg, "test"), progress=False)
    assert result["bbox_mAP"] == pytest.approx(1.0) and result["segm_mAP"] == pytest.approx(1.0), result

    class Failing(GroundTruthDetector):
        def test_step(self, batch):
            raise RuntimeError("an image this model cannot take")
    with pytest.raises(RuntimeError, match="an image this model cannot take"):
        evaluate_detector(Failing(), cfg, build_loader(cfg, "test"), progress=False)


class _Parts(torch.nn.Module):
    """A detector's top-level parts in plain torch: backbone -> neck -> rpn_head -> roi_head."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        self.neck = torch.nn.Linear(4, 4)
        self.rpn_head = torch.nn.Linear(4, 4)
        self.roi_head = torch.nn.Sequential(torch.nn.Linear(4, 4))

    def forward(self, x):
        return self.roi_head(self.rpn_head(self.neck(self.backbone(x))))


@pytest.mark.parametrize("scale", [{"backbone.0": 30.0, "roi_head.0": 5.0}, {"neck": 0.1, "roi_head.0": 40.0}])
def test_activation_maxima_are_the_largest_outputs_of_the_backbone_and_of_the_heads(scale):
    """The paper's Max. Act. (backbone / head), against max |output| read by plain forward hooks on every module
    under `backbone` and under neck / rpn_head / roi_head: the largest output once in the backbone, once in the
    RoI head (so neither group may borrow the other's, nor leave out the RoI head)."""
    from engine.act_max import ActivationProbe
    from engine.detection.evaluation import BACKBONE, HEADS, activation_maxima
    torch.manual_seed(0)
    model = _Parts()
    with torch.no_grad():
        for name, factor in scale.items():
            model.get_submodule(name).weight.mul_(factor)
    seen = {}
    handles = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, max(seen.get(n, 0.0),
                                                                                    float(o.abs().max()))))
               for n, m in model.named_modules() if n]
    batches = [torch.randn(3, 4) for _ in range(2)]
    with ActivationProbe(model, blocks=BACKBONE + HEADS) as probe, torch.no_grad():
        for x in batches:
            model(x)
    for h in handles:
        h.remove()
    got = activation_maxima(probe, torch.device("cpu"))
    backbone = max(v for n, v in seen.items() if n.split(".")[0] == "backbone")
    head = max(v for n, v in seen.items() if n.split(".")[0] in ("neck", "rpn_head", "roi_head"))
    assert got["backbone"] == pytest.approx(backbone) and got["head"] == pytest.approx(head)
    assert got["backbone"] != pytest.approx(got["head"])  # the two groups differ: a swap or a merge shows


def test_activation_maxima_that_are_not_finite_are_refused_naming_the_module_where_they_began():
    """An output past fp32's largest (inf) was recorded as the head's maximum inf; refused, naming the module whose
    own output overflowed (roi_head.0, not roi_head, whose output is that module's), as plain forward hooks see it."""
    from engine.act_max import ActivationProbe
    from engine.detection import DetectionError
    from engine.detection.evaluation import BACKBONE, HEADS, activation_maxima
    torch.manual_seed(0)
    model = _Parts()
    with torch.no_grad():
        model.get_submodule("roi_head.0").weight.fill_(3e38)  # finite weights, an output past 3.4e38
    seen = {}
    handles = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, bool(o.isfinite().all())))
               for n, m in model.named_modules() if n]
    with ActivationProbe(model, blocks=BACKBONE + HEADS) as probe, torch.no_grad():
        model(torch.randn(3, 4))
    for h in handles:
        h.remove()
    assert [n for n, finite in seen.items() if not finite] == ["roi_head.0", "roi_head"]  # the reference
    with pytest.raises(DetectionError, match=r"^activation maxima: the output of roi_head\.0 and 1 more is not "
                                             r"finite \(inf or NaN\)"):
        activation_maxima(probe, torch.device("cpu"))


def test_an_evaluation_whose_maxima_overflow_is_one_error_line_and_writes_nothing(sample, tmp_path, capsys):
    """The mask head's logits past fp32's largest (finite weights of 3e38): the masks (their sigmoid, 0 or 1) are
    scored, and the result was written with max_act.head Infinity, which the figure refuses as a file without that
    number ('re-evaluate it'). evaluate_detection.py refuses it naming the module; no file is written."""
    from engine.detection import load_config
    from mmdet.registry import MODELS
    from tests.conftest import run_entry
    torch.manual_seed(0)
    model = MODELS.build(load_config([SAMPLE_CONFIG]).model)
    state = model.state_dict()
    logits = "roi_head.mask_head.conv_logits.weight"
    state[logits] = state[logits].sign() * 3e38
    weights = tmp_path / "overflow.pth"
    torch.save({"state_dict": state, "meta": {"dataset_meta": {"classes": ("box", "disc")}}}, weights)
    out = tmp_path / "eval.json"
    code, _, err = run_entry("evaluate_detection.py", ["--config", SAMPLE_CONFIG, "--checkpoint", str(weights),
                                                       "--data-root", sample, "--quant", "--out", str(out)], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    # in a whole run of the tests MMEngine's logger may keep a handler on the sys.stdout of the test that made it (a
    # closed capture): logging reports each failed write as "--- Logging error ---" with a traceback of its own,
    # which a process of its own never prints; any other traceback is this command's
    own = re.sub(r"--- Logging error ---\n.*?\nArguments: [^\n]*\n", "", err, flags=re.S)
    assert code == 2 and len(lines) == 1 and "Traceback" not in own, own[-2000:]
    assert lines[0].startswith("error: activation maxima: the output of roi_head.mask_head.conv_logits and 1 more "
                               "is not finite"), lines[0]
    assert not out.exists()


def test_an_evaluator_reading_another_annotation_file_than_the_loader_is_refused(sample, tmp_path):
    """Refused before any work (the weights are not even read)."""
    import shutil
    from engine.detection import DetectionError
    from evaluate_detection import main
    elsewhere = tmp_path / "instances_val2017.json"
    shutil.copy(os.path.join(sample, "annotations", "instances_val2017.json"), elsewhere)
    with pytest.raises(DetectionError, match="test_evaluator.ann_file=.* but test_dataloader reads"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--data-root", sample, "--quant",
              "--out", str(tmp_path / "x.json"), f"test_evaluator.ann_file={elsewhere}"])
    assert not (tmp_path / "x.json").exists()


def test_training_refuses_a_val_evaluator_reading_another_annotation_file(sample, tmp_path, capsys):
    """The epoch-end validation would score the val loader's predictions against other ground truth: refused
    before the work dir is made."""
    import shutil
    elsewhere = tmp_path / "instances_val2017.json"
    shutil.copy(os.path.join(sample, "annotations", "instances_val2017.json"), elsewhere)
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(tmp_path / "w"),
                                f"val_evaluator.ann_file={elsewhere}"])
    assert f"val_evaluator.ann_file={elsewhere} but val_dataloader reads" in line, line
    assert not (tmp_path / "w").exists()


def _sample_copy(sample, tmp_path, name, content):
    """A copy of the sample data set whose annotation file `name` holds `content`."""
    import shutil
    root = tmp_path / f"copy_{len(list(tmp_path.iterdir()))}"
    shutil.copytree(sample, root)
    (root / "annotations" / name).write_text(content)
    return str(root)


def test_unreadable_inputs_are_one_error_line_naming_them(sample, tmp_path, capsys, monkeypatch):
    """The config's default data paths missing (no --data-root), a config file that is not one, a --work-dir
    that is a file, and annotation files without COCO's keys, truncated or invalid: one `error:` line each,
    naming the file, never a traceback."""
    work = ["--work-dir", str(tmp_path / "w")]
    monkeypatch.chdir(tmp_path)  # the config's data/coco/ does not exist here
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = os.path.join(root, SAMPLE_CONFIG)
    missing = error_line(capsys, ["--config", config] + work)
    assert "data/coco/annotations/instances_train2017.json, which does not exist (give --data-root" in missing
    for name, text in (("broken.py", "model = dict(\n"), ("notes.txt", "not a config\n")):
        (tmp_path / name).write_text(text)
        assert f"--config {tmp_path / name}: cannot be read" in error_line(capsys, ["--config", str(tmp_path / name)]
                                                                              + work)
    (tmp_path / "file").write_text("mine")
    assert "is a file" in error_line(capsys, ["--config", config, "--data-root", sample, "--work-dir",
                                               str(tmp_path / "file")])
    for content, message in (("{}", "cannot be read as a COCO annotation file (KeyError"),
                             ('{"images": [', "is not a JSON object"),
                             ('{"images": [}', "cannot be read as a COCO annotation file (JSONDecodeError")):
        data = _sample_copy(sample, tmp_path, "instances_train2017.json", content)
        line = error_line(capsys, ["--config", config, "--data-root", data, "--work-dir",
                                    str(tmp_path / f"w{len(content)}")])
        assert os.path.join(data, "annotations", "instances_train2017.json") in line and message in line, line
    from engine.detection import DetectionError, build_loader, load_config
    data = _sample_copy(sample, tmp_path, "instances_val2017.json", "{}")
    with pytest.raises(DetectionError, match="instances_val2017.json: cannot be read as a COCO annotation file"):
        build_loader(load_config([config], data_root=data), "test")  # evaluate_detection.py's loader


def test_resume_continues_only_the_same_run_from_its_own_checkpoint(sample, tmp_path, capsys):
    """A run records its settings; --resume with other settings (a method fragment, another lr), with load_from,
    from a last_checkpoint outside the work dir, missing or truncated, or in a folder no run of this script wrote is
    refused; the same settings with more epochs continue it."""
    import shutil
    run = tmp_path / "run"
    train(sample, run)
    settings = json.loads((run / "train_detection_config.json").read_text())
    assert settings["optim_wrapper.optimizer.lr"] == "0.001" and "work_dir" not in settings
    same = ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(run), "--resume",
            "randomness.seed=0", "train_cfg.val_interval=100"]
    for extra, message in ((["--config", "configs/detection/method/cd.py"], "custom_hooks"),
                           (["optim_wrapper.optimizer.lr=0.01"], "optim_wrapper.optimizer.lr (0.001 in the run, "
                                                                 "0.01 now)"),
                           ([f"load_from={run / 'epoch_1.pth'}"], "load_from with --resume")):
        assert message in error_line(capsys, same + ["train_cfg.max_epochs=2"] + extra)
    other = tmp_path / "other"
    train(sample, other)
    pointer = run / "last_checkpoint"
    own = pointer.read_text()
    pointer.write_text(str(other / "epoch_1.pth"))
    assert "outside the work dir" in error_line(capsys, same + ["train_cfg.max_epochs=2"])
    pointer.write_text(str(run / "epoch_9.pth"))
    assert "which does not exist" in error_line(capsys, same + ["train_cfg.max_epochs=2"])
    cut = run / "epoch_1_cut.pth"  # a copy cut off mid-write (a full disk, a killed copy): was a torch traceback
    cut.write_bytes((run / "epoch_1.pth").read_bytes()[:4096])
    pointer.write_text(str(cut))
    assert "is truncated or corrupt" in error_line(capsys, same + ["train_cfg.max_epochs=2"])
    pointer.write_text(own)
    foreign = tmp_path / "foreign"
    shutil.copytree(other, foreign)
    (foreign / "train_detection_config.json").unlink()
    assert "has no train_detection_config.json" in error_line(
        capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(foreign), "--resume"])
    from train_detection import main
    assert main(same + ["train_cfg.max_epochs=2"]) == 0
    assert (run / "epoch_2.pth").is_file()


@pytest.mark.parametrize("epochs", [2, 3])
def test_a_resume_with_no_more_epochs_than_the_run_has_trained_is_refused(sample, trained, capsys, epochs):
    """MMEngine resumes the 3-epoch run at epoch 3, trains nothing for train_cfg.max_epochs=2, or 3 (the finished
    run's own command requeued), and exits 0 without a word. Refused, the work dir left as it was."""
    work = os.path.dirname(trained)
    before = sorted(os.listdir(work))
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", work, "--resume",
                               "randomness.seed=0", "train_cfg.val_interval=100", f"train_cfg.max_epochs={epochs}"])
    assert f"train_cfg.max_epochs={epochs}, but the run in" in line, line
    assert "has already trained 3 epochs (epoch_3.pth)" in line and "larger train_cfg.max_epochs" in line, line
    assert sorted(os.listdir(work)) == before


def test_a_new_run_never_overwrites_a_file_named_as_its_config_dump(sample, tmp_path, capsys):
    work = tmp_path / "w"
    work.mkdir()
    mine = work / "mask_rcnn_swin_sample.py"
    mine.write_text("# my notes\n")
    assert "would overwrite" in error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample,
                                                     "--work-dir", str(work)])
    assert mine.read_text() == "# my notes\n"


def test_quant_none_points_to_a_bare_quant(mmdet_ready, tmp_path):
    from engine.detection import DetectionError
    from evaluate_detection import main
    with pytest.raises(DetectionError, match="a bare --quant, naming none, scores full precision only"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--quant", "none"])


def test_torchrun_without_a_launcher_is_refused(sample, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPUs: a distributed run could train
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(tmp_path / "w")])
    assert "add --launcher pytorch" in line
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("launcher, world", [("pytorch", "2"), ("slurm", "1"), ("none", "2")])
def test_distributed_training_without_a_gpu_is_refused(sample, tmp_path, capsys, monkeypatch, launcher, world):
    """MMEngine 0.10's init_dist sets a CUDA device: on a CPU machine torchrun ended in 'Found no NVIDIA driver'."""
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(tmp_path / "w"),
                               "--launcher", launcher])
    assert "no CUDA device is visible: MMEngine trains distributed on GPUs only" in line, line
    assert not (tmp_path / "w").exists()


def test_an_edited_config_is_another_evaluation(sample, trained, tmp_path):
    """The result identity holds a hash of the merged config: editing a config file between two calls that
    write one JSON is refused, as other weights are."""
    from engine.eval_results import ResultsError
    from evaluate_detection import main
    config = tmp_path / "child.py"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config.write_text(f"_base_ = {os.path.join(root, SAMPLE_CONFIG)!r}\n")
    argv = ["--config", str(config), "--checkpoint", trained, "--data-root", sample, "--quant", "--max-images", "1",
            "--out", str(tmp_path / "eval.json")]
    assert main(argv)["config_sha256"]
    config.write_text(config.read_text() + "model = dict(test_cfg=dict(rcnn=dict(max_per_img=5)))\n")
    with pytest.raises(ResultsError, match="another evaluation .*config_sha256"):
        main(argv)


@pytest.mark.parametrize("config, wrapper", [
    ("configs/detection/mask_rcnn_swin_t_1x.py", "AmpOptimWrapper"),  # the paper trains every model with AMP
    ("configs/detection/mask_rcnn_swin_t_3x.py", "AmpOptimWrapper"),
    ("configs/detection/mask_rcnn_swin_s_3x.py", "AmpOptimWrapper"),
    (SAMPLE_CONFIG, "OptimWrapper"),  # the CPU sample: MMEngine's AMP wrapper needs a GPU
])
def test_the_paper_settings_train_with_amp_and_method_fragments_keep_it(config, wrapper):
    from engine.detection import load_config
    cfg = load_config([config, "configs/detection/method/cd.py"])
    assert cfg.optim_wrapper.type == wrapper and cfg.optim_wrapper.optimizer.weight_decay == pytest.approx(0.045)


def test_a_start_that_failed_before_training_leaves_the_work_dir_to_the_corrected_command(sample, tmp_path, capsys,
                                                                                          monkeypatch):
    """The settings file was written before MMEngine's runner was built: after a start that failed there, the
    corrected command (other settings) into the same --work-dir was refused as 'a run with other settings'."""
    from mmengine.runner import Runner
    import train_detection
    work = tmp_path / "w"
    argv = ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(work), "train_cfg.max_epochs=1"]
    real = Runner.from_cfg

    def failing(cfg):
        raise ValueError("the runner could not be built")
    monkeypatch.setattr(Runner, "from_cfg", failing)
    assert "could not be built" in error_line(capsys, argv + ["optim_wrapper.optimizer.lr=0.01"])
    monkeypatch.setattr(Runner, "from_cfg", real)
    monkeypatch.setattr(Runner, "train", lambda self: None)  # built, not trained: the settings are what counts
    assert train_detection.main(argv) == 0
    settings = json.loads((work / "train_detection_config.json").read_text())
    assert settings["optim_wrapper.optimizer.lr"] == "0.001"


def test_a_resumed_run_ends_bit_for_bit_where_the_uninterrupted_one_does(sample, tmp_path):
    """MMEngine's checkpoints held no random-number state: the resumed second epoch drew other flips and RoI
    samples (110 of 115 tensors differed). With validation after each epoch, which draws random numbers after the
    checkpoint is saved, too."""
    from train_detection import main
    whole = train(sample, tmp_path / "whole", "train_cfg.val_interval=1", epochs=2)
    train(sample, tmp_path / "parts", "train_cfg.val_interval=1", epochs=1)
    assert main(["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(tmp_path / "parts"), "--resume",
                 "randomness.seed=0", "train_cfg.val_interval=1", "train_cfg.max_epochs=2"]) == 0
    expected, resumed = _state(whole), _state(tmp_path / "parts" / "epoch_2.pth")
    assert expected.keys() == resumed.keys()
    differ = [name for name in expected if not torch.equal(expected[name], resumed[name])]
    assert not differ, f"{len(differ)} of {len(expected)} tensors differ, e.g. {differ[:3]}"


def test_gplq_stage1_starts_from_the_students_own_weights(sample, tmp_path):
    """MMEngine's Runner.train() re-initialises a model that was never initialised (init_cfg: FPN xavier, heads
    normal), which a detector built for a checkpoint's weights never was: stage 1 must train the weights it is
    handed. At lr 0 one step leaves every weight as it was; a re-initialisation shows."""
    from engine.detection import load_config, train_activation_qat
    from mmdet.registry import MODELS
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    torch.manual_seed(0)
    student = MODELS.build(cfg.model)
    with torch.no_grad():  # weights unlike any initialisation's
        for p in student.parameters():
            p.copy_(torch.randn_like(p) * 0.01 + 0.5)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    settings = dict(identity={"test": 1}, batch_size_per_gpu=1, seed=0, steps=1, lr=0.0, weight_decay=0.0,
                    param_groups=[{"params": list(student.parameters())}], amp="none", ckpt_every=None, log_every=1)
    train_activation_qat(student, cfg, settings, str(tmp_path / "stage1"))
    after = student.state_dict()
    changed = [k for k, v in before.items() if v.is_floating_point() and not torch.equal(after[k].cpu(), v)]
    assert not changed, changed[:5]


def test_gplq_stage1_hands_mmengine_the_settings_it_is_given(sample, tmp_path):
    """What stage 1 trains with, read back from the checkpoints MMEngine writes: AdamW with each param group's own lr
    and the weight decay given, the seed, one epoch of the training images at `batch_size_per_gpu` a step (the
    images counted on the data set itself) and a checkpoint every `ckpt_every` iterations; values written by hand."""
    import math
    from engine.detection import load_config, train_activation_qat
    from mmdet.registry import DATASETS, MODELS
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    images = len(DATASETS.build(cfg.train_dataloader.dataset))
    model = MODELS.build(cfg.model)
    backbone = list(model.backbone.parameters())
    rest = [p for name, p in model.named_parameters() if not name.startswith("backbone.")]
    settings = dict(identity={"test": "settings"}, batch_size_per_gpu=3, seed=7, steps=None, lr=3e-4,
                    weight_decay=0.02, param_groups=[{"params": backbone, "lr": 1e-3}, {"params": rest}], amp="none",
                    ckpt_every=1, log_every=1)
    work = tmp_path / "stage1"
    result = train_activation_qat(model, cfg, settings, str(work))
    steps = math.ceil(images / 3)
    assert images > 3 and result["steps"] == steps
    assert sorted(p.name for p in work.glob("iter_*.pth")) == sorted(f"iter_{i}.pth" for i in range(1, steps + 1))
    saved = torch.load(work / f"iter_{steps}.pth", map_location="cpu", weights_only=False)
    groups = saved["optimizer"]["param_groups"]
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in groups] == [
        (1e-3, 0.02, len(backbone)), (3e-4, 0.02, len(rest))]
    assert saved["meta"]["seed"] == 7


def test_a_run_fine_tuned_from_a_checkpoint_of_this_script_trains_and_its_own_command_resumes(sample, tmp_path,
                                                                                            capsys, monkeypatch):
    """load_from=<an epoch_N.pth of this script> ended in an UnpicklingError traceback (torch >= 2.6 loads it
    weights-only; the full unpickler was allowed for --resume alone), and the run's own command with --resume was
    refused for its load_from, without it for a load_from unlike the run's: it could never be resumed."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0")  # as in a fresh process (a resume here sets it)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    base = train(sample, tmp_path / "base")
    tuned = tmp_path / "tuned"
    train(sample, tuned, f"load_from={base}")
    command = ["--config", SAMPLE_CONFIG, "--data-root", sample, "--work-dir", str(tuned), "--resume",
               "randomness.seed=0", "train_cfg.val_interval=100", "train_cfg.max_epochs=2"]
    other = train(sample, tmp_path / "other")
    assert "load_from with --resume" in error_line(capsys, command + [f"load_from={other}"])
    from train_detection import main
    assert main(command + [f"load_from={base}"]) == 0
    assert (tuned / "epoch_2.pth").is_file()


def test_a_resume_of_an_iteration_loop_run_that_trained_all_its_iterations_is_refused(tmp_path):
    """An IterBasedTrainLoop run's last checkpoint iter_4.pth of train_cfg.max_iters=4: MMEngine resumed it, trained
    nothing and exited 0 (the epoch loop's finished run is refused, above); refused alike, and one of fewer
    iterations than max_iters (iter_3.pth) resumes."""
    import json

    from engine.detection import DetectionError
    from train_detection import SETTINGS_FILE, check_resume
    settings = {"train_cfg.type": "'IterBasedTrainLoop'", "train_cfg.max_iters": "4"}
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(settings))
    for done in (3, 4):
        torch.save({"meta": {"iter": done}}, tmp_path / f"iter_{done}.pth")
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / "iter_3.pth"))
    check_resume(str(tmp_path), settings, {})
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / "iter_4.pth"))
    with pytest.raises(DetectionError, match=r"has trained all its train_cfg.max_iters=4 iterations \(iter_4.pth\), "
                                             r"so nothing is left to train"):
        check_resume(str(tmp_path), settings, {})
