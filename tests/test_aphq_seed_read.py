"""quant.aphq.seed seeds APHQ's random draws: a reconstruction's batches, QDrop masks and probes (iters above 0), the
MLP reconstruction's batches, and the row subsets of search_max_rows. A calibration-only run (iters=0) without
the latter two draws nothing, so a seed given there is refused as an override that would be ignored."""
import pytest

from configs.loader import ConfigError, load_config
from configs.quant import APHQOptions
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant_models import images, same_state, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(iters=0, calib_images=8, batch_size=4)


def quantized_state(**options) -> dict:
    """The state of APHQ's model for `options` (as the dataclass: parse_options checks nothing of it)."""
    model, _ = PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", APHQOptions(**SMALL, **options),
                                 data=cpu_pipeline_data(num_images=16))
    return model.state_dict()


@pytest.mark.slow
def test_calibration_only_is_the_same_under_any_seed_and_search_max_rows_reads_it():
    """The property the rule rests on, and its exception: row subsets of the output-MSE search differ by seed."""
    assert same_state(quantized_state(seed=0), quantized_state(seed=5))
    assert not same_state(quantized_state(seed=0, search_max_rows=3), quantized_state(seed=5, search_max_rows=3))


def test_the_config_refuses_a_seed_at_iters_0_without_max_rows():
    with pytest.raises(ConfigError, match=r"^quant.aphq.seed=5 would be ignored: quant.aphq.seed is read only when "
                                          r"quant.aphq.iters is above 0, .*search_max_rows is set .*drop it"):
        load_config([], ["quant.aphq.iters=0", "quant.aphq.seed=5"])


@pytest.mark.parametrize("with_it", [[], ["quant.aphq.search_max_rows=100"],
                                     ["quant.aphq.iters=0", "quant.aphq.search_max_rows=100"],
                                     ["quant.aphq.iters=0", "quant.aphq.mlp_reconstruct=true",
                                      "quant.aphq.mlp_iters=5"]])
def test_the_config_takes_a_seed_where_something_is_drawn(with_it):
    assert load_config([], [*with_it, "quant.aphq.seed=5"]).quant.aphq.seed == 5


def test_the_api_refuses_it_too():
    with pytest.raises(ValueError, match="quant.aphq.seed=5 would be ignored"):
        PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", {**SMALL, "seed": 5})
