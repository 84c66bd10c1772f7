"""No silent wrong result: weights evaluated only as they are, class folders that cannot shift labels,
fingerprints of values only, and files that survive concurrent writers, user files and failed starts."""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import evaluate
import train
from configs import ConfigError, config_to_dict, load_config
from data import DataError, build_loaders
from engine.checkpoint import weights_fingerprint
from engine.eval_results import EvalResults, ResultsError
from engine.run_dir import partial_path, save_config_history
from models import ModelError, build_model
from models.hub import check_hub_weights_fit
from tests.conftest import DEBUG_CONFIG, ROOT, run_entry


def cli(*argv):
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return run.returncode, run.stderr.strip().splitlines()


# -- evaluation scores the weights it was given, as they are ------------------------------------------------

def test_weights_whose_classifier_does_not_fit_are_refused_not_given_a_random_head(tmp_path, capsys):
    """evaluate.py's __main__ runs in this process (run_entry); a refusal by its real process (exit status and
    stderr): test_evaluate.py::test_bad_inputs_are_clear_errors."""
    cfg = load_config([DEBUG_CONFIG], ["model.num_classes=10"])
    weights = str(tmp_path / "ten_classes.pth")
    torch.save(build_model(cfg.model).state_dict(), weights)
    out = tmp_path / "r.json"
    code, _, err = run_entry("evaluate.py", ["--config", DEBUG_CONFIG, f"model.pretrained={weights}", "--quant",
                                             "--out", str(out)], capsys)  # the debug config: model.num_classes=4
    lines = err.strip().splitlines()
    assert code == 1 and lines[-1].startswith("error: ") and not any("Traceback" in x for x in lines), lines
    assert weights in lines[-1]
    assert "has 10 outputs, model.num_classes=4: set model.num_classes=10" in lines[-1]
    assert not out.exists()
    # a fine-tuning config's model.pretrained_strict=false changes nothing for evaluation (given on the command
    # line it is refused: test_evaluate_refuses_model_pretrained_strict_false_which_it_never_applies)
    finetune = tmp_path / "finetune.yaml"
    finetune.write_text("model:\n  pretrained_strict: false\n")
    with pytest.raises(ModelError, match="has 10 outputs"):
        evaluate.main(evaluate.parse_args(["--config", DEBUG_CONFIG, "--config", str(finetune),
                                           f"model.pretrained={weights}", "--quant", "--out", str(out)]))


def test_hub_weights_without_a_fitting_classifier_are_refused():
    """Before anything is fetched (tests/test_hub_weights_strict.py loads a hub cache of this machine's)."""
    cfg = load_config([DEBUG_CONFIG], ["model.name=vit_tiny_patch16_224", "model.pretrained=hub"])
    with pytest.raises(ModelError, match=r"its classifier 'head.weight' has 1000 outputs, model.num_classes=4: set "
                                         r"model.num_classes=1000 to use it as it is"):
        check_hub_weights_fit(cfg.model, "vit_tiny_patch16_224")
    check_hub_weights_fit(load_config([DEBUG_CONFIG], ["model.name=vit_tiny_patch16_224", "model.pretrained=hub",
                                                       "model.num_classes=1000"]).model, "vit_tiny_patch16_224")


# -- the class set of a folder data set --------------------------------------------------------------------

def make_folder(root, files):
    """files: paths relative to root; '.png' ones become small images, names ending in '/' empty folders."""
    rng = np.random.default_rng(0)
    for rel in files:
        path = os.path.join(root, rel)
        os.makedirs(path if rel.endswith("/") else os.path.dirname(path), exist_ok=True)
        if rel.endswith(".png"):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(path)


def loaders(root, num_classes=2):
    cfg = load_config([DEBUG_CONFIG], ["data.dataset=folder", f"data.root={root}",
                                       f"model.num_classes={num_classes}", "data.auto_augment="])
    return build_loaders(cfg.data, img_size=32, batch_size_per_gpu=2, eval_batch_size_per_gpu=2, rank=0,
                         world_size=1, seed=0, num_classes=num_classes)


def two_classes(split):
    return [f"{split}/{c}/{i}.png" for c in ("a", "b") for i in range(4)]


@pytest.mark.parametrize("extra, message", [
    (["train/c/"], r"class folder\(s\) c hold no images"),  # an empty class folder: classes a, b
    (["train/c/notes.txt"], r"class folder\(s\) c hold no images"),
    (["train/stray.png"], r"1 image\(s\) outside a class folder, e.g. stray.png"),  # class '' first: a -> 1
    (["train/a/more/x.png"], r"outside a class folder, e.g. a/more/x.png"),  # a class 'more'
    (["train/.cache/x.png"], r"outside a class folder, e.g. .cache/x.png"),
])
def test_files_that_would_change_the_class_set_are_refused(tmp_path, extra, message):
    make_folder(tmp_path, two_classes("train") + two_classes("val") + extra)
    with pytest.raises(DataError, match=message):
        loaders(tmp_path)


def test_harmless_extras_are_accepted(tmp_path):
    make_folder(tmp_path, two_classes("train") + two_classes("val")
                + ["train/README.txt", "train/.ipynb_checkpoints/", "train/a/labels.csv"])
    assert loaders(tmp_path).classes == ["a", "b"]


@pytest.mark.parametrize("tars", [(), ("train", "val"), ("val",)])
def test_the_num_classes_advice_is_the_same_from_either_split(tmp_path, tars):
    """A folder or a .tar per split (`tars`, packed as `tar cf val.tar -C val .` would): with .tar splits each
    split's class count was advised in turn (train 2, val 3), neither fitting both."""
    make_folder(tmp_path, two_classes("train") + two_classes("val") + ["val/c/0.png"])
    for split in tars:
        with tarfile.open(tmp_path / f"{split}.tar", "w") as tar:
            for name in sorted(os.listdir(tmp_path / split)):
                tar.add(tmp_path / split / name, arcname=name)
        shutil.rmtree(tmp_path / split)
    for num_classes in (2, 3):  # the train split (2 classes) or the val split (3) disagrees first
        with pytest.raises(DataError, match=r"different class folders \(val has classes train lacks: "
                                            r"\['c'\]"):
            loaders(tmp_path, num_classes)


# -- fingerprints of values ----------------------------------------------------------------------------------

def test_the_fingerprint_depends_on_the_values_only():
    torch.manual_seed(0)
    # magnitudes over 16 decades: a float sum of these depends on the order of its terms
    weights = {"w": torch.randn(384, 1536) * torch.logspace(-8, 8, 1536), "b": torch.zeros(1536),
               "index": torch.arange(4)}
    reference = weights_fingerprint(weights)
    column_major = {**weights, "w": weights["w"].t().contiguous().t()}  # another summation order
    assert not column_major["w"].is_contiguous()
    as_float64 = {k: v.double() if v.is_floating_point() else v for k, v in weights.items()}
    negative_zero = {**weights, "b": -weights["b"]}
    for same in (column_major, as_float64, negative_zero, {k: v.clone() for k, v in weights.items()}):
        assert weights_fingerprint(same) == reference
    changed = weights["w"].clone()
    changed[7, 7] = torch.nextafter(changed[7, 7], torch.tensor(float("inf")))  # one ulp of one weight
    assert weights_fingerprint({**weights, "w": changed}) != reference
    assert weights_fingerprint({"v": weights["w"], "b": weights["b"]}) != reference  # names count
    # float64 weights that float32 cannot hold are other weights than their float32 rounding
    third = torch.tensor([1 / 3], dtype=torch.float64)
    assert weights_fingerprint({"w": third}) != weights_fingerprint({"w": third.float()})


# -- files: concurrent writers, user files, config history, failed starts ---------------------------------

def test_two_writers_of_one_result_file_both_keep_their_results(tmp_path):
    path = str(tmp_path / "r.json")
    identity = {"model": "m", "fingerprint": "f"}
    first, second = EvalResults.open(path, identity), EvalResults.open(path, identity)  # both before a write
    first.update(fp={"top1": 50.0})
    second.update(fp={"top1": 50.0})
    first.add("percentile", "w4a4", {"top1": 40.0}, {"options": 1})
    second.add("repq", "w4a4", {"top1": 45.0}, {"options": 2})
    first.save()
    second.save()
    second.add("repq", "w8a8", {"top1": 49.0}, {"options": 2})
    first.add("repq", "w8a8", {"top1": 48.0}, {"options": 2})  # the same result, computed twice
    second.save()
    first.save()
    saved = json.load(open(path))
    assert {p: sorted(b) for p, b in saved["quant"].items()} == {"percentile": ["w4a4"],
                                                                 "repq": ["w4a4", "w8a8"]}
    assert saved["quant"]["repq"]["w8a8"]["top1"] == 48.0  # the last one written; the other kept in history
    assert [(h["pipeline"], h["bits"], h["top1"]) for h in saved["history"]] == [("repq", "w8a8", 49.0)]



def test_after_a_save_a_writer_plans_with_what_the_other_writers_saved(tmp_path):
    """save() leaves the object holding the file as written, other processes' results included: a later plan()
    skips a result another evaluate.py saved meanwhile with the same settings instead of computing it again."""
    path = str(tmp_path / "r.json")
    identity = {"model": "m", "fingerprint": "f"}
    first, second = EvalResults.open(path, identity), EvalResults.open(path, identity)
    first.add("percentile", "w4a4", {"top1": 40.0}, {"options": 1})
    first.save()
    second.add("repq", "w4a4", {"top1": 45.0}, {"options": 2})
    second.save()
    assert sorted(second.data["quant"]) == ["percentile", "repq"]
    assert second.plan("percentile", "w4a4", {"options": 1}, recompute=False) is False

def test_a_recomputed_entry_is_kept_in_history_once_however_often_the_file_is_saved(tmp_path):
    """evaluate.py --recompute saves after every pipeline: the replaced entry is history once, not once per save."""
    path = str(tmp_path / "r.json")
    identity = {"model": "m", "fingerprint": "f"}
    results = EvalResults.open(path, identity)
    results.add("repq", "w4a4", {"top1": 40.0}, {"options": 1})
    results.save()
    again = EvalResults.open(path, identity)
    assert again.plan("repq", "w4a4", {"options": 1}, recompute=True)
    again.add("repq", "w4a4", {"top1": 41.0}, {"options": 1})
    again.save()
    for bits in ("w6a6", "w8a8"):  # the rest of the --recompute run, one save each
        again.add("repq", bits, {"top1": 50.0}, {"options": 1})
        again.save()
    saved = json.load(open(path))
    assert saved["quant"]["repq"]["w4a4"]["top1"] == 41.0
    assert [(h["pipeline"], h["bits"], h["top1"]) for h in saved["history"]] == [("repq", "w4a4", 40.0)]


def test_results_of_another_eval_transform_or_model_kwargs_are_not_merged(checkpoint, tmp_path):
    out = str(tmp_path / "r.json")
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", out]))
    with pytest.raises(ResultsError, match=r"another evaluation \(data: .*'crop_pct': 1.0.*'crop_pct': 0.9"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", out,
                                           "data.crop_pct=0.9"]))
    # the same weights (they load), another output: average pooling instead of the class token
    with pytest.raises(ResultsError, match=r"another evaluation \(model_kwargs: \{\} in the file, "
                                           r"\{'fc_norm': False, 'global_pool': 'avg'\} now"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", out,
                                           "model.kwargs.global_pool=avg", "model.kwargs.fc_norm=false"]))


@pytest.mark.slow
def test_two_evaluate_processes_writing_one_file_at_once_both_keep_their_results(checkpoint, tmp_path):
    out = str(tmp_path / "r.json")
    runs = [subprocess.Popen([sys.executable, "evaluate.py", "--checkpoint", checkpoint,
                              "--quant", name, "--bits", "w8a8", "--out", out], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
            for name in ("percentile", "repq")]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
    assert set(json.load(open(out))["quant"]) == {"percentile", "repq"}


def test_only_this_programs_own_partial_files_are_removed(debug_config):
    cfg = debug_config("train.max_steps=1", name="p")
    train.main(cfg)
    mine = ["results.tmp.txt", "notes.tmp.1", "checkpoint.pt.tmp.old"]
    for name in mine:
        with open(os.path.join(cfg.out_dir, name), "w") as f:
            f.write("the user's")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = os.path.basename(partial_path("/x/ckpt.pt")).split("-")[1]  # this machine's
        live = os.path.join(cfg.out_dir, f"eval_best.json.partial-{host}-{sleeper.pid}-0123abcd")  # being written
        dead = os.path.join(cfg.out_dir, f"checkpoint.pt.partial-{host}-4194999-89abcdef")  # > any pid_max
        dead_unnamed_host = os.path.join(cfg.out_dir, "checkpoint.pt.partial-4194999-89abcdee")  # earlier names
        # another machine's pid says nothing here: its writer may be alive (an evaluate.py on another node)
        other_machine = os.path.join(cfg.out_dir, "eval_best.json.partial-00000000-4194999-0123abcd")
        for path in (live, dead, dead_unnamed_host, other_machine):
            open(path, "w").close()
        train.main(debug_config("train.max_steps=2", name="p"))
        assert os.path.exists(live) and os.path.exists(other_machine)
        assert not os.path.exists(dead) and not os.path.exists(dead_unnamed_host)
    finally:
        sleeper.kill()
    for name in mine:
        assert open(os.path.join(cfg.out_dir, name)).read() == "the user's"
    assert re.fullmatch(rf"ckpt\.pt\.partial-[0-9a-f]{{8}}-{os.getpid()}-[0-9a-f]{{8}}",
                        os.path.basename(partial_path("/x/ckpt.pt")))


def test_a_second_config_change_at_the_same_step_keeps_both_earlier_configs(debug_config, tmp_path):
    out = str(tmp_path / "c")
    os.makedirs(out)
    configs = [config_to_dict(debug_config(f"optim.lr={lr}")) for lr in (0.1, 0.2, 0.3)]
    for config in configs:
        save_config_history(out, config, step=3)
    import yaml

    kept = sorted(n for n in os.listdir(out) if n.startswith("config."))
    assert kept == ["config.until_step3.2.yaml", "config.until_step3.yaml", "config.yaml"]
    lrs = [yaml.safe_load(open(os.path.join(out, n)))["optim"]["lr"] for n in
           ("config.until_step3.yaml", "config.until_step3.2.yaml", "config.yaml")]
    assert lrs == [0.1, 0.2, 0.3]


@pytest.mark.slow
@pytest.mark.parametrize("typo", ["model.name=vit_nanoo", "data.dataset=folder", "empty_classes"],
                         ids=["model_name", "data_root", "empty_class_folders"])
def test_a_failed_start_does_not_block_the_corrected_command(tmp_path, typo):
    """The failed start is a process of its own, which ends as a real one does (its lock dropped by the
    kernel); the corrected command runs in this process (train.main: a second process would import torch
    again, seconds). A model name the build refuses, or a data.root that is not there, is refused before out_dir is
    made (train.check_model_builds, data/loader.py check_data_files); class folders found empty only once the folder
    is held (the images are read then) leave its train.log, which the corrected start archives."""
    out = str(tmp_path / "run")
    extra = ["data.root=/nonexistent/datasets"] if typo.startswith("data") else []
    if typo == "empty_classes":  # the 4 class folders the debug config's model.num_classes asks for, without images
        for split in ("train", "val"):
            for name in "abcd":
                os.makedirs(tmp_path / "ds" / split / name)
        typo, extra = "data.dataset=folder", [f"data.root={tmp_path / 'ds'}"]
    code, lines = cli("train.py", "--config", DEBUG_CONFIG, f"out_dir={out}", typo, *extra)
    assert code == 1 and lines[-1].startswith("error: "), lines[-3:]
    refused_early = "/nonexistent/" in " ".join(extra) or typo.startswith("model")
    assert not os.path.exists(out) if refused_early else "train.log" in os.listdir(out)
    assert train.main(train.parse_args(["--config", DEBUG_CONFIG, f"out_dir={out}",
                                        "train.max_steps=1"])).state.step == 1
    if refused_early:
        assert "archive" not in os.listdir(out)
    else:
        archived = os.listdir(os.path.join(out, "archive"))
        assert len(archived) == 1 and os.listdir(os.path.join(out, "archive", archived[0])) == ["train.log"]


def test_the_num_classes_advice_of_evaluate_never_contradicts_the_weights(tmp_path):
    # weights of 4 classes (they load with the debug config's model.num_classes=4), 10 in the digits set:
    # "set model.num_classes=10" would only make the weights not fit
    weights = str(tmp_path / "four.pth")
    torch.save(build_model(load_config([DEBUG_CONFIG]).model).state_dict(), weights)
    with pytest.raises(DataError, match=r"digits val split has 10 classes, .*four.pth was trained on 4: "
                                        r"point data.root at the data set"):
        evaluate.main(evaluate.parse_args(["--config", DEBUG_CONFIG, f"model.pretrained={weights}",
                                           "data.dataset=digits", "--quant", "--out",
                                           str(tmp_path / "r.json")]))


@pytest.mark.parametrize("pipelines", [["gplq"], ["repq"]])
def test_an_evaluation_whose_train_split_names_other_classes_is_refused_before_any_pass(tmp_path, pipelines):
    """GPLQ trains on the train split's labels: with train/ holding b, c where the checkpoint's val/ holds a, b,
    label 0 meant another class there, and the run finished with a score; any pipeline drawing from the split
    is refused now, as train.py refuses such a folder."""
    make_folder(tmp_path / "data", two_classes("val") + [f"train/{c}/{i}.png" for c in ("b", "c") for i in range(4)])
    weights = str(tmp_path / "two.pth")
    torch.save(build_model(load_config([DEBUG_CONFIG], ["model.num_classes=2"]).model).state_dict(), weights)
    out = tmp_path / "r.json"
    with pytest.raises(DataError, match=r"the train and val splits have different class folders \(val lacks "
                                        r"\['c'\]; val has classes train lacks: \['a'\]\)"):
        evaluate.main(evaluate.parse_args(["--config", DEBUG_CONFIG, f"model.pretrained={weights}",
                                           "model.num_classes=2", "data.dataset=folder",
                                           f"data.root={tmp_path / 'data'}",
                                           # the augmentation only where a pipeline sees training images
                                           *(["data.auto_augment="] if "gplq" in pipelines else []),
                                           *(["quant.calib_images=4"] if "repq" in pipelines else []),  # GPLQ: own
                                           "--quant", *pipelines, "--out", str(out)]))
    assert not out.exists()


def test_a_train_py_checkpoint_given_as_model_pretrained_to_evaluate_is_refused(checkpoint, tmp_path):
    """As a weights file, a train.py checkpoint was scored without its recorded settings: on val classes in
    another order, or as plain softmax attention when it was trained with softmax1 (which has no parameters
    to tell it by); --checkpoint checks both. Plain weights files, .pth or .safetensors, are still weights."""
    from safetensors.torch import save_file

    from engine.checkpoint import is_run_checkpoint

    out = tmp_path / "r.json"
    with pytest.raises(ConfigError, match=rf"model.pretrained={re.escape(checkpoint)} is a checkpoint of train.py: "
                                          rf"give it as --checkpoint"):
        evaluate.main(evaluate.parse_args(["--config", DEBUG_CONFIG, "model.name=vit_nano", "model.num_classes=10",
                                           "data.dataset=digits", f"model.pretrained={checkpoint}", "--quant",
                                           "--out", str(out)]))
    assert not out.exists()
    state = torch.load(checkpoint, weights_only=True)["model"]
    torch.save(state, tmp_path / "w.pth")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    torch.save(state, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)  # not memory-mappable
    assert is_run_checkpoint(checkpoint)
    assert not any(is_run_checkpoint(str(tmp_path / n)) for n in ("w.pth", "w.safetensors", "legacy.pth"))


def test_evaluate_refuses_model_pretrained_strict_false_which_it_never_applies(tmp_path):
    """evaluate.py loads weights as they are; model.pretrained_strict=false was accepted and ignored, and the
    refusal of a classifier of another size then advised the very setting given."""
    weights = str(tmp_path / "four.pth")
    torch.save(build_model(load_config([DEBUG_CONFIG]).model).state_dict(), weights)
    with pytest.raises(ConfigError, match=r"model.pretrained_strict=false: evaluate.py loads weights only as they "
                                          r"are"):
        evaluate.main(evaluate.parse_args(["--config", DEBUG_CONFIG, f"model.pretrained={weights}",
                                           "model.pretrained_strict=false", "--quant",
                                           "--out", str(tmp_path / "r.json")]))
