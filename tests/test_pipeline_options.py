"""A pipeline's options handed over as a mapping (the Python API) obey the config's READ_ONLY_WHEN rules: an option
that the other options leave unread is refused, as evaluate.py refuses the same override."""
import json

import pytest

from configs import load_config
from configs.loader import ConfigError
from configs.quant import APHQ_DETECTION, GPLQ_DETECTION, APHQOptions, GPLQOptions
from quant import PIPELINES
from quant.pipeline_base import parse_options
from quant.pipeline_data import PipelineData
from quant_models import tiny_vit

OPTIONS = {"aphq": APHQOptions, "gplq": GPLQOptions}

# (section, options given, the refused option or None)
CASES = [
    ("aphq", {"mlp_iters": 500}, "mlp_iters"),
    # a step's switch turned off beside its options: not a whole section (cd.enabled), so no excuse
    ("aphq", {"mlp_lr": 0.1, "mlp_reconstruct": False}, "mlp_lr"),
    ("aphq", {"mlp_reconstruct": True, "mlp_iters": 5}, None),
    ("aphq", {"loss": "mse", "temperature": 3.0}, "temperature"),
    ("aphq", {"loss": "mse", "hessian_eps": 0.5}, "hessian_eps"),
    ("aphq", {"loss": "mse", "mlp_reconstruct": True, "hessian_probe": "rademacher"}, None),
    ("aphq", {"iters": 0, "weight_lr": 0.01}, "weight_lr"),
    ("aphq", {"iters": 0, "drop_prob": 1.0}, "drop_prob"),
    ("aphq", {"iters": 0, "log_every": 0}, "log_every"),
    ("aphq", {"iters": 0, "mlp_reconstruct": True, "mlp_iters": 5, "temperature": 5.0, "log_every": 0}, None),
    ("aphq", {"iters": 0, "calib_images": 4, "batch_size": 4, "search_rounds": 0}, None),
    # a calibration-only run draws its calibration set alone: no reconstruction set to size
    ("aphq", {"iters": 0, "recon_images": 8, "calib_images": 4}, "recon_images"),
    ("aphq", {"iters": 0, "mlp_reconstruct": True, "mlp_iters": 5, "recon_images": 8}, None),
    ("gplq", {"pca_weight": 0.0, "pca_images": 16}, "pca_images"),
    ("gplq", {"pca_weight": 0.5, "pca_images": 16}, None),
    ("gplq", {"qwt": False, "stage2_images": 8}, "stage2_images"),
    ("gplq", {"matmul_percentile": 0.9}, None),
    ("gplq", {"matmul_operands": False, "matmul_percentile": 0.9}, "matmul_percentile"),
]


def config_refuses(section, given):
    """The config loader's answer to the same settings as evaluate.py overrides (the independent reference)."""
    try:
        load_config([], [f"quant.{section}.{key}={json.dumps(value)}" for key, value in given.items()])
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("section, given, refused", CASES, ids=[f"{c[0]}-{'-'.join(c[1])}" for c in CASES])
def test_an_option_the_others_leave_unread_is_refused_as_the_config_loader_refuses_it(section, given, refused):
    loader_says = config_refuses(section, given)
    assert (loader_says is None) == (refused is None)
    if refused is None:
        parse_options(OPTIONS[section], given)
        return
    with pytest.raises(ValueError) as error:
        parse_options(OPTIONS[section], given)
    message = str(error.value)
    assert message == loader_says.replace("command line: ", "")
    assert message.startswith(f"quant.{section}.{refused}={json.dumps(given[refused]).strip(chr(34))} would be "
                              f"ignored")


def test_a_pipeline_called_with_an_unread_option_refuses_it_before_any_work():
    drawn = []
    data = PipelineData(train_images=lambda n, seed, train: drawn.append(n))
    with pytest.raises(ValueError, match=r"quant.aphq.mlp_iters=500 would be ignored: quant.aphq.mlp_iters is read "
                                         r"only when quant.aphq.mlp_reconstruct is true, and it is false"):
        PIPELINES["aphq"](tiny_vit(), None, "w4a4", {"iters": 1, "mlp_iters": 500}, data=data)
    assert drawn == []


@pytest.mark.parametrize("section, recipe, change", [
    ("aphq", APHQ_DETECTION, {"iters": 0}), ("aphq", APHQ_DETECTION, {"loss": "mse"}),
    ("gplq", GPLQ_DETECTION, {"qwt": False})])
def test_the_detection_recipes_leave_every_step_switchable(section, recipe, change):
    """evaluate_detection.py hands a pipeline its detection recipe (detection_defaults) with the user's options on
    top: no recipe key may become unread when the user turns a step off (the user did not give it). APHQ's
    recon_images is one at iters=0, and GPLQ's stage2_train_transform one at qwt=false, which detection_defaults
    leaves out there."""
    from types import SimpleNamespace

    from evaluate_detection import detection_defaults
    handed = {**detection_defaults(section, SimpleNamespace(calib_images=1), change), **change}
    left_out = {"recon_images"} if change == {"iters": 0} else {"stage2_train_transform"} if change == {"qwt": False} \
        else set()
    assert set(recipe) - set(handed) == left_out
    parse_options(OPTIONS[section], handed)


@pytest.mark.parametrize("items", [["aphq.iters=5", "aphq.iters=6"], ["gplq.steps=3", "gplq.steps=3"]])
def test_evaluate_detection_refuses_a_quant_option_given_twice(items):
    """`--quant-options aphq.iters=5 aphq.iters=6` had run 6 iterations without a word (each item was applied on
    its own, the later replacing the earlier); evaluate.py's overrides refuse a key given twice the same way."""
    from evaluate_detection import pipeline_options
    name = items[0].partition("=")[0]
    with pytest.raises(ValueError, match=rf"^--quant-options {name} is given twice; keep one$"):
        pipeline_options(items, ["aphq", "gplq"])
    assert pipeline_options(items[:1], ["aphq", "gplq"]) == {name.split(".")[0]: {name.split(".")[1]:
                                                                                  int(items[0].split("=")[1])}}
