"""How a detector's GPLQ stage 1 starts (engine/detection/qat.py): AMP on the CPU is one error before any work, in
evaluate_detection.py and in `train_activation_qat`, and a stage-1 folder whose run stopped before its first
checkpoint is taken over by a run of other settings, while one holding another run's checkpoints stays refused."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytest.importorskip("mmdet")

from detection_runs import SAMPLE_CONFIG  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_gplq_amp_on_the_cpu_is_refused_before_any_work(tmp_path, monkeypatch, device):
    """MMEngine's AmpOptimWrapper asserts a GPU in its constructor: gplq.amp=bf16 on the CPU was an AssertionError
    traceback after the full-precision score, with the stage-1 folder already claimed."""
    import engine.detection
    from evaluate_detection import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device auto: the CPU

    def loaded(*args, **kwargs):
        raise AssertionError("the config was loaded before the AMP check")
    monkeypatch.setattr(engine.detection, "load_config", loaded)
    out = tmp_path / "eval.json"
    with pytest.raises(engine.detection.DetectionError) as error:
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--quant", "gplq",
              "--quant-options", "gplq.steps=1", "gplq.amp=bf16", "--out", str(out), "--device", device])
    assert str(error.value) == ("--quant-options gplq.amp=bf16 on the CPU: MMEngine trains with AMP on a GPU only; "
                                "drop --quant-options gplq.amp (stage 1 then trains in fp32), or quantize on a GPU")
    assert list(tmp_path.iterdir()) == []  # no result file, no stage-1 folder


def test_gplq_amp_on_a_gpu_and_fp32_on_the_cpu_pass_the_amp_check():
    from engine.detection.qat import check_stage1_amp
    for amp in ("fp16", "bf16"):
        check_stage1_amp(amp, torch.device("cuda", 0))
    check_stage1_amp("none", torch.device("cpu"))


def test_train_activation_qat_refuses_amp_on_the_cpu_before_claiming_its_folder(tmp_path, monkeypatch):
    """The API path (quant/gplq/detector.py through PipelineData.train_detector) gets the same refusal, before the
    folder and its identity are written."""
    from engine.detection import DetectionError
    from engine.detection.qat import train_activation_qat
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    with pytest.raises(DetectionError, match=r"^amp=fp16 on the CPU: MMEngine trains with AMP on a GPU only; drop amp"):
        train_activation_qat(nn.Linear(2, 2), None, {"identity": {"bits": "w4a4"}, "amp": "fp16"}, str(folder))
    assert not folder.exists()


def test_a_stage1_folder_without_a_checkpoint_is_taken_over_by_a_run_of_other_settings(tmp_path):
    """A start that stopped before its first checkpoint (a refused AMP, a failed first iteration) leaves the identity
    file and MMEngine's log folder only: the rerun with corrected settings was refused as "another run" though no
    training would be lost. It takes the folder over (its identity written, the logs left); the check before the
    full-precision score leaves the folder as it is."""
    from engine.detection.qat import STAGE1_IDENTITY, _claim_stage1_folder, check_stage1_folder
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    folder.mkdir()
    (folder / STAGE1_IDENTITY).write_text(json.dumps({"bits": "w4a4", "amp": "bf16"}))
    (folder / "20250101_000000").mkdir()  # the failed start's log folder
    (folder / "20250101_000000" / "20250101_000000.log").write_text("log")
    assert check_stage1_folder(str(folder), {"bits": "w4a4", "amp": "none"}) == (None, None)
    assert json.loads((folder / STAGE1_IDENTITY).read_text()) == {"bits": "w4a4", "amp": "bf16"}  # only checked
    checkpoint, _ = _claim_stage1_folder(str(folder), {"bits": "w4a4", "amp": "none"})
    assert checkpoint is None
    assert json.loads((folder / STAGE1_IDENTITY).read_text()) == {"bits": "w4a4", "amp": "none"}
    assert (folder / "20250101_000000" / "20250101_000000.log").read_text() == "log"


def test_a_stage1_folder_holding_only_a_killed_claims_temporary_is_claimed_as_new(tmp_path):
    """A claim killed while it wrote the identity (SIGKILL, a machine gone: no handler runs) leaves only the
    identity's temporary in the folder. The rerun was refused as "not a GPLQ stage-1 folder (gplq_stage1.json is
    missing): move it away", though nothing was trained there; the temporary is no file of a run, so the folder
    counts as new: the check says so and leaves it, the claim writes the identity beside it (never deleting it:
    it may be a claim under way)."""
    from engine.detection.qat import STAGE1_IDENTITY, _claim_stage1_folder, check_stage1_folder
    from engine.run_dir import partial_path
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    folder.mkdir()
    temporary = partial_path(str(folder / STAGE1_IDENTITY))
    with open(temporary, "w") as f:
        f.write('{"bits": "w4')  # the killed claim's half identity
    assert check_stage1_folder(str(folder), {"bits": "w4a4", "amp": "none"}) == (None, None)
    assert check_stage1_folder(str(folder)) == (None, None)  # evaluate_detection.py's check before any scoring
    assert _claim_stage1_folder(str(folder), {"bits": "w4a4", "amp": "none"})[0] is None
    assert json.loads((folder / STAGE1_IDENTITY).read_text()) == {"bits": "w4a4", "amp": "none"}
    with open(temporary) as f:
        assert f.read() == '{"bits": "w4'


def test_a_claim_that_another_command_made_first_is_refused_naming_the_folder_and_a_fix_that_exists(tmp_path,
                                                                                                  monkeypatch):
    """Two commands given the same --out both find the stage-1 folder new; the later claim was refused by
    write_whole's message for a script's output, "choose another --out, or add --overwrite to replace it", and
    evaluate_detection.py has no --overwrite. The refusal names the stage-1 folder, the other command's claim, and
    fixes that exist; the other command's identity stays."""
    from engine.detection import DetectionError
    from engine.detection import qat
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    check = qat.check_stage1_folder

    def checked_then_claimed_by_another(work_dir, identity=None):
        found = check(work_dir, identity)
        folder.mkdir(exist_ok=True)
        (folder / qat.STAGE1_IDENTITY).write_text(json.dumps({"bits": "w4a4", "amp": "bf16"}))  # the other's claim
        return found

    monkeypatch.setattr(qat, "check_stage1_folder", checked_then_claimed_by_another)
    with pytest.raises(DetectionError) as refusal:
        qat._claim_stage1_folder(str(folder), {"bits": "w4a4", "amp": "none"})
    message = str(refusal.value)
    assert message.startswith(f"{folder} (GPLQ's stage-1 folder, named after --out) was claimed by another command")
    assert "--overwrite" not in message and "give another --out" in message
    assert json.loads((folder / qat.STAGE1_IDENTITY).read_text()) == {"bits": "w4a4", "amp": "bf16"}
    assert [p.name for p in folder.iterdir()] == [qat.STAGE1_IDENTITY]  # no temporary left


@pytest.mark.parametrize("written", [["iter_1.pth", "last_checkpoint"], ["iter_1.pth"]],
                         ids=["checkpoint", "checkpoint-without-pointer"])
def test_a_stage1_folder_holding_a_checkpoint_of_another_run_is_refused_and_left_as_it_is(tmp_path, written):
    """A checkpoint is trained work: a folder holding one (also one saved before MMEngine's last_checkpoint pointer
    was written) stays another run's."""
    from engine.detection import DetectionError
    from engine.detection.qat import STAGE1_IDENTITY, _claim_stage1_folder
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    folder.mkdir()
    (folder / STAGE1_IDENTITY).write_text(json.dumps({"bits": "w4a4", "amp": "bf16"}))
    for name in written:
        (folder / name).write_text(str(folder / "iter_1.pth") if name == "last_checkpoint" else "weights")
    before = sorted((p.name, p.read_bytes()) for p in folder.iterdir())
    with pytest.raises(DetectionError, match=rf"^{folder} holds GPLQ stage 1 of another run"):
        _claim_stage1_folder(str(folder), {"bits": "w4a4", "amp": "none"})
    assert sorted((p.name, p.read_bytes()) for p in folder.iterdir()) == before


def test_a_detector_stage1_identity_holds_the_lr_used_and_a_folder_of_a_null_lr_resumes_under_that_lr(tmp_path,
                                                                                                      monkeypatch):
    """The identity of a detector's stage-1 folder holds the lr and scale_lr used (the paper's lr of a global batch of
    one image, 1e-6, written out here), not null: the lr typed out resumes a folder written with null before (it was
    refused as another run's), another lr is refused, and so is the null-lr folder once the default changes (it
    resumed at the new lr)."""
    import dataclasses
    import quant.gplq.pipeline as gplq
    from configs.quant import GPLQ_DETECTION, GPLQOptions
    from engine.detection import DetectionError
    from engine.detection.qat import STAGE1_IDENTITY, check_stage1_folder
    from quant.gplq.detector import stage1_identity
    from quant.pipeline_data import PipelineData
    from quant.spec import parse_bits
    from quant_models import tiny_vit

    model, bits = tiny_vit(depth=1), parse_bits("w4a4")

    def identity(**given):
        return stage1_identity(model, bits, dataclasses.replace(GPLQOptions(), **{**GPLQ_DETECTION, **given}), None,
                               PipelineData())

    now = identity()
    assert (now["options"]["lr"], now["options"]["scale_lr"]) == (1e-6, 1e-6) and identity(lr=1e-6) == now
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    folder.mkdir()
    older = {**now, "options": {**now["options"], "lr": None, "scale_lr": None}}  # the identity file until now
    (folder / STAGE1_IDENTITY).write_text(json.dumps(older))
    for name in ("iter_1.pth", "last_checkpoint"):
        (folder / name).write_text(str(folder / "iter_1.pth") if name == "last_checkpoint" else "weights")
    for asked in (now, identity(lr=1e-6), identity(lr=1e-6, scale_lr=1e-6)):
        assert check_stage1_folder(str(folder), asked) == (older, str(folder / "iter_1.pth"))
    with pytest.raises(DetectionError, match=rf"^{folder} holds GPLQ stage 1 of another run"):
        check_stage1_folder(str(folder), identity(lr=2e-6))
    monkeypatch.setattr(gplq, "default_lr", lambda batch: 7e-6)  # a later default
    with pytest.raises(DetectionError, match=rf"^{folder} holds GPLQ stage 1 of another run"):
        check_stage1_folder(str(folder), identity())


def test_a_stage1_folder_of_other_training_data_is_refused_and_one_written_before_the_data_was_recorded_resumes(
        tmp_path):
    """The identity holds the training data (evaluate_detection.py: the training annotations' SHA-256): a folder of
    other annotations is refused; one whose identity file was written before it held the data resumes, as a result
    entry without its train_annotations_sha256 does (refusing it would refuse every such folder)."""
    from engine.detection import DetectionError
    from engine.detection.qat import STAGE1_IDENTITY, check_stage1_folder
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    folder.mkdir()
    (folder / "iter_1.pth").write_text("weights")
    (folder / "last_checkpoint").write_text(str(folder / "iter_1.pth"))
    asked = {"bits": "w4a4", "data": {"train_annotations_sha256": "ab"}, "options": {"lr": 1e-6, "scale_lr": 1e-6}}
    (folder / STAGE1_IDENTITY).write_text(json.dumps({**asked, "data": {"train_annotations_sha256": "cd"}}))
    with pytest.raises(DetectionError, match=rf"^{folder} holds GPLQ stage 1 of another run"):
        check_stage1_folder(str(folder), asked)
    before = {key: value for key, value in asked.items() if key != "data"}
    (folder / STAGE1_IDENTITY).write_text(json.dumps(before))
    assert check_stage1_folder(str(folder), asked) == (before, str(folder / "iter_1.pth"))
