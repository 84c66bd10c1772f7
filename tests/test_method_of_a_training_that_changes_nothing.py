"""The method a run is labelled with (engine.result_table.method_name for a classifier or language model,
engine.detection.method_of for a detector: the tables' and Fig. 1's name) is the baseline's exactly where the run
trains as the baseline: configs/debug/tiny.yaml trained with a regularizer that is on but acts with strength 0
(cd.lam=0, tweo.lam=0, the loss form's cd.loss_coef=0 with the weight decay as given), and the sample detector with
a CD or TWEO hook at lam 0, end with the baseline's weights bit for bit, and a run labelled otherwise would be drawn
as a second method (and refused as a seed of the baseline's recipe); settings that change the training (a strength
above 0, the budget rule's lower weight decay) keep their own label. The final weights are the reference, not the
label functions."""
import os

import pytest
import torch

import train
from configs import config_to_dict, load_config
from engine.eval_results import recipe_difference
from engine.result_table import method_name
from engine.run_dir import recipe
from detection_runs import train as train_detector
from tests.conftest import ROOT

TINY = os.path.join(ROOT, "configs/debug/tiny.yaml")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """overrides -> (config, final weights) of tiny.yaml trained with them, each trained once in this module."""
    done = {}

    def get(overrides):
        key = tuple(overrides)
        if key not in done:
            out = tmp_path_factory.mktemp("run")
            cfg = load_config([TINY], [f"out_dir={out}", "log.tensorboard=false", *overrides])
            train.main(cfg)
            done[key] = cfg, torch.load(os.path.join(out, "checkpoint.pt"), map_location="cpu",
                                        weights_only=True)["model"]
        return done[key]
    return get


def _alike(a: dict, b: dict) -> bool:
    """Whether two state dicts hold the same weights, bit for bit."""
    assert set(a) == set(b)
    return all(torch.equal(a[k], b[k]) for k in a)


LAM_0_FC2 = ["cd.enabled=true", "cd.lam=0", "cd.lam_per_role.fc2=0.5"]


@pytest.mark.parametrize("overrides, other, identical", [
    (["cd.enabled=true", "cd.lam=0"], [], True),  # the budget rule's wd - 0 leaves the weight decay as given
    (["cd.enabled=true", "cd.lam=0", "cd.lam_per_role.fc2=0", "cd.budget=false"], [], True),
    (["cd.enabled=true", "cd.mode=loss", "cd.lam=0"], [], True),
    (["cd.enabled=true", "cd.mode=loss", "cd.loss_coef=0", "cd.budget=false"], [], True),
    (["tweo.enabled=true", "tweo.lam=0", "tweo.rescale=true", "tweo.schedule=cosine"], [], True),
    (["tweo.enabled=true", "tweo.lam=0", "tweo.form=plain", "cd.enabled=true", "cd.lam=0"], [], True),
    # the budget rule at cd.lam 0.005 trains at weight decay 0.045 though the loss term is 0
    (["cd.enabled=true", "cd.mode=loss", "cd.loss_coef=0"], [], False),
    (LAM_0_FC2, [], False),
    # the budget rule's wd - lam at lam 0 is the weight decay as given: without the rule the same training
    (LAM_0_FC2, [*LAM_0_FC2, "cd.budget=false"], True),
    ([*LAM_0_FC2, "cd.mode=loss"], [*LAM_0_FC2, "cd.mode=loss", "cd.budget=false"], True),
])
def test_a_run_is_labelled_as_another_exactly_where_it_trains_as_that_one(trained, overrides, other, identical):
    cfg, weights = trained(overrides)
    other_cfg, other_weights = trained(other)
    trained_alike = _alike(weights, other_weights)
    assert trained_alike == identical  # the measurement the labels follow
    assert (method_name(cfg) == method_name(other_cfg)) == trained_alike, (method_name(cfg), method_name(other_cfg))
    # and seeds of one recipe where averaged (paper_table.py --over-seeds, dose_report.py's points): the baseline and
    # its twin were refused as "trained with other settings" (cd.enabled, cd.lam)
    recipes = [(str(i), {"recipe": recipe(config_to_dict(c))}) for i, c in enumerate((cfg, other_cfg))]
    assert (recipe_difference(recipes) is None) == trained_alike, recipe_difference(recipes)


@pytest.fixture(scope="module")
def detector_baseline(sample, tmp_path_factory):
    return _detector(train_detector(sample, tmp_path_factory.mktemp("detector"), epochs=1))


def _detector(path):
    """(method_of its training config, weights) of a detector checkpoint."""
    from engine.detection import method_of, training_config
    payload = torch.load(path, map_location="cpu", weights_only=False)  # MMEngine's meta: a file this test wrote
    return method_of(training_config(payload["meta"])), payload["state_dict"]


@pytest.mark.detection
@pytest.mark.parametrize("fragment", ["cd.py", "tweo.py"])
def test_a_detector_is_labelled_the_baseline_exactly_where_it_trains_as_the_baseline(sample, detector_baseline,
                                                                                    tmp_path, fragment):
    """A CD hook at lam 0 (the budget rule's weight decay 0.05 - 0) and a TWEO hook at lam 0: as the classifier's."""
    label, weights = _detector(train_detector(sample, tmp_path / "run", "custom_hooks.0.lam=0", epochs=1,
                                              configs=[os.path.join(ROOT, "configs/detection/method", fragment)]))
    base_label, base_weights = detector_baseline
    assert _alike(weights, base_weights)  # the measurement the labels follow
    assert label == base_label == "Baseline"


@pytest.mark.detection
def test_a_detector_of_both_hooks_has_one_label_in_either_order_of_its_fragments(sample, tmp_path):
    """--config cd.py --config tweo.py and the other way round list the hooks in other orders (merge_fragment appends
    each fragment's): the same training, was labelled "TWEO+CD" beside "CD+TWEO", two methods of Fig. 1."""
    fragments = [os.path.join(ROOT, "configs/detection/method", f) for f in ("cd.py", "tweo.py")]
    (first, weights), (second, other) = (
        _detector(train_detector(sample, tmp_path / name, epochs=1, configs=configs))
        for name, configs in (("cd_tweo", fragments), ("tweo_cd", fragments[::-1])))
    assert _alike(weights, other)  # the measurement the labels follow
    assert first == second == "CD + TWEO"
