"""APHQ's MLP reconstruction swaps every GELU for a ReLU and then tunes fc1 / fc2 for mlp_iters iterations (iters where
mlp_iters is null). With none, the model scored would be the swapped float model, never tuned: mlp_reconstruct=True
whose MLP iterations come to 0 is refused before any work, by the API and by evaluate.py with one error line."""
import pytest
import torch

from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant_models import images, tiny_vit
from tests.conftest import quant_option_refusal

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(recon_images=8, calib_images=8, batch_size=4)


@pytest.mark.parametrize("given, named", [
    ({"iters": 0}, r"iters=0 and mlp_iters=null \(which follows iters\)"),
    ({"iters": 3, "mlp_iters": 0}, "mlp_iters=0"),
    ({"iters": 0, "mlp_iters": 0}, "mlp_iters=0"),
])
def test_the_api_refuses_mlp_reconstruction_without_iterations_before_any_work(given, named):
    drawn = []
    data = cpu_pipeline_data(num_images=16)
    data.train_images = lambda count, seed, train_transform: drawn.append(count)
    with pytest.raises(ValueError, match=f"mlp_reconstruct=True with {named}: .*give mlp_iters above 0, or "
                                         f"mlp_reconstruct=False"):
        PIPELINES["aphq"](tiny_vit(), images(2), "w4a4", {**SMALL, **given, "mlp_reconstruct": True}, data=data)
    assert drawn == []


def test_mlp_iterations_at_iters_0_tune_the_relu_mlps():
    """iters=0 (calibration only) with mlp_iters=2: the MLPs get ReLU and two iterations each, so their weights
    move away from the float model's (which the refused case would have kept under the ReLU)."""
    fp = tiny_vit()
    model, report = PIPELINES["aphq"](fp, images(2), "w4a4", {**SMALL, "iters": 0, "mlp_reconstruct": True,
                                                              "mlp_iters": 2}, data=cpu_pipeline_data(num_images=16))
    rows = report["mlp_reconstruction"]
    assert [r["iters"] for r in rows] == [2] * len(fp.blocks)
    for block, fp_block in zip(model.blocks, fp.blocks):
        assert isinstance(block.mlp.act, torch.nn.ReLU)
        assert not torch.equal(block.mlp.fc1.weight, fp_block.mlp.fc1.weight)


def test_evaluate_refuses_it_with_one_error_line(tmp_path, capsys):
    line = quant_option_refusal(tmp_path, capsys, "aphq", "quant.aphq.iters=0", "quant.aphq.mlp_reconstruct=true")
    assert line.startswith("error: quant.aphq: mlp_reconstruct=True with iters=0 and mlp_iters=null")
    assert "give mlp_iters above 0" in line


def test_a_result_records_the_mlp_iterations_used_and_reads_an_older_null_as_iters():
    """mlp_iters null runs the MLP reconstruction for `iters` iterations: a result records that number (as it does
    hessian_eps), so the same run asked with mlp_iters given as that number is the same result (reused, averaged,
    not marked), an entry written with null reads as iters, and another mlp_iters is still another result."""
    import json

    from configs import Config
    from configs.loader import apply_overrides
    from engine.eval_results import settings_change
    from engine.quant_settings import quant_settings
    from engine.result_table import nondefault_settings

    on = ["quant.aphq.mlp_reconstruct=true", "quant.aphq.iters=3"]
    settings = lambda *more: json.loads(json.dumps(quant_settings(apply_overrides(Config(), [*on, *more]), "aphq")))
    null, given, other = settings(), settings("quant.aphq.mlp_iters=3"), settings("quant.aphq.mlp_iters=2")
    assert null["options"]["mlp_iters"] == 3
    older = {**null, "options": {**null["options"], "mlp_iters": None}}
    for entry in (null, older):
        assert settings_change({"settings": entry}, given, "aphq") is None
        assert settings_change({"settings": entry}, other, "aphq") is not None
    marked = ["quant.aphq.iters=3", "quant.aphq.mlp_reconstruct=True"]
    assert nondefault_settings("aphq", older) == nondefault_settings("aphq", given) == marked
    assert "quant.aphq.mlp_iters=2" in nondefault_settings("aphq", other)


def test_the_report_of_a_run_records_the_mlp_iterations_used():
    """The report evaluate.py's result file keeps holds the MLP iterations the reconstruction ran (iters, for a null
    mlp_iters), not null."""
    from configs.quant import APHQOptions

    options = APHQOptions(**SMALL, iters=1, eq_n=32, matmul_steps=5, search_rounds=0, mlp_reconstruct=True)
    _, report = PIPELINES["aphq"](tiny_vit(depth=1), images(2), "w4a4", options, data=cpu_pipeline_data(num_images=16))
    assert [r["iters"] for r in report["mlp_reconstruction"]] == [1]
    assert report["options"]["mlp_iters"] == 1
