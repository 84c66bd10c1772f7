"""APHQ's rounding regulariser is off for the first warmup * iters iterations of a unit (GoatWu/APHQ-ViT's
LinearTempDecay), so at quant.aphq.warmup=1 it never acts: round_weight, beta_start and beta_end are then refused
where given, as an override that would be ignored."""
import pytest
import torch

from configs.loader import ConfigError, load_config
from configs.quant import APHQOptions
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant.aphq.adaround import RoundingSchedule
from quant_models import images, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

ROUNDING = {"round_weight": 0.5, "beta_start": 10.0, "beta_end": 4.0}  # each other than its default


@pytest.mark.parametrize("iters", [1, 2, 7, 100])
def test_at_warmup_1_no_iteration_has_a_beta(iters):
    """The closed form: off while t = it + 1 < t0 = warmup * iters = iters, and past the last iteration t = iters."""
    schedule = RoundingSchedule(iters, warmup=1.0, beta_start=20.0, beta_end=2.0, weight=0.01)
    assert [schedule.beta(it) for it in range(iters)] == [None] * iters
    below = RoundingSchedule(iters, warmup=0.5, beta_start=20.0, beta_end=2.0, weight=0.01)
    assert below.beta(iters - 1) == 2.0  # below 1 the last iteration has beta_end


@pytest.mark.slow
def test_the_rounding_settings_change_nothing_at_warmup_1():
    """The property the refusal rests on: a reconstruction at warmup 1 gives the same model whatever they say."""
    def quantize(**rounding):
        options = APHQOptions(iters=2, recon_images=8, calib_images=8, batch_size=4, warmup=1.0, **rounding)
        return PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", options,
                                 data=cpu_pipeline_data(num_images=16))[0].state_dict()
    reference, changed = quantize(), quantize(**ROUNDING)
    assert reference.keys() == changed.keys()
    assert all(torch.equal(reference[k], changed[k]) if torch.is_tensor(reference[k]) else reference[k] == changed[k]
               for k in reference)


@pytest.mark.parametrize("key", sorted(ROUNDING))
def test_the_config_refuses_a_rounding_setting_at_warmup_1_and_takes_it_below(key):
    override = f"quant.aphq.{key}={ROUNDING[key]}"
    with pytest.raises(ConfigError, match=rf"^{override} would be ignored: quant.aphq.{key} is read only "
                                          r"when quant.aphq.warmup is below 1 .*give quant.aphq.warmup below 1$"):
        load_config([], ["quant.aphq.warmup=1", override])
    assert getattr(load_config([], ["quant.aphq.warmup=0.99", override]).quant.aphq, key) == ROUNDING[key]


def test_the_api_refuses_it_too():
    with pytest.raises(ValueError, match="quant.aphq.beta_end=4.0 would be ignored"):
        PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", {"iters": 2, "warmup": 1.0, "beta_end": 4.0})
