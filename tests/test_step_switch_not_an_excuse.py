"""A switch given as false excuses the keys it leaves unread only when it switches a whole config section off
(cd.enabled=false beside cd.lam, a sweep's baseline; tweo.enabled likewise). The switch of a single step or option
(quant.gplq.matmul_operands, quant.aphq.mlp_reconstruct, quant.gplq.qwt, train.ema, log.wandb) given as false beside
an option it leaves unread is refused as that option alone would be, in the overrides, over a file, through the
Python API and in evaluate.py's one error line: the option was neither used, nor refused, nor recorded."""
import pytest

from configs import load_config
from configs.loader import ConfigError
from configs.quant import APHQOptions, GPLQOptions
from quant.pipeline_base import parse_options
from tests.conftest import DEMO_CONFIG, quant_option_refusal

# (the switch given false, the option it leaves unread, the option's value as given)
STEP_SWITCHES = [
    ("quant.gplq.matmul_operands", "quant.gplq.matmul_percentile", "0.9"),
    ("quant.aphq.mlp_reconstruct", "quant.aphq.mlp_lr", "0.1"),
    ("quant.gplq.qwt", "quant.gplq.stage2_images", "64"),
    ("train.ema", "train.ema_decay", "0.99"),
    ("log.wandb", "log.wandb_project", "mine"),
]


@pytest.mark.parametrize("switch, option, value", STEP_SWITCHES)
def test_a_step_switched_off_beside_its_option_is_refused(switch, option, value):
    with pytest.raises(ConfigError, match=rf"^{option}={value} would be ignored: {option} is read only when "
                                          rf"{switch} is true, and it is false; "):
        load_config([DEMO_CONFIG], [f"{switch}=false", f"{option}={value}"])
    # switched on, the same option is read and taken
    load_config([DEMO_CONFIG], [f"{switch}=true", f"{option}={value}"])


@pytest.mark.parametrize("overrides", [["cd.enabled=false", "cd.lam=0.1"], ["cd.enabled=false", "cd.targets=B"],
                                       ["tweo.enabled=false", "tweo.lam=0.5", "tweo.p=3"]])
def test_a_whole_section_switched_off_beside_its_keys_passes(overrides):
    """A sweep's baseline adds cd.enabled=false to the cd.* overrides every run gets: it says what it means."""
    cfg = load_config([DEMO_CONFIG], overrides)
    section = overrides[0].split(".")[0]
    assert getattr(cfg, section).enabled is False


def test_the_section_switches_are_the_enabled_keys_of_a_whole_section():
    from configs.loader import section_switches
    assert section_switches() == {"cd.enabled", "tweo.enabled"}


def test_a_files_option_is_not_excused_by_its_step_switch_given_false_again(tmp_path):
    """The file's mlp_lr over the default mlp_reconstruct=false: the override repeats the value it had, which says
    nothing new; a section switch given false again over a file's key of that section still passes."""
    layer = tmp_path / "mlp.yaml"
    layer.write_text("quant:\n  aphq:\n    mlp_lr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{layer}: quant.aphq.mlp_lr=0.1 would be ignored: quant.aphq.mlp_lr is "
                                          rf"read only when quant.aphq.mlp_reconstruct is true"):
        load_config([DEMO_CONFIG, str(layer)], ["quant.aphq.mlp_reconstruct=false"])
    lam = tmp_path / "lam.yaml"
    lam.write_text("cd: {lam: 0.05}\n")
    assert load_config([DEMO_CONFIG, str(lam)], ["cd.enabled=false"]).cd.enabled is False


@pytest.mark.parametrize("options_type, given, refused", [
    (GPLQOptions, {"matmul_operands": False, "matmul_percentile": 0.9}, "quant.gplq.matmul_percentile=0.9"),
    (APHQOptions, {"mlp_reconstruct": False, "mlp_lr": 0.1}, "quant.aphq.mlp_lr=0.1"),
])
def test_the_python_api_refuses_it_as_the_config_does(options_type, given, refused):
    with pytest.raises(ValueError, match=rf"^{refused} would be ignored"):
        parse_options(options_type, given)


def test_evaluate_refuses_it_in_one_error_line(tmp_path, capsys):
    """The reported command line: one `error:` line naming the option, before any work (the weights file is
    never opened)."""
    line = quant_option_refusal(tmp_path, capsys, "gplq", "quant.gplq.matmul_operands=false",
                                "quant.gplq.matmul_percentile=0.9", "quant.gplq.steps=0")
    assert line.startswith("error: quant.gplq.matmul_percentile=0.9 would be ignored: quant.gplq.matmul_percentile "
                           "is read only when quant.gplq.matmul_operands is true, and it is false"), line
