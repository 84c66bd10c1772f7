"""The weights a run started from (engine/start_weights.py): train.py records them in checkpoint.pt and best.pt,
evaluate.py in the recipe it writes, so that runs fine-tuned from other weights, or one trained from scratch, are
no seeds of one experiment for the readers that average seeds (engine/eval_results.recipe_difference)."""
import pytest
import torch

import evaluate
import train
from configs import ConfigError, load_config
from configs.schema import ModelConfig
from engine.checkpoint import weights_fingerprint
from engine.eval_results import recipe_difference
from engine.start_weights import START_WEIGHTS, check_start_file, classifier_keys, recipe_entries, start_record
from models import build_model
from tests.conftest import DEBUG_CONFIG


def weights_file(path, seed: int) -> str:
    """A vit_nano's raw state dict (4 classes, the tiny config's), of seed `seed`; its fingerprint less the
    classifier, computed from the file's own tensors: the reference for the record."""
    torch.manual_seed(seed)
    model = build_model(load_config([DEBUG_CONFIG], []).model)
    torch.save(model.state_dict(), path)
    state = torch.load(path)
    return weights_fingerprint({k: v for k, v in state.items() if not k.startswith("head.")})


@pytest.mark.slow
def test_runs_from_other_start_weights_or_from_scratch_are_no_seeds_of_one_recipe(tmp_path):
    file_a, file_b = tmp_path / "a.pth", tmp_path / "b.pth"
    fingerprint_a, fingerprint_b = weights_file(file_a, 1), weights_file(file_b, 2)
    # a new classifier (here: of 6 classes, the file's has 4) is drawn with train.seed: each seed's is another,
    # and the runs of one file are seeds of one recipe all the same
    runs = {"a_s0": (file_a, 0), "a_s1": (file_a, 1), "b_s2": (file_b, 2), "scratch_s3": ("", 3)}
    results = {}
    for name, (weights, seed) in runs.items():
        out = tmp_path / name
        train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", f"model.pretrained={weights}", f"train.seed={seed}",
                                                "model.num_classes=6", "train.max_steps=1", "log.tensorboard=false"]))
        for kept in ("best.pt", "checkpoint.pt"):
            assert torch.load(out / kept, weights_only=False)["start_weights"] == (
                {"pretrained": "file", "fingerprint": {file_a: fingerprint_a, file_b: fingerprint_b}[weights],
                 "classifier": None} if weights else {"pretrained": None, "fingerprint": None})
        results[name] = evaluate.main(evaluate.parse_args(["--checkpoint", str(out / "best.pt"), "--quant"]))
    assert recipe_difference([(n, results[n]) for n in ("a_s0", "a_s1")]) is None
    other_file = recipe_difference([(n, results[n]) for n in ("a_s0", "a_s1", "b_s2")])
    assert other_file[1] == "b_s2" and "start.fingerprint" in other_file[2] and fingerprint_b in other_file[2]
    scratch = recipe_difference([(n, results[n]) for n in ("a_s0", "scratch_s3")])
    assert scratch[1] == "scratch_s3" and "start.pretrained 'file' -> None" in scratch[2]
    # a resumed run takes its weights from its checkpoint, and its start's record with them
    out = tmp_path / "a_s0"
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", f"model.pretrained={file_a}", "train.seed=0",
                                            "model.num_classes=6", "train.max_steps=2", "log.tensorboard=false"]))
    assert torch.load(out / "checkpoint.pt", weights_only=False)["state"]["step"] == 2
    assert torch.load(out / "checkpoint.pt", weights_only=False)["start_weights"]["fingerprint"] == fingerprint_a


def test_a_checkpoint_without_the_record_is_not_compared_on_it(tmp_path):
    """A checkpoint written before the record: its result's recipe has no start keys, and is compared on the
    settings it does record (as any setting an older result could not record)."""
    weights_file(tmp_path / "a.pth", 1)
    out = tmp_path / "run"
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", f"model.pretrained={tmp_path / 'a.pth'}",
                                            "model.num_classes=6", "train.max_steps=1", "log.tensorboard=false"]))
    payload = torch.load(out / "best.pt", weights_only=False)
    del payload["start_weights"]
    torch.save(payload, tmp_path / "old.pt")
    old = evaluate.main(evaluate.parse_args(["--checkpoint", str(tmp_path / "old.pt"), "--quant"]))
    new = evaluate.main(evaluate.parse_args(["--checkpoint", str(out / "best.pt"), "--quant"]))
    assert not any(key.startswith("start.") for key in old["recipe"]) and new["recipe"]["start.pretrained"] == "file"
    assert recipe_difference([("old", old), ("new", new)]) is None


DISTILLED = ["model.name=deit_tiny_distilled_patch16_224", "model.img_size=32", "model.kwargs.patch_size=8",
             "model.kwargs.depth=2", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"]


def test_a_distilled_deit_s_two_heads_are_its_classifier_and_its_seeds_share_a_start(tmp_path):
    """timm's distilled DeiT has two classifiers, `get_classifier` gives them as a tuple (head, head_dist): both are
    drawn anew for other classes, so both are left out of the start's fingerprint; seeds of one file share it."""
    torch.manual_seed(1)
    model = build_model(load_config([DEBUG_CONFIG], DISTILLED).model)
    heads = model.get_classifier()
    assert isinstance(heads, tuple) and len(heads) == 2
    own = {module: name for name, module in model.named_modules()}
    reference = {f"{own[head]}.{key}" for head in heads for key in head.state_dict()}
    assert classifier_keys(model) == reference == {"head.weight", "head.bias", "head_dist.weight",
                                                         "head_dist.bias"}
    torch.save(model.state_dict(), tmp_path / "deit.pth")
    state = torch.load(tmp_path / "deit.pth")
    fingerprint = weights_fingerprint({k: v for k, v in state.items() if not k.startswith(("head.", "head_dist."))})
    for seed in (0, 1):  # 6 classes, the file's 4: both heads are new, drawn with train.seed
        out = tmp_path / f"s{seed}"
        train.main(load_config([DEBUG_CONFIG], DISTILLED + [
            f"out_dir={out}", f"model.pretrained={tmp_path / 'deit.pth'}", f"train.seed={seed}", "model.num_classes=6",
            "train.max_steps=1", "log.tensorboard=false"]))
        assert torch.load(out / "best.pt", weights_only=False)["start_weights"] == {
            "pretrained": "file", "fingerprint": fingerprint, "classifier": None}


def test_files_that_differ_in_a_classifier_the_run_keeps_are_other_starts_and_a_new_one_is_left_out(tmp_path):
    """Two files of one backbone and other classifiers: where the classifier fits model.num_classes it is loaded and
    is part of the start (the runs are no seeds of one recipe, and a file whose classifier was replaced since is no
    longer the runs' start); where it is drawn anew (other classes), it is no part of it. The backbone's fingerprint
    is the one recorded before the classifier was: such older records stay comparable."""
    torch.manual_seed(0)
    state = build_model(ModelConfig(name="vit_nano", num_classes=4, drop_path=0.0)).state_dict()
    paths = [tmp_path / "a.pth", tmp_path / "b.pth"]
    torch.save(state, paths[0])
    torch.save({k: torch.randn_like(v) if k.startswith("head.") else v for k, v in state.items()}, paths[1])
    files = [torch.load(path) for path in paths]
    backbone = weights_fingerprint({k: v for k, v in files[0].items() if not k.startswith("head.")})
    heads = [weights_fingerprint({k: v for k, v in file.items() if k.startswith("head.")}) for file in files]
    assert heads[0] != heads[1]

    def started(path, classes: int, seed: int = 0) -> tuple:
        """(the start record, the model) of vit_nano of `classes` classes built from `path` after seed `seed`."""
        torch.manual_seed(seed)  # train.py draws a new classifier after train.seed
        model = build_model(ModelConfig(name="vit_nano", num_classes=classes, drop_path=0.0, pretrained=str(path)))
        return start_record(str(path), model), model

    def result(record: dict) -> dict:
        """An evaluate.py result of a run that recorded `record` (its recipe's start keys)."""
        return {"recipe": {"model.name": "vit_nano", **recipe_entries({START_WEIGHTS: record})}}

    kept = [started(path, 4)[0] for path in paths]
    assert kept == [{"pretrained": "file", "fingerprint": backbone, "classifier": head} for head in heads]
    differ = recipe_difference([("a", result(kept[0])), ("b", result(kept[1]))])
    assert differ is not None and "start.classifier" in differ[2], differ
    new = [started(path, 6, seed)[0] for seed, path in enumerate(paths)]  # each seed's classifier another
    assert new == [{"pretrained": "file", "fingerprint": backbone, "classifier": None}] * 2
    assert recipe_difference([("a", result(new[0])), ("b", result(new[1]))]) is None
    # a record of before the classifier's (no such key) is compared on the backbone alone, as it was
    older = {"pretrained": "file", "fingerprint": backbone}
    assert recipe_difference([("old", result(older)), ("a", result(kept[0]))]) is None
    model = started(paths[1], 4)[1]  # b.pth's classifier now under the path a run of a.pth's started from
    assert check_start_file({START_WEIGHTS: older}, "run/best.pt", str(paths[1]), model) is None
    refused = check_start_file({START_WEIGHTS: kept[0]}, "run/best.pt", str(paths[1]), model)
    assert refused is not None and "another classifier" in refused and heads[0] in refused, refused
    assert check_start_file({START_WEIGHTS: kept[1]}, "run/best.pt", str(paths[1]), model) is None


def test_a_fine_tune_of_a_fine_tune_is_checked_against_the_data_of_every_start(tmp_path):
    """C fine-tuned from B fine-tuned from A was checked against B's training data only: the record of a start that
    is a run checkpoint names the data its weights learned (its run's and its own starts', nearest first), and a val
    split that reads A's training data is refused for C too."""
    common = ["model.num_classes=10", "train.max_steps=1", "log.tensorboard=false"]
    digits = ["data.dataset=digits", *common]

    def run(name, *extra):
        return train.main(load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / name}", *extra]))

    run("a", *digits)  # the digits outside a val fraction of 0.2
    run("b", *common, f"model.pretrained={tmp_path / 'a' / 'best.pt'}")  # synthetic images: no digit seen here
    a = torch.load(tmp_path / "a" / "best.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "best.pt", weights_only=False)
    assert b[START_WEIGHTS]["trained_on"] == [{"data": a["config"]["data"], "data_fingerprint": a["data_fingerprint"]}]
    with pytest.raises(ConfigError, match=r"185 of its val images are among the digits model.pretrained=.*b/best.pt's "
                                          r"start \(weights it was fine-tuned from\) was trained on"):
        run("c", *digits, "data.digits_val_fraction=0.3", f"model.pretrained={tmp_path / 'b' / 'best.pt'}")
    assert not (tmp_path / "c").exists()
    run("c", *digits, f"model.pretrained={tmp_path / 'b' / 'best.pt'}")  # A's val split, held out from A and B
    c = torch.load(tmp_path / "c" / "checkpoint.pt", weights_only=False)
    assert [entry["data"]["dataset"] for entry in c[START_WEIGHTS]["trained_on"]] == ["synthetic", "digits"]


def test_evaluate_refuses_a_val_split_that_a_start_of_the_checkpoint_was_trained_on(tmp_path):
    """evaluate.py --checkpoint checked the val split against the checkpoint's own training data only: C fine-tuned
    from B fine-tuned from A, both on synthetic images, was scored on A's digits at another val fraction, 185 of whose
    val images A was trained on (the seeded split's own draw, data.digits.split_indices). It is refused naming the
    start that learned them, as train.py refuses that split for a fine-tune of C; A's own split is scored."""
    from data.digits import split_indices
    common = ["model.num_classes=10", "train.max_steps=1", "log.tensorboard=false"]

    def run(name, *extra):
        train.main(load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / name}", *common, *extra]))
        return str(tmp_path / name / "best.pt")

    a = run("a", "data.dataset=digits")  # the digits outside a val fraction of 0.2
    c = run("c", f"model.pretrained={run('b', f'model.pretrained={a}')}")  # synthetic images: no digit seen there
    seen = len(set(split_indices(0.2)[0].tolist()) & set(split_indices(0.3)[1].tolist()))  # the reference count
    assert seen == 185
    b = str(tmp_path / "b" / "best.pt")
    for checkpoint, start in ((c, r"c/best.pt's start's start \(weights 2 fine-tunes back\)"),
                              (b, r"b/best.pt's start \(weights it was fine-tuned from\)")):
        with pytest.raises(ConfigError, match=rf"^data.digits_val_fraction=0.3: {seen} of its val images are among "
                                              rf"the digits --checkpoint .*{start} was trained on \(outside a val "
                                              rf"fraction of 0.2\), so .*give data.digits_val_fraction=0.2$"):
            evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "data.dataset=digits",
                                                         "data.digits_val_fraction=0.3"]))
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--checkpoint", c, "--quant", "data.dataset=digits"]))
    assert cfg.data.digits_val_fraction == 0.2  # A's held-out split: scored


def test_a_resume_on_other_training_data_keeps_the_data_the_run_learned_before(tmp_path):
    """A resume with another data.train_split (train.allow_changed_config=true) recorded the new split only: the
    images the run learned before the change were forgotten, so a later resume, evaluate.py --checkpoint and a
    fine-tune of the run took them as a val split. The record keeps them, named as the run's own earlier training,
    and as its start's data in a fine-tune of it; a resume on the same data adds nothing."""
    from tests.conftest import make_folder
    root = tmp_path / "data"
    make_folder(root, {split: {"a": 8, "b": 8} for split in ("train", "trainB", "val")})
    common = ["data.dataset=folder", f"data.root={root}", "model.num_classes=2", "sched.epochs=6",
              "log.tensorboard=false"]

    def config(name, *extra):
        return load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / name}", *common, *extra])

    def refused(checkpoint, weights):  # evaluate.py --checkpoint of the split the run learned first
        with pytest.raises(ConfigError, match=rf"^data.val_split=train: .*train is the train split --checkpoint "
                                              rf".*{weights} was trained on"):
            evaluate.resolve_config(evaluate.parse_args(["--checkpoint", checkpoint, "--quant",
                                                         "data.val_split=train"]))

    train.main(config("run", "train.max_steps=1"))
    train.main(config("run", "train.max_steps=2"))  # the same data: nothing to add
    checkpoint = str(tmp_path / "run" / "checkpoint.pt")
    first = torch.load(checkpoint, weights_only=False)
    assert "trained_on" not in first[START_WEIGHTS]
    train.main(config("run", "train.max_steps=4", "data.train_split=trainB", "train.allow_changed_config=true"))
    payload = torch.load(checkpoint, weights_only=False)
    assert payload["state"]["step"] == 4 and payload["config"]["data"]["train_split"] == "trainB"
    assert payload[START_WEIGHTS]["trained_on"] == [{"data": first["config"]["data"], "before_resume": True,
                                                     "data_fingerprint": first["data_fingerprint"]}]
    own = r"pt \(its own run's training before a resume changed its training data\)"
    with pytest.raises(ConfigError, match=rf"^data.val_split=train: .*train is the train split .*checkpoint.{own} "
                                          r"was trained on"):
        train.check_resume(config("run", "train.max_steps=6", "data.train_split=trainB", "data.val_split=train",
                                  "train.allow_changed_config=true"), checkpoint, payload, warn=False)
    refused(checkpoint, f"checkpoint.{own}")
    with pytest.raises(ConfigError, match=rf"^data.val_split=train: .*train is the train split model.pretrained="
                                          rf".*checkpoint.{own} was trained on"):
        train.main(config("tune", "train.max_steps=1", "data.train_split=trainB", "data.val_split=train",
                           f"model.pretrained={checkpoint}"))
    assert not (tmp_path / "tune").exists()
    train.main(config("tune", "train.max_steps=1", "data.train_split=trainB", f"model.pretrained={checkpoint}"))
    refused(str(tmp_path / "tune" / "checkpoint.pt"), r"checkpoint.pt's start \(weights it was fine-tuned from\)")


def test_data_settings_that_fail_today_s_schema_are_checked_on_the_keys_that_name_the_data(tmp_path):
    """A start's trained_on entry, or a resumed checkpoint's own data.*, whose settings no longer parse (an old
    0..255 data.mean, a key since removed) made the check of its data be skipped: A's digits at 0.2 were taken as a
    val split at 0.3, 185 of whose images A learned. They are compared on the keys that name the data; a value of one
    of those keys that this version cannot read is refused in one line."""
    from configs import config_to_dict
    old = {"dataset": "digits", "digits_val_fraction": 0.2, "mean": [124, 116, 104], "removed_key": 1}
    cfg = load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "data.dataset=digits", "model.num_classes=10",
                                       "data.digits_val_fraction=0.3", "train.allow_changed_config=true"])
    seen = r"^data.digits_val_fraction=0.3: 185 of its val images are among the digits "
    with pytest.raises(ConfigError, match=seen + r"x's start \(weights it was fine-tuned from\) was trained on"):
        evaluate.check_held_out_from_starts([{"data": old, "data_fingerprint": None}], cfg.data, "x", "the evaluation")
    saved = config_to_dict(cfg)
    saved["data"] = {**saved["data"], **old}
    with pytest.raises(ConfigError, match=seen + r"ckpt.pt was trained on"):
        train.check_resume(cfg, "ckpt.pt", {"config": saved, "state": {"step": 1}}, warn=False)
    with pytest.raises(ConfigError, match=r"^x's start \(weights it was fine-tuned from\) records data settings this "
                                          r"version of the code cannot read \(.*digits_val_fraction.*\), so the val "
                                          r"split cannot be checked .*; use the version of the code that trained it$"):
        evaluate.check_held_out_from_starts([{"data": {**old, "digits_val_fraction": 2}, "data_fingerprint": None}],
                                            cfg.data, "x", "the evaluation")


def test_digits_learned_at_two_fractions_are_refused_in_one_line_naming_both(tmp_path):
    """C trained on digits at a val fraction of 0.3 from A's weights at 0.2 (a lineage older code let through): the
    check of C's own data demanded 0.3, that of A's 0.2, each error the fix the other refuses, while the val images
    of each fraction include some the other trained on (the seeded draws, data.digits.split_indices). evaluate.py
    --checkpoint, a resume and a fine-tune of C say in one line that no fraction is held out from both."""
    from configs import config_to_dict
    from data.digits import split_indices
    for fraction, other in ((0.2, 0.3), (0.3, 0.2)):  # the reference: each val split meets the other's training
        assert set(split_indices(fraction)[1].tolist()) & set(split_indices(other)[0].tolist())
    common = [f"out_dir={tmp_path / 'c'}", "data.dataset=digits", "model.num_classes=10", "log.tensorboard=false",
              "train.max_steps=1"]
    c = load_config([DEBUG_CONFIG], [*common, "data.digits_val_fraction=0.3"])
    payload = {"config": config_to_dict(c), "model": {}, "state": {"step": 1}, "data_fingerprint": None,
               START_WEIGHTS: {"pretrained": "file", "fingerprint": "0" * 16,
                               "trained_on": [{"data": config_to_dict(load_config([DEBUG_CONFIG], common))["data"],
                                               "data_fingerprint": None}]}}  # A's: at the default 0.2
    assert payload[START_WEIGHTS]["trained_on"][0]["data"]["digits_val_fraction"] == 0.2
    path = tmp_path / "c" / "best.pt"
    path.parent.mkdir()
    torch.save(payload, path)
    both = (r"no data.digits_val_fraction is held out from all the digits .*c/best.pt learned: it was trained on "
            r"those outside a val fraction of 0.3, .*c/best.pt's start \(weights it was fine-tuned from\) on those "
            r"outside 0.2, and the val images of each include some another trained on; score it on other data")
    for fraction in ("0.2", "0.3"):
        with pytest.raises(ConfigError, match=rf"^data.digits_val_fraction={fraction}: {both}$"):
            evaluate.check_checkpoint_settings(payload["config"], load_config(
                [DEBUG_CONFIG], [*common, f"data.digits_val_fraction={fraction}"]), str(path), None,
                evaluate.ancestors_data(payload))
        with pytest.raises(ConfigError, match=rf"^data.digits_val_fraction={fraction}: {both}$"):
            train.check_resume(load_config([DEBUG_CONFIG], [*common, f"data.digits_val_fraction={fraction}",
                                                            "train.allow_changed_config=true"]),
                               str(path), payload, warn=False)
        with pytest.raises(ConfigError, match=rf"^data.digits_val_fraction={fraction}: {both}$"):
            train.check_pretrained_data(load_config([DEBUG_CONFIG], [
                f"out_dir={tmp_path / 'd'}", *common[1:], f"data.digits_val_fraction={fraction}",
                f"model.pretrained={path}"]))
