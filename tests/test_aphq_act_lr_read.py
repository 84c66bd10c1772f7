"""APHQ's activation scales learn at act_lr during the block reconstruction, through the quantized elements that
QDrop keeps (drop_prob: the probability of an element's quantized value, quant/aphq/reconstruct.py). At drop_prob=0
every activation quantizer passes its float input, so the scales get no gradient and act_lr changes nothing: given
beside it, act_lr is refused as an override that would be ignored (configs/loader.py READ_ONLY_WHEN), by the config
and by the Python API."""
import pytest

from configs.loader import ConfigError, load_config
from configs.quant import APHQOptions
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant_models import images, same_state, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(iters=4, recon_images=8, calib_images=8, batch_size=4, eq_n=32, matmul_steps=5, search_rounds=0)


def quantized_state(**options) -> dict:
    """The state of APHQ's model for `options` (as the dataclass: parse_options checks nothing of it)."""
    model, _ = PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", APHQOptions(**SMALL, **options),
                                 data=cpu_pipeline_data(num_images=16))
    return model.state_dict()


def test_act_lr_changes_nothing_at_drop_prob_0():
    """The property the refusal rests on, and that act_lr acts where some quantized elements are kept."""
    assert same_state(quantized_state(drop_prob=0.0), quantized_state(drop_prob=0.0, act_lr=1e-2))
    assert not same_state(quantized_state(drop_prob=0.5), quantized_state(drop_prob=0.5, act_lr=1e-2))


def test_the_config_refuses_act_lr_at_drop_prob_0_naming_both_keys():
    with pytest.raises(ConfigError, match=r"^quant.aphq.act_lr=0.01 would be ignored: quant.aphq.act_lr is read only "
                                          r"when quant.aphq.drop_prob is nonzero, and it is 0"):
        load_config([], ["quant.aphq.drop_prob=0", "quant.aphq.act_lr=0.01"])
    assert load_config([], ["quant.aphq.drop_prob=0.25", "quant.aphq.act_lr=0.01"]).quant.aphq.act_lr == 0.01
    assert load_config([], ["quant.aphq.drop_prob=0"]).quant.aphq.drop_prob == 0  # act_lr left at its default


def test_the_python_api_refuses_act_lr_at_drop_prob_0_before_any_work():
    with pytest.raises(ValueError, match=r"quant.aphq.act_lr=0.01 would be ignored: .*quant.aphq.drop_prob"):
        PIPELINES["aphq"](tiny_vit(), None, "w4a4", {"drop_prob": 0.0, "act_lr": 0.01})
