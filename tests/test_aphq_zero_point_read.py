"""APHQ folds the post-LayerNorm quantizers (the only reader of round_zero_point) only when a_bits == w_bits, as
the official utils/wrap_net.py: a round_zero_point given where no run folds is refused, before any work."""
import pytest

from configs.quant import APHQOptions
from quant import PIPELINES, parse_bits
from quant_models import images, tiny_vit
from tests.conftest import DEMO_CONFIG, run_entry

pytestmark = pytest.mark.usefixtures("one_thread")


def evaluate_argv(tmp_path, *bits):
    return ["--config", DEMO_CONFIG, f"model.pretrained={tmp_path / 'w.pt'}", "--quant", "aphq", "--bits", *bits,
            "quant.aphq.iters=0", "quant.aphq.calib_images=16",
            "quant.aphq.round_zero_point=false", "--out", str(tmp_path / "r.json")]


def test_evaluate_refuses_round_zero_point_where_every_bit_width_has_a_not_w(tmp_path, capsys):
    """The reviewer's command line at w4a8: one `error:` line naming the option and the fix (the weights file is
    never opened)."""
    code, _, err = run_entry("evaluate.py", evaluate_argv(tmp_path, "w4a8"), capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith("error: quant.aphq.round_zero_point=false would be ignored") and "drop it" in lines[0]
    assert "a_bits == w_bits" in lines[0] and "w4a8" in lines[0]


def test_evaluate_accepts_it_where_one_run_folds(tmp_path, capsys):
    """With w4a4 planned beside w4a8 the w4a4 run reads it: no refusal of it (the run stops later, at the weights
    file that does not exist)."""
    code, _, err = run_entry("evaluate.py", evaluate_argv(tmp_path, "w4a8", "w4a4"), capsys)
    assert "round_zero_point" not in err


def test_the_api_refuses_it_at_unequal_bits_before_any_work():
    with pytest.raises(ValueError, match="round_zero_point=False would be ignored at w4a8: .*a_bits == w_bits"):
        PIPELINES["aphq"](tiny_vit(), images(2), "w4a8", {"round_zero_point": False, "iters": 0})
    assert PIPELINES["aphq"].unread_at(parse_bits("w4a4")) == {}  # equal bits fold: it is read


def test_an_options_dataclass_runs_at_unequal_bits_as_evaluate_py_passes_it_to_each_planned_width():
    """evaluate.py --bits w4a4 w4a8 quant.aphq.round_zero_point=false: the option is read at w4a4, and the same
    APHQOptions goes to the w4a8 run, which must run (it reaches the next check, the training data APHQ draws),
    not be refused after w4a4 was scored."""
    options = APHQOptions(round_zero_point=not APHQOptions().round_zero_point, iters=0, calib_images=2,
                          recon_images=2, batch_size=1)
    with pytest.raises(ValueError, match="draws its own training images"):
        PIPELINES["aphq"](tiny_vit(), images(2), "w4a8", options)
