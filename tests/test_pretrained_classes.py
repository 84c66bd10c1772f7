"""Fine-tuning from a checkpoint of this code base trained on other classes, as many as the data set's (digits
'0'..'9' for Fashion-MNIST's ten): its classifier fits the model's shape, but would keep naming the file's classes.
train.py replaces it as it replaces one of another shape (models/pretrained.py), or refuses it under
model.pretrained_strict=true; a file of the same classes keeps its classifier."""
import pytest
import torch

import train
from configs import load_config
from engine.distributed import DistInfo
from models import ModelError, build_model
from tests.conftest import DEBUG_CONFIG, make_folder

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A folder data set of classes c0..c9, and three vit_nano files of one backbone: a run checkpoint of the
    digits' classes, one of the folder's own classes (both with a 10-output classifier), and a raw state dict with a
    4-output classifier (the shape mismatch a new classifier is made for)."""
    root = tmp_path_factory.mktemp("classes")
    make_folder(root / "data", {split: {f"c{i}": count for i in range(10)}
                                for split, count in (("train", 2), ("val", 1))})
    torch.manual_seed(5)
    model = build_model(load_config([DEBUG_CONFIG], ["model.num_classes=10"]).model)
    state = model.state_dict()
    for name, classes in (("digits.pt", [str(i) for i in range(10)]), ("same.pt", [f"c{i}" for i in range(10)])):
        torch.save({"model": state, "config": {}, "classes": classes}, root / name)
    torch.save({k: (v[:4] if k.startswith("head.") else v) for k, v in state.items()}, root / "four.pth")
    return root, state


def built(root, weights: str, *overrides: str):
    """The run train.py builds (no update made) fine-tuning `weights` on the folder, and the CPU RNG state after."""
    cfg = load_config([DEBUG_CONFIG], [f"out_dir={root / 'run'}", "data.dataset=folder", f"data.root={root / 'data'}",
                                       "model.num_classes=10", f"model.pretrained={root / weights}", "train.seed=3",
                                       *overrides])
    run = train.build_run(cfg, CPU, resumed=False)
    return run.model.state_dict(), torch.get_rng_state()


def test_a_classifier_of_other_classes_is_replaced_as_one_of_another_shape_is(files, caplog):
    root, state = files
    with caplog.at_level("INFO", logger="train"):
        digits, rng = built(root, "digits.pt")
    # the reference: a 4-output classifier, which models/pretrained.py replaces by the model's own new one
    reference, reference_rng = built(root, "four.pth")
    for key in state:
        assert torch.equal(digits[key], reference[key]), key
        if not key.startswith("head."):
            assert torch.equal(digits[key], state[key]), key  # the backbone is the file's
    assert not torch.equal(digits["head.weight"], state["head.weight"])
    assert torch.equal(rng, reference_rng)  # the run's later draws (data order) as a shape mismatch leaves them
    assert any("was trained on other classes" in r.message and "0: 0 vs c0" in r.message
               and "new classifier: head.bias, head.weight" in r.message for r in caplog.records)
    # a file of the data set's own classes keeps its classifier
    same, _ = built(root, "same.pt")
    assert all(torch.equal(same[k], state[k]) for k in state)


def test_a_classifier_of_other_classes_is_refused_under_pretrained_strict(files):
    root, _ = files
    with pytest.raises(ModelError, match=r"digits.pt was trained on other classes than data.root=.* holds \(then vs "
                                         r"now: 10 vs 10 classes; 0: 0 vs c0.*model.pretrained_strict=false"):
        built(root, "digits.pt", "model.pretrained_strict=true")
    built(root, "same.pt", "model.pretrained_strict=true")  # its own classes: loaded as it is
