"""APHQ's APH over a reconstruction set that is no multiple of the batch (a shorter last batch) weighs every sample
alike (quant/aphq/hessian.py); before, the last batch's samples weighed batch_size / its size as much, under the
same options. A result file entry of that older scheme is no result of the current one: it is refused as computed
with other settings (--recompute replaces it), while the default set of whole batches, the same in both schemes, is
reused as it was written."""
import dataclasses
import json

import pytest

from configs import Config
from configs.loader import apply_overrides
from engine.eval_results import EvalResults, ResultsError
from engine.quant_settings import quant_settings
from engine.result_table import nondefault_settings
from quant import PIPELINES
from quant.plan import pipeline_options

RAGGED = ["quant.aphq.recon_images=1000"]  # batches of 32: a last one of 8


def plain(value):
    return json.loads(json.dumps(value, default=str))


def older_entry(overrides: list) -> dict:
    """The settings evaluate.py recorded before the uniform sample weights: everything but the scheme."""
    now = plain(quant_settings(apply_overrides(Config(), overrides), "aphq"))
    now.pop("aph_sample_weights", None)
    now["options"] = plain(dataclasses.asdict(pipeline_options(apply_overrides(Config(), overrides), "aphq")))
    return now


def stored(tmp_path, settings: dict) -> EvalResults:
    results = EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})
    results.add("aphq", "w4a4", {"top1": 71.5}, settings)
    results.save()
    return EvalResults.open(str(tmp_path / "r.json"), {"model": "m"})


def test_an_entry_of_a_shorter_last_batch_is_refused_as_other_settings(tmp_path):
    now = quant_settings(apply_overrides(Config(), RAGGED), "aphq")
    assert now["aph_sample_weights"] == "uniform"
    results = stored(tmp_path, older_entry(RAGGED))
    with pytest.raises(ResultsError, match=r"computed with other settings \(aph_sample_weights None -> "
                                           r"'uniform'\).*--recompute"):
        results.plan("aphq", "w4a4", now, recompute=False)


@pytest.mark.parametrize("overrides", [[], ["quant.aphq.recon_images=1000", "quant.aphq.loss=mse"],
                                       ["quant.aphq.recon_images=1024", "quant.aphq.batch_size=64"]])
def test_whole_batches_or_no_aph_are_the_same_scheme(overrides, tmp_path):
    now = quant_settings(apply_overrides(Config(), overrides), "aphq")
    assert "aph_sample_weights" not in now
    assert stored(tmp_path, older_entry(overrides)).plan("aphq", "w4a4", now, False) is False


def test_the_scheme_follows_what_computes_an_aph():
    options = PIPELINES["aphq"].Options
    assert PIPELINES["aphq"].scheme_settings(options(recon_images=100, batch_size=32, mlp_reconstruct=True,
                                                     iters=0, mlp_iters=5)) == {"aph_sample_weights": "uniform"}
    assert PIPELINES["aphq"].scheme_settings(options(recon_images=100, batch_size=32, iters=0)) == {}


def test_tables_mark_the_result_by_its_option_alone():
    """The scheme is no option: a table's note names recon_images, as it did."""
    now = quant_settings(apply_overrides(Config(), RAGGED), "aphq")
    assert nondefault_settings("aphq", now) == ["quant.aphq.recon_images=1000"]
