"""optim.name is taken as timm's create_optimizer_v2 reads it, and no more: a name of its registry, or `lookahead_`
and one. timm builds the optimizer named after the last '_' and reads only whether the part before it begins with
'lookahead', so another part (a misspelt lookahead, any other word) would train the bare optimizer without a word:
refused before the run builds anything."""
import os

import pytest
import torch
from timm.optim import create_optimizer_v2, list_optimizers
from timm.optim.lookahead import Lookahead

from configs import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs/debug/tiny.yaml")


def built(name):
    """What timm builds for `name`: the optimizer's class, and its base's where it is a Lookahead."""
    opt = create_optimizer_v2([torch.nn.Parameter(torch.zeros(2, 2))], opt=name, lr=1e-3)
    return (Lookahead, type(opt._base_optimizer)) if isinstance(opt, Lookahead) else (type(opt),)


def test_no_name_in_timms_registry_holds_an_underscore():
    """The rule below reads a registry name as a whole; timm splits at every '_'."""
    assert not [name for name in list_optimizers() if "_" in name]


@pytest.mark.parametrize("name, bare", [("lookahed_adamw", "adamw"), ("x_y_sgd", "sgd"), ("_adamw", "adamw"),
                                        ("foo_bar_sgd", "sgd"), ("lookahead_lookahead_adamw", "lookahead_adamw"),
                                        ("lookahead__sgd", "lookahead_sgd")])
def test_a_part_timm_would_not_read_is_refused(name, bare):
    from engine.training_checks import check_training_settings

    assert built(name) == built(bare)  # the reference: timm trains `bare`, the rest of the name unread
    with pytest.raises(ConfigError) as e:
        check_training_settings(load_config([TINY], [f"optim.name={name}"]))
    message = str(e.value)
    assert message.startswith(f"optim.name={name}: timm would build ") and "\n" not in message
    assert "lookahead_" in message  # the one part it reads


def test_a_misspelt_lookahead_is_offered_the_right_one():
    from engine.training_checks import check_training_settings

    with pytest.raises(ConfigError, match=r"did you mean lookahead_adamw\b"):
        check_training_settings(load_config([TINY], ["optim.name=lookahed_adamw"]))


@pytest.mark.parametrize("name", ["adamw", "sgd", "lookahead_adamw", "lookahead_sgd", "lion"])
def test_a_registry_name_or_lookahead_and_one_passes(name):
    from engine.training_checks import check_training_settings

    base = name.rpartition("_")[2]
    # the reference: timm builds the named optimizer, in a Lookahead exactly where the name asks for one
    assert built(name) == ((Lookahead, *built(base)) if name.startswith("lookahead_") else built(base))
    check_training_settings(load_config([TINY], [f"optim.name={name}"]))


@pytest.mark.parametrize("name, missing", [("sgdd", "sgdd"), ("lookahead_sgdd", "sgdd"), ("lookahead", "lookahead")])
def test_a_name_timm_does_not_have_is_refused_with_the_closest_ones(name, missing):
    from engine.training_checks import check_training_settings

    with pytest.raises(ConfigError, match=f"^optim.name={name}: timm has no optimizer '{missing}'; did you mean"):
        check_training_settings(load_config([TINY], [f"optim.name={name}"]))
