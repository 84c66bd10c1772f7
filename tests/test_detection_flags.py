"""Command-line and config checks of the detection entry points that run before any model or data set is built,
so with mmcv-lite (no compiled ops): part of the default suite. The checks that build a detector are in
tests/test_detection_inputs.py (`detection` marker)."""
from __future__ import annotations

import pytest

pytest.importorskip("mmdet")

from detection_runs import SAMPLE_CONFIG, error_line  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", "mps"])
@pytest.mark.slow
def test_amp_training_without_a_gpu_is_one_error_line_before_any_work(tmp_path, capsys, monkeypatch, device):
    """The shipped Swin configs train with AmpOptimWrapper, whose constructor asserts a GPU inside runner.train(),
    after the config dump and the settings file were written: an AssertionError traceback on a CPU machine."""
    import mmengine.device
    monkeypatch.setattr(mmengine.device, "get_device", lambda: device)
    work = tmp_path / "work"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(tmp_path), "--work-dir", str(work),
                               "optim_wrapper.type=AmpOptimWrapper"])
    assert line == ("error: optim_wrapper.type=AmpOptimWrapper trains with AMP, which MMEngine runs on a GPU only, "
                    "and no GPU is visible: train on a GPU, or give optim_wrapper.type=OptimWrapper to train in "
                    "fp32 on the CPU"), line
    assert not work.exists()


def test_amp_training_on_a_gpu_and_fp32_training_on_the_cpu_pass_the_amp_check(monkeypatch):
    import mmengine.device
    from mmengine.config import Config
    import train_detection
    from mmengine.optim import AmpOptimWrapper

    class CpuAmp(AmpOptimWrapper):  # a subclass that may run on the CPU: left to its own constructor
        pass
    for device, kind in (("cuda", "AmpOptimWrapper"), ("cpu", "OptimWrapper"), ("cpu", None), ("cpu", CpuAmp)):
        monkeypatch.setattr(mmengine.device, "get_device", lambda: device)
        train_detection.check_amp(Config(dict(optim_wrapper=dict(type=kind) if kind else None)))
    with pytest.raises(ValueError, match="optim_wrapper.type=AmpOptimWrapper trains with AMP"):
        train_detection.check_amp(Config(dict(optim_wrapper=dict(type=AmpOptimWrapper))))


@pytest.mark.parametrize("counts", ["0", "-1", "True", "2.0"])
@pytest.mark.slow
def test_an_accumulation_count_that_is_no_whole_number_of_at_least_1_is_one_error_line_before_any_work(
        sample_cfg, tmp_path, capsys, counts):
    """MMEngine's OptimWrapper asserts accumulative_counts > 0 inside runner.train(), after the Runner had made its
    timestamped log folder in the work dir: an AssertionError traceback; a bool or a float it took and counted
    with. Refused before the Runner is built, on a sample it could train on: nothing in the work dir."""
    root, _ = sample_cfg
    work = tmp_path / "work"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", root, "--work-dir", str(work),
                               f"optim_wrapper.accumulative_counts={counts}"])
    assert line == (f"error: optim_wrapper.accumulative_counts={counts}: give a whole number of at least 1 (the "
                    "iterations whose gradients add up to one optimizer step; 1 steps every iteration)"), line
    assert not work.exists()


def test_accumulation_counts_of_one_wrapper_or_of_each_of_several_are_checked():
    from mmengine.config import Config
    import train_detection
    for wrapper in (None, dict(type="OptimWrapper"), dict(accumulative_counts=1), dict(accumulative_counts=4),
                    dict(generator=dict(accumulative_counts=2), discriminator=dict(type="OptimWrapper"))):
        train_detection.check_accumulation(Config(dict(optim_wrapper=wrapper)))
    with pytest.raises(ValueError, match=r"^optim_wrapper.generator.accumulative_counts=0: give a whole number"):
        train_detection.check_accumulation(Config(dict(optim_wrapper=dict(generator=dict(accumulative_counts=0)))))


@pytest.fixture(scope="module")
def sample_cfg(tmp_path_factory):
    """The sample detector's config on a written sample data set, with mmcv's compiled ops stood in under
    mmcv-lite (cd.families.import_mmdet_swin): building the detector calls none of them."""
    from cd.families import import_mmdet_swin
    from data.coco_sample import write_coco_sample
    import_mmdet_swin()
    root = str(tmp_path_factory.mktemp("coco") / "sample")
    write_coco_sample(root, train=4, val=2, size=64, seed=0)
    from engine.detection import load_config
    return root, lambda *overrides: load_config([SAMPLE_CONFIG], dict(o.split("=", 1) for o in overrides) or None,
                                                root)


def save_detector(cfg, path, **model_changes):
    """An MMEngine-style checkpoint ({"state_dict", "meta"}) of a freshly built detector of `cfg.model`
    updated by `model_changes` (backbone / head settings)."""
    import copy
    import torch
    from mmdet.registry import MODELS
    model_cfg = copy.deepcopy(cfg.model)
    for key, value in model_changes.items():
        node = model_cfg
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    torch.save({"state_dict": MODELS.build(model_cfg).state_dict(), "meta": {}}, path)
    return str(path)


@pytest.mark.slow
def test_a_load_from_that_is_missing_or_a_url_is_one_error_line_before_any_work(sample_cfg, tmp_path, capsys):
    """MMEngine read load_from inside runner.train(), after the config dump and settings file were written: a
    missing file was a FileNotFoundError traceback, and a URL was downloaded."""
    root, _ = sample_cfg
    work = tmp_path / "work"
    common = ["--config", SAMPLE_CONFIG, "--data-root", root, "--work-dir", str(work)]
    missing = tmp_path / "nowhere.pth"
    assert error_line(capsys, common + [f"load_from={missing}"]) == f"error: load_from={missing}: no such file"
    line = error_line(capsys, common + ["load_from=https://example.org/mask_rcnn.pth"])
    assert line.startswith("error: load_from=https://example.org/mask_rcnn.pth is a URL and nothing is downloaded")
    line = error_line(capsys, common + [f"load_from={tmp_path}"])
    assert line.startswith(f"error: load_from={tmp_path} is a folder"), line
    assert not work.exists()


@pytest.mark.slow
def test_a_load_from_of_another_detector_is_refused_and_one_of_other_classes_only_is_taken(sample_cfg, tmp_path):
    """MMEngine loads load_from with strict=False and only logs what it leaves: a checkpoint of another model
    trained from random weights. A detector of other backbone widths does not fit; one that differs only in the
    number of classes (a COCO detector fine-tuned on other classes) does."""
    from engine.detection import DetectionError, check_load_from
    _, load = sample_cfg
    cfg = load()
    other = save_detector(cfg, tmp_path / "wide.pth", **{"backbone.embed_dims": 32,
                                                          "neck.in_channels": [32, 64, 128, 256]})
    with pytest.raises(DetectionError, match=rf"^load_from={other} does not fit the model of --config: "
                                             r"\d+ of another shape \(e.g. backbone\."):
        check_load_from(load(f"load_from={other}"))
    classes3 = save_detector(cfg, tmp_path / "three.pth", **{"roi_head.bbox_head.num_classes": 3,
                                                             "roi_head.mask_head.num_classes": 3})
    check_load_from(load(f"load_from={classes3}"))
    same = save_detector(cfg, tmp_path / "same.pth")
    check_load_from(load(f"load_from={same}"))
    import torch
    state = torch.load(same, weights_only=False)
    del state["state_dict"]["neck.fpn_convs.0.conv.weight"]
    torch.save(state, tmp_path / "cut.pth")
    with pytest.raises(DetectionError, match=r"1 missing \(e.g. neck.fpn_convs.0.conv.weight\)"):
        check_load_from(load(f"load_from={tmp_path / 'cut.pth'}"))


@pytest.mark.slow
def test_an_annotation_file_of_no_images_is_one_error_line_naming_it(sample_cfg, tmp_path, capsys):
    """A training file whose `images` list is empty failed inside MMEngine's sampler with "need at least one array
    to concatenate", naming neither the file nor the problem."""
    import json
    import shutil
    root, _ = sample_cfg
    empty = tmp_path / "coco"
    shutil.copytree(root, empty)
    path = empty / "annotations" / "instances_train2017.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "images": [], "annotations": []}))
    work = tmp_path / "work"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(empty), "--work-dir", str(work)])
    assert line == f"error: train_dataloader reads {path}, which lists no images: give the data set's annotation file"
    assert not work.exists()


@pytest.mark.slow
def test_a_new_run_in_another_program_s_run_folder_is_refused_naming_its_files(sample_cfg, debug_config, capsys):
    """A train.py run folder (checkpoint.pt, best.pt, config.yaml, metrics.jsonl, ...) given as --work-dir was
    taken: the detector trained into it beside the classifier's files and exited 0, where train.py refuses the
    converse. Refused before any work, naming every file train.py left there, and the folder is left as it was."""
    import logging
    import os
    import train
    root, _ = sample_cfg
    cfg = debug_config("train.max_steps=1", name="classifier")
    train.main(cfg)
    logger = logging.getLogger()
    for handler in [h for h in logger.handlers if getattr(h, "_cd_run", False)]:  # its process would have ended,
        logger.removeHandler(handler)  # and train.log with it (conftest.end_run_logging)
        handler.close()
    left = sorted(os.listdir(cfg.out_dir))  # what a train.py run leaves, read from the folder (the lock is gone)

    def contents():
        return {name: os.path.isdir(os.path.join(cfg.out_dir, name)) or os.path.getsize(os.path.join(cfg.out_dir, name))
                for name in os.listdir(cfg.out_dir)}
    before = contents()
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", root, "--work-dir", cfg.out_dir])
    assert line.startswith(f"error: --work-dir {cfg.out_dir} holds files no run of this script writes "
                           f"({', '.join(left)}): "), line
    assert {"checkpoint.pt", "best.pt", "config.yaml", "metrics.jsonl"} <= set(left)
    assert contents() == before


@pytest.mark.slow
def test_a_new_run_over_an_earlier_start_of_another_config_file_is_judged_by_its_settings(
        sample_cfg, tmp_path, monkeypatch, capsys):
    """An earlier start ended (a SIGTERM) before its first checkpoint leaves its settings file, its timestamped log
    folder and its config dump, named as ITS first --config. A new run whose first --config has another name was
    refused as "holds files no run of this script writes (mask_rcnn_swin_sample.py)", though the settings were
    the same: it starts, leaving the earlier dump as it was, and one of other settings gets check_settings' error."""
    import os
    from mmengine.runner import Runner
    import train_detection
    root, _ = sample_cfg
    work = tmp_path / "work"
    dump = os.path.basename(SAMPLE_CONFIG)
    argv = ["--data-root", root, "--work-dir", str(work)]
    monkeypatch.setattr(Runner, "train", lambda runner: None)  # no step, no checkpoint: what a SIGTERM leaves
    assert train_detection.main(["--config", SAMPLE_CONFIG, *argv]) == 0
    left = sorted(os.listdir(work))
    assert len(left) == 3 and left[1:] == [dump, "train_detection_config.json"] and (work / left[0]).is_dir(), left
    earlier = (work / dump).read_bytes()
    same = tmp_path / "same_settings.py"  # the sample's settings under another file name
    same.write_text(f"_base_ = {os.path.abspath(SAMPLE_CONFIG)!r}\n")
    assert train_detection.main(["--config", str(same), *argv]) == 0
    assert (work / same.name).is_file() and (work / dump).read_bytes() == earlier
    line = error_line(capsys, ["--config", str(same), *argv, "train_cfg.max_epochs=3"])
    assert line == (f"error: --work-dir {work} holds train_detection_config.json of a run with other settings: give "
                    "a new --work-dir, or move the file away"), line


@pytest.mark.slow
def test_a_list_index_under_a_key_the_config_lacks_is_one_error_line_before_any_work(sample_cfg, tmp_path, capsys):
    """`custom_hooks.0.lam=0.01` on a config without custom_hooks (the sample without a method fragment): MMEngine's
    merge made custom_hooks a dict keyed '0', and the hooks' check failed on it with an AttributeError traceback."""
    from mmengine.config import Config
    merged = Config(dict(model=dict()))
    merged.merge_from_dict({"custom_hooks.0.lam": 0.01})
    assert merged.to_dict()["custom_hooks"] == {"0": {"lam": 0.01}}  # what MMEngine makes of it: a dict, no list
    root, load = sample_cfg
    assert "custom_hooks" not in load()
    work = tmp_path / "work"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", root, "--work-dir", str(work),
                               "custom_hooks.0.lam=0.01"])
    assert line.startswith("error: override custom_hooks.0.lam: the config has no custom_hooks, so there is no list "
                           "to index with 0") and "configs/detection/method/cd.py" in line, line
    assert not work.exists()


def test_a_gplq_stage1_folder_that_is_a_file_or_holds_a_broken_identity_is_one_error_naming_it(tmp_path):
    """`<out>_gplq_w4a4_stage1` as a file was a FileExistsError traceback (evaluate_detection.py reports
    ValueErrors only), and a cut-off gplq_stage1.json a JSONDecodeError naming no file; both are left as they were."""
    from engine.detection import DetectionError
    from engine.detection.qat import STAGE1_IDENTITY, _claim_stage1_folder
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    folder.write_text("not a folder")
    with pytest.raises(DetectionError, match=rf"^{folder} \(GPLQ's stage-1 folder, named after --out\) is a file"):
        _claim_stage1_folder(str(folder), {"bits": "w4a4"})
    assert folder.read_text() == "not a folder"
    folder.unlink()
    folder.mkdir()
    (folder / STAGE1_IDENTITY).write_text('{"bits": "w4')
    with pytest.raises(DetectionError, match=rf"^{folder / STAGE1_IDENTITY} cannot be read"):
        _claim_stage1_folder(str(folder), {"bits": "w4a4"})
    assert (folder / STAGE1_IDENTITY).read_text() == '{"bits": "w4'


def _dump_half_and_raise(data, f, **kwargs):
    """json.dump cut off mid-write (a full disk, an interrupt): half the text written, then the error."""
    import json
    text = json.dumps(data, **kwargs)
    f.write(text[:len(text) // 2])
    f.flush()
    raise OSError(28, "No space left on device")


def test_a_settings_or_identity_write_cut_off_midway_leaves_no_half_file_and_no_temporary(tmp_path, monkeypatch):
    """train_detection.py's settings file and GPLQ stage 1's identity are written through a temporary file, fsync
    and a hard link or rename (engine.run_dir.write_whole): a write that fails midway left the identity half written
    under its own name (read back as unreadable) and the settings' temporary beside it; now the folder holds
    neither, and a whole write is synced before it appears."""
    import json
    import os
    from engine import run_dir
    from engine.detection import qat
    from tests.conftest import load_script
    script = load_script("train_detection")
    synced = []
    real_sync = run_dir.sync_file
    monkeypatch.setattr(run_dir, "sync_file", lambda path: (synced.append(path), real_sync(path)))
    work, folder = tmp_path / "work", tmp_path / "eval_gplq_w4a4_stage1"
    monkeypatch.setattr(json, "dump", _dump_half_and_raise)
    with pytest.raises(OSError, match="No space left"):
        script.record_settings(str(work), {"model.type": "'MaskRCNN'"})
    assert list(work.iterdir()) == []
    with pytest.raises(OSError, match="No space left"):
        qat._claim_stage1_folder(str(folder), {"bits": "w4a4"})
    assert list(folder.iterdir()) == []
    assert synced == []
    monkeypatch.undo()
    monkeypatch.setattr(run_dir, "sync_file", lambda path: (synced.append(path), real_sync(path)))
    script.record_settings(str(work), {"model.type": "'MaskRCNN'"})
    assert [p.name for p in work.iterdir()] == [script.SETTINGS_FILE]
    assert json.loads((work / script.SETTINGS_FILE).read_text()) == {"model.type": "'MaskRCNN'"}
    assert qat._claim_stage1_folder(str(folder), {"bits": "w4a4"})[0] is None
    assert [p.name for p in folder.iterdir()] == [qat.STAGE1_IDENTITY]
    assert json.loads((folder / qat.STAGE1_IDENTITY).read_text()) == {"bits": "w4a4"}
    assert [os.path.basename(path).split(".partial-")[0] for path in synced] == [script.SETTINGS_FILE,
                                                                                 qat.STAGE1_IDENTITY]


def test_mmdetection_s_cfg_options_flag_gives_overrides_to_both_entry_points():
    """MMDetection's tools take `--cfg-options k=v ...`, which its users type from habit: it was refused as an
    unrecognized argument; the words after it are overrides, as if given bare."""
    from tests.conftest import load_script
    import evaluate_detection
    args = load_script("train_detection").parse_args(["--config", "c.py", "a=1", "--work-dir", "w", "--cfg-options",
                                                      "b=2", "c=3", "--resume"])
    assert (args.overrides, args.resume, args.work_dir) == (["a=1", "b=2", "c=3"], True, "w")
    args = evaluate_detection.parse_args(["--config", "c.py", "--checkpoint", "k.pth", "--cfg-options", "b=2",
                                          "--quant", "repq", "a=1"])
    assert (args.overrides, args.quant) == (["a=1", "b=2"], ["repq"])



def test_a_detection_override_given_twice_with_two_values_is_refused():
    """Bare words and --cfg-options' items reach the config apart (the latter after), so `--cfg-options a=1 ... a=2`
    ran with a=1 though a=2 came last: two values of one key are refused, the same value twice is one."""
    from engine.detection import DetectionError, parse_overrides
    assert parse_overrides(["train_cfg.max_epochs=2", "train_cfg.max_epochs=2"]) == {"train_cfg.max_epochs": 2}
    with pytest.raises(DetectionError, match=r"^train_cfg.max_epochs is given twice \(train_cfg.max_epochs=2 and "
                                             r"train_cfg.max_epochs=3\): give it once$"):
        parse_overrides(["train_cfg.max_epochs=2", "randomness.seed=1", "train_cfg.max_epochs=3"])

@pytest.mark.parametrize("launcher, procid, holds", [("slurm", "1", False), ("slurm", "0", True),
                                                      ("none", "1", True)])
def test_under_srun_only_slurm_rank_zero_takes_the_work_dir_lock(tmp_path, monkeypatch, launcher, procid, holds):
    """srun starts every task with SLURM_PROCID and no RANK (MMEngine's init_dist sets RANK from it inside the
    Runner, after the lock): rank 1 taking the lock would find rank 0's and refuse the job's own run. A
    --launcher none process trains alone, whatever SLURM_PROCID says, so it holds the lock itself."""
    import train_detection
    from engine.run_dir import RunDirError, lock_folder
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", procid)
    work = tmp_path / "work"
    work.mkdir()
    with lock_folder(str(work), "--work-dir"):  # the lock as another process (the job's rank 0) holds it
        if holds:
            with pytest.raises(RunDirError, match="is in use by another run"):
                with train_detection.owning_work_dir(str(work), launcher):
                    pass
        else:
            with train_detection.owning_work_dir(str(work), launcher):
                pass


@pytest.mark.parametrize("launcher, env, rank, world", [
    ("slurm", {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "1", 2),  # srun: no RANK before MMEngine's init_dist
    ("pytorch", {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, "1", 2),
    ("pytorch", {"RANK": "0", "WORLD_SIZE": "1"}, "0", 1),  # one process under a launcher: no others to tell
    ("none", {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "0", 1)])  # trains alone whatever srun says
def test_a_config_the_node_lacks_is_told_to_the_ranks_the_launcher_started(monkeypatch, capsys, launcher, env,
                                                                           rank, world):
    """A --config file this node lacks: the rank tells the others before raising (engine.distributed.
    tell_the_others_at_start), with its rank and number of ranks as its launcher gives them before MMEngine's
    init_dist sets RANK: srun's rank printed as "?" and one process under a launcher said it was telling others."""
    import engine.distributed
    import train_detection
    told = []

    def tell(error, join_and_tell, rank, world):
        told.append((rank, world))
        raise error
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train_detection, "check_launcher", lambda launcher: None)  # no GPU needed to get there
    monkeypatch.setattr(engine.distributed, "tell_the_others_at_start", tell)
    line = error_line(capsys, ["--config", "/nonexistent/detector.py", "--work-dir", "/nonexistent/work",
                               "--launcher", launcher])
    assert line == "error: --config /nonexistent/detector.py: no such file"
    assert told == [(rank, world)]


@pytest.mark.parametrize("bad", ["file", "foreign folder", "cut-off identity", "another run"])
@pytest.mark.slow
def test_a_bad_gplq_stage1_folder_is_refused_before_the_full_precision_score(sample_cfg, tmp_path, monkeypatch, bad):
    """The stage-1 folder was checked when stage 1 started, after the full-precision score (minutes on COCO); a
    folder of another run (here: other bits) that holds its checkpoints was refused only then; each is left as it
    was."""
    import engine.detection
    from evaluate_detection import main
    root, load = sample_cfg
    checkpoint = save_detector(load(), tmp_path / "w.pth")
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    if bad == "file":
        folder.write_text("not a folder")
    else:
        folder.mkdir()
        (folder / ("notes.txt" if bad == "foreign folder" else "gplq_stage1.json")).write_text(
            '{"bits": "w4a4"}' if bad == "another run" else '{"bits": "w4')
        if bad == "another run":  # its training: a folder of another run without a checkpoint is taken over
            (folder / "iter_2.pth").write_bytes(b"weights")
            (folder / "last_checkpoint").write_text(str(folder / "iter_2.pth"))
    before = sorted((p.name, p.read_bytes()) for p in ([folder] if folder.is_file() else folder.iterdir()))

    def scored(*args, **kwargs):
        raise AssertionError("scored before the stage-1 folder was checked")
    monkeypatch.setattr(engine.detection, "evaluate_detector", scored)
    with pytest.raises(engine.detection.DetectionError, match=rf"^{folder}"):
        main(["--config", SAMPLE_CONFIG, "--checkpoint", checkpoint, "--data-root", root, "--quant", "gplq",
              "--quant-options", "gplq.stage2_images=2", "--out", str(tmp_path / "eval.json"), "--device", "cpu"])
    assert sorted((p.name, p.read_bytes()) for p in ([folder] if folder.is_file() else folder.iterdir())) == before


@pytest.mark.parametrize("word, named", [
    ("test_dataloader.batch_size=2", "test_dataloader is no pipeline; "),
    ("aphg.iters=5", "aphg is no pipeline (did you mean aphq?); ")])
def test_a_config_override_inside_quant_options_names_the_word_and_where_overrides_go(tmp_path, word, named):
    """--quant-options takes every word after it: an override typed there was refused as "give PIPELINE.KEY=VALUE
    for a pipeline that runs (aphq)", which named neither the problem nor where an override goes."""
    from evaluate_detection import main
    out = tmp_path / "x.json"
    with pytest.raises(ValueError) as error:
        main(["--config", SAMPLE_CONFIG, "--checkpoint", str(tmp_path / "w.pth"), "--quant", "aphq",
              "--quant-options", "aphq.iters=5", word, "--out", str(out)])
    assert str(error.value) == (f"--quant-options {word}: {named}a config override goes after the flags as "
                                "key=value (or after --cfg-options), not inside --quant-options")
    assert not out.exists()


def test_a_gplq_stage1_folder_of_another_run_or_with_a_dangling_pointer_is_refused_and_left_as_it_is(tmp_path):
    """What the claim of a stage-1 folder refuses besides the path checks: the identity of another run whose
    checkpoints it holds, and a last_checkpoint naming a missing file; the folder's own checkpoint is what it resumes
    from."""
    import json
    from engine.detection import DetectionError
    from engine.detection.qat import STAGE1_IDENTITY, _claim_stage1_folder
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    assert _claim_stage1_folder(str(folder), {"bits": "w4a4"})[0] is None
    assert json.loads((folder / STAGE1_IDENTITY).read_text()) == {"bits": "w4a4"}
    (folder / "last_checkpoint").write_text(str(folder / "iter_2.pth"))
    with pytest.raises(DetectionError, match=r"points to .*iter_2.pth, which does not exist"):
        _claim_stage1_folder(str(folder), {"bits": "w4a4"})
    (folder / "iter_2.pth").write_bytes(b"weights")
    with pytest.raises(DetectionError, match=rf"^{folder} holds GPLQ stage 1 of another run \({{'bits': 'w4a4'}}\)"):
        _claim_stage1_folder(str(folder), {"bits": "w6a6"})
    assert _claim_stage1_folder(str(folder), {"bits": "w4a4"})[0] == str(folder / "iter_2.pth")
    assert json.loads((folder / STAGE1_IDENTITY).read_text()) == {"bits": "w4a4"}


def test_an_empty_gplq_stage1_folder_is_claimed_as_a_new_one(tmp_path):
    """An empty folder at the stage-1 path (made by hand, or by a start that stopped before writing) holds no other
    run's files: it is claimed as a new folder (the identity written, nothing to resume), not refused as a foreign
    one; a folder holding any file but the identity is refused."""
    import json
    from engine.detection import DetectionError
    from engine.detection.qat import STAGE1_IDENTITY, _claim_stage1_folder
    folder = tmp_path / "eval_gplq_w4a4_stage1"
    folder.mkdir()
    assert _claim_stage1_folder(str(folder), {"bits": "w4a4"})[0] is None
    assert json.loads((folder / STAGE1_IDENTITY).read_text()) == {"bits": "w4a4"}
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DetectionError, match=rf"^{foreign} exists and is not a GPLQ stage-1 folder"):
        _claim_stage1_folder(str(foreign), {"bits": "w4a4"})
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_gplq_stage1_on_the_cpu_is_refused_only_while_a_gpu_is_visible(monkeypatch):
    """MMEngine's runner moves the detector to any visible GPU: stage 1 on the CPU is refused then (naming the two
    ways out), and passes with no GPU visible; stage 1 on a GPU passes."""
    import torch
    from engine.detection import DetectionError
    from engine.detection.qat import check_stage1_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(DetectionError, match=r"quantize on the GPU \(--device auto\), or hide the GPUs "
                                             r"\(CUDA_VISIBLE_DEVICES=\)"):
        check_stage1_device(torch.device("cpu"))
    check_stage1_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_stage1_device(torch.device("cpu"))


def test_the_printed_scores_and_table_row_put_each_number_in_its_place():
    """What evaluate_detection.py prints: box before mask mAP, backbone before head maximum, one Table 2 column per
    pipeline and bit-width, with distinct numbers so that a swap shows."""
    from evaluate_detection import markdown_row, score
    data = {"fp": {"bbox_mAP": 0.412, "segm_mAP": 0.377}, "max_act": {"backbone": 123.456, "head": 7.891},
            "quant": {"repq": {"w4a4": {"bbox_mAP": 0.25, "segm_mAP": 0.125}},
                      "aphq": {"w4a4": {"bbox_mAP": 0.3, "segm_mAP": 0.2}, "w6a6": {"bbox_mAP": 0.4}}}}
    assert score(data["fp"]) == "box mAP 0.412 / mask mAP 0.377"
    assert score({}) == "box mAP nan / mask mAP nan"
    assert markdown_row(data).splitlines() == [
        "| Max. Act. (backbone / head) | FP | repq w4a4 | aphq w4a4 | aphq w6a6 |",
        "|---|---|---|---|---|",
        "| 123.46 / 7.89 | 0.412 / 0.377 | 0.250 / 0.125 | 0.300 / 0.200 | 0.400 / nan |"]


def test_the_calibration_batch_is_aphq_s_calibration_and_gplq_s_initialisation_images():
    """APHQ and GPLQ start from their detection recipes with --calib-images as their own count of calibration
    (APHQ) and LSQ-initialisation (GPLQ) images, which the one calibration batch holds; the other pipelines take
    no options from it. GPLQ's own default (128 initialisation images) against a batch of 4 is refused only when
    GPLQ runs, after the full-precision score."""
    from argparse import Namespace
    from configs.quant import APHQ_DETECTION, GPLQ_DETECTION
    from evaluate_detection import detection_defaults
    args = Namespace(calib_images=4, calib_seed=0)
    assert detection_defaults("aphq", args) == {**APHQ_DETECTION, "calib_images": 4}
    assert detection_defaults("gplq", args) == {**GPLQ_DETECTION, "init_images": 4}
    assert detection_defaults("repq", args) == {} == detection_defaults("percentile", args)


@pytest.mark.parametrize("change", [{"calib_seed": 1}, {"calib_images": 2}])
def test_another_calibration_batch_is_another_quantized_result(change):
    """A result of other calibration images is not the one asked for: `--calib-seed 1` after a run with the default
    seed calibrates on the images it names instead of reusing the stored numbers."""
    from argparse import Namespace
    from evaluate_detection import settings
    asked = Namespace(calib_images=1, calib_seed=0)
    assert settings(asked, "repq") != settings(Namespace(**{**vars(asked), **change}), "repq")
    assert settings(asked, "repq") == settings(Namespace(**vars(asked)), "repq")


@pytest.mark.parametrize("override, named", [
    # MMEngine writes into <out_dir>/<work dir's name>: a second run of that name wrote over the first one's
    # epoch_1.pth, whose last_checkpoint then named weights --resume refuses to read
    ("default_hooks.checkpoint.out_dir={tmp}/ckpt", "default_hooks.checkpoint.out_dir={tmp}/ckpt: the checkpoints "
                                                    "would go to {tmp}/ckpt/work, outside --work-dir {tmp}/work"),
    # MMEngine 0.10 resumes an iteration checkpoint at the start of its epoch: trained twice
    ("default_hooks.checkpoint.by_epoch=False", "default_hooks.checkpoint.by_epoch=False with an EpochBasedTrainLoop"),
])
def test_checkpoints_outside_the_work_dir_or_mid_epoch_are_refused_before_any_work(tmp_path, capsys, override, named):
    work = tmp_path / "work"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(tmp_path), "--work-dir", str(work),
                               override.format(tmp=tmp_path)])
    assert line.startswith("error: " + named.format(tmp=tmp_path)), line
    assert not work.exists()


def test_checkpoints_written_into_the_work_dir_itself_are_taken(tmp_path):
    from mmengine.config import Config
    from train_detection import check_checkpointing
    work = tmp_path / "runs" / "w"
    assert check_checkpointing(Config(dict(default_hooks=dict(checkpoint=dict(out_dir=str(tmp_path / "runs"))))),
                               str(work)) is None
    assert check_checkpointing(Config(dict(default_hooks=dict(checkpoint=dict(by_epoch=False, interval=4)),
                                           train_cfg=dict(type="IterBasedTrainLoop", max_iters=8))), str(work)) is None


@pytest.mark.parametrize("evaluator", [dict(type="CocoMetric", format_only=True, outfile_prefix="x"),
                                       [dict(type="CocoMetric"), dict(type="CocoMetric", format_only=True)]])
def test_a_test_metric_that_only_writes_predictions_is_refused(evaluator):
    """It recorded an FP entry with no mAP (nan printed), which the next call took as computed."""
    from mmengine.config import Config
    from engine.detection import DetectionError
    from evaluate_detection import check_scoring_evaluator
    with pytest.raises(DetectionError, match=r"^test_evaluator.format_only=True writes the predictions without "):
        check_scoring_evaluator(Config(dict(test_evaluator=evaluator)))
    check_scoring_evaluator(Config(dict(test_evaluator=dict(type="CocoMetric"))))
