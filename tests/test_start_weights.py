"""The weights a run started from (engine/start_weights.py): train.py records them in checkpoint.pt and best.pt,
evaluate.py in the recipe it writes, so that runs fine-tuned from other weights, or one trained from scratch, are
no seeds of one experiment for the readers that average seeds (engine/eval_results.recipe_difference)."""
import pytest
import torch

import evaluate
import train
from configs import load_config
from engine.checkpoint import weights_fingerprint
from engine.eval_results import recipe_difference
from engine.start_weights import classifier_keys
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
                {"pretrained": "file", "fingerprint": {file_a: fingerprint_a, file_b: fingerprint_b}[weights]}
                if weights else {"pretrained": None, "fingerprint": None})
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
        assert torch.load(out / "best.pt", weights_only=False)["start_weights"] == {"pretrained": "file",
                                                                                   "fingerprint": fingerprint}
