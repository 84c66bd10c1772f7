"""A model that cannot be built (an unknown model.name, a model.kwargs entry its constructor does not take, an image
size that is no whole number of patches, a vision-only setting on a GPT) is refused by train.py before out_dir is
made: the refusal came from the run's own build, after the claim of the folder had written train.log there."""
import pytest

from tests.conftest import DEBUG_CONFIG, ROOT, run_entry

LM_CONFIG = f"{ROOT}/configs/lm/kjv_cpu.yaml"


@pytest.mark.parametrize("config, override, says", [
    (DEBUG_CONFIG, "model.name=vit_bogus", "unknown model 'vit_bogus'"),
    (DEBUG_CONFIG, "model.kwargs.dpeth=3", "unexpected keyword argument 'dpeth'"),
    (DEBUG_CONFIG, "model.img_size=30", "an input of 30 pixels is not a whole number of patches of 8"),
    (LM_CONFIG, "model.img_size=64", "model 'gpt2_micro' is a language model: model.img_size=64"),
], ids=["name", "kwargs", "img_size", "language model"])
def test_a_model_that_cannot_be_built_is_refused_before_out_dir_is_made(tmp_path, capsys, config, override, says):
    out_dir = tmp_path / "run"
    code, _, err = run_entry("train.py", ["--config", config, override, f"out_dir={out_dir}"], capsys)
    assert code == 1 and err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert not out_dir.exists()
