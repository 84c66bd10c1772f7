"""Two of APHQ's loss terms have a weight that switches them off at 0: the rounding regulariser of the block
reconstruction (round_weight * sum(1 - |2h - 1|^beta), beta from beta_start to beta_end after the warm-up) and the
MLP reconstruction's clipped branch (mlp_clip_weight * its distance, the fc2 input clipped at the
mlp_clip_percentile level). At weight 0 the settings only that term reads change no gradient, so they are refused
where given, as an override that would be ignored."""
import pytest

from configs.loader import ConfigError, load_config
from configs.quant import APHQOptions
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant_models import images, same_state, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(recon_images=8, calib_images=8, batch_size=4, eq_n=32, matmul_steps=5, search_rounds=0)  # a short search
ROUNDING = {"beta_start": 10.0, "beta_end": 4.0, "warmup": 0.5}  # each other than its default
CLIP = {"mlp_clip_percentile": 0.5}


def quantized_state(**options) -> dict:
    """The state of APHQ's model for `options` (as the dataclass: parse_options checks nothing of it)."""
    model, _ = PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", APHQOptions(**SMALL, **options),
                                 data=cpu_pipeline_data(num_images=16))
    return model.state_dict()


def test_the_rounding_settings_change_nothing_at_round_weight_0():
    """The property the refusal rests on, and that the comparison sees them where the regulariser is weighed."""
    off, on = dict(iters=4, round_weight=0.0), dict(iters=4, round_weight=1.0)
    assert same_state(quantized_state(**off), quantized_state(**off, **ROUNDING))
    assert not same_state(quantized_state(**on), quantized_state(**on, **ROUNDING))


def test_the_clip_level_changes_nothing_at_mlp_clip_weight_0():
    mlp = dict(iters=0, mlp_reconstruct=True, mlp_iters=3)
    assert same_state(quantized_state(**mlp, mlp_clip_weight=0.0), quantized_state(**mlp, mlp_clip_weight=0.0, **CLIP))
    assert not same_state(quantized_state(**mlp), quantized_state(**mlp, **CLIP))


@pytest.mark.parametrize("key", sorted(ROUNDING))
def test_the_config_refuses_a_rounding_setting_at_round_weight_0_and_takes_it_otherwise(key):
    override = f"quant.aphq.{key}={ROUNDING[key]}"
    with pytest.raises(ConfigError, match=rf"^{override} would be ignored: quant.aphq.{key} is read only when "
                                          r"quant.aphq.round_weight is nonzero"):
        load_config([], ["quant.aphq.round_weight=0", override])
    assert getattr(load_config([], ["quant.aphq.round_weight=0.1", override]).quant.aphq, key) == ROUNDING[key]


def test_the_config_refuses_the_clip_level_at_mlp_clip_weight_0_and_takes_it_otherwise():
    on = ["quant.aphq.mlp_reconstruct=true", "quant.aphq.mlp_clip_percentile=0.5"]
    with pytest.raises(ConfigError, match=r"^quant.aphq.mlp_clip_percentile=0.5 would be ignored: "
                                          r"quant.aphq.mlp_clip_percentile is read only when "
                                          r"quant.aphq.mlp_clip_weight is nonzero"):
        load_config([], [*on, "quant.aphq.mlp_clip_weight=0"])
    assert load_config([], [*on, "quant.aphq.mlp_clip_weight=1"]).quant.aphq.mlp_clip_percentile == 0.5


def test_the_weights_alone_are_taken_at_0():
    """0 says what it does (no regulariser, no clipped branch): the weight itself is read."""
    cfg = load_config([], ["quant.aphq.round_weight=0", "quant.aphq.mlp_reconstruct=true",
                           "quant.aphq.mlp_clip_weight=0"]).quant.aphq
    assert cfg.round_weight == 0 and cfg.mlp_clip_weight == 0


def test_the_api_refuses_them_too():
    with pytest.raises(ValueError, match="quant.aphq.beta_end=4.0 would be ignored"):
        PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", {"iters": 2, "round_weight": 0.0, "beta_end": 4.0})
    with pytest.raises(ValueError, match="quant.aphq.mlp_clip_percentile=0.5 would be ignored"):
        PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", {"iters": 2, "mlp_reconstruct": True,
                                                          "mlp_clip_weight": 0.0, "mlp_clip_percentile": 0.5})
