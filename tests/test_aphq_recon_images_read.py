"""quant.aphq.recon_images sizes APHQ's reconstruction set, which only the block reconstruction (iters above 0) and
the MLP reconstruction read. A calibration-only run (iters=0 without MLP reconstruction) draws its calib_images
calibration images alone (the reconstruction set's first ones), so a recon_images given there is refused as an
override that would be ignored, and the training split is checked against the calibration count."""
import pytest
import torch

from configs.loader import ConfigError, load_config
from configs.quant import APHQOptions
from quant import PIPELINES, parse_bits
from quant.pipeline_data import PipelineData
from quant.plan import pipeline_options, train_image_demands
from quant_models import tiny_vit
from tests.conftest import DEMO_CONFIG, run_entry

pytestmark = pytest.mark.usefixtures("one_thread")

REFUSAL = (r"^quant.aphq.recon_images={n} would be ignored: quant.aphq.recon_images is read only when "
           r"quant.aphq.iters is above 0 or quant.aphq.mlp_reconstruct is true .*; drop it: a calibration-only run "
           r"\(quant.aphq.iters=0\) without the MLP reconstruction draws no reconstruction set")


class CountingImages:
    """PipelineData.train_images over a fixed pool that records each count asked for (the independent count of the
    images a run draws)."""

    def __init__(self, size: int = 64) -> None:
        self.pool = torch.randn(size, 3, 32, 32, generator=torch.Generator().manual_seed(5))
        self.counts = []

    def __call__(self, count: int, seed: int, train_transform: bool) -> torch.Tensor:
        self.counts.append(count)
        return self.pool[:count]


def quantize(options: APHQOptions):
    """(the counts drawn, the report) of APHQ on a tiny ViT with `options` (a dataclass: not judged by the rules)."""
    draw = CountingImages()
    _, report = PIPELINES["aphq"](tiny_vit(), None, "w4a4", options, data=PipelineData(train_images=draw))
    return draw.counts, report


FAST = dict(calib_images=4, batch_size=4, matmul_steps=5, search_rounds=0, eq_n=32, log_every=0)


@pytest.mark.parametrize("recon_images", [1437, APHQOptions().recon_images])
def test_the_config_refuses_recon_images_at_iters_0_given_or_at_its_default(recon_images):
    """The reviewer's override, and the default spelt out: a key given is judged whatever its value, as
    quant.aphq.seed=0 (its default) is there."""
    with pytest.raises(ConfigError, match=REFUSAL.format(n=recon_images)):
        load_config([], ["quant.aphq.iters=0", f"quant.aphq.recon_images={recon_images}"])
    with pytest.raises(ConfigError, match=r"^quant.aphq.seed=0 would be ignored"):
        load_config([], ["quant.aphq.iters=0", f"quant.aphq.seed={APHQOptions().seed}"])


@pytest.mark.parametrize("with_it", [[], ["quant.aphq.iters=5"],
                                     ["quant.aphq.iters=0", "quant.aphq.mlp_reconstruct=true",
                                      "quant.aphq.mlp_iters=5"]])
def test_the_config_takes_recon_images_where_a_reconstruction_reads_it(with_it):
    assert load_config([], [*with_it, "quant.aphq.recon_images=64"]).quant.aphq.recon_images == 64


def test_evaluate_refuses_it_in_one_error_line(tmp_path, capsys):
    """The reviewer's evaluate.py command line (the weights file is never opened)."""
    argv = ["--config", DEMO_CONFIG, f"model.pretrained={tmp_path / 'w.pt'}", "--quant", "aphq", "--bits", "w4a4",
            "--out", str(tmp_path / "y.json"), "quant.aphq.iters=0", "quant.aphq.recon_images=1437"]
    code, _, err = run_entry("evaluate.py", argv, capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith("error: quant.aphq.recon_images=1437 would be ignored") and "drop it" in lines[0]


def test_the_api_refuses_it_before_drawing_an_image():
    draw = CountingImages()
    with pytest.raises(ValueError, match=REFUSAL.format(n=8)):
        PIPELINES["aphq"](tiny_vit(), None, "w4a4", {"iters": 0, "recon_images": 8},
                          data=PipelineData(train_images=draw))
    assert draw.counts == []


def test_a_calibration_only_run_draws_its_calibration_set_alone():
    """recon_images=32 (as a dataclass, which the API does not judge): only the 4 calibration images are drawn,
    and the report counts no reconstruction image."""
    counts, report = quantize(APHQOptions(iters=0, recon_images=32, **FAST))
    assert counts == [4]
    assert report["data"]["calibration_images"] == 4 and report["data"]["reconstruction_images"] == 0


@pytest.mark.parametrize("changes", [dict(iters=0), dict(iters=0, mlp_reconstruct=True, mlp_iters=1),
                                     dict(iters=1)])
def test_the_images_checked_against_the_split_are_the_images_drawn(changes):
    """train_image_counts (what evaluate.py checks against the training split) against the count the run asks
    for: the calibration set at calibration only, the reconstruction set where something is trained."""
    options = APHQOptions(recon_images=8, **{**FAST, **changes})
    counts, report = quantize(options)
    assert list(PIPELINES["aphq"].train_image_counts(options).values()) == counts
    trains = changes != dict(iters=0)
    assert report["data"]["reconstruction_images"] == (8 if trains else 0)


def test_evaluate_checks_the_calibration_count_at_iters_0():
    """The split is checked against what is drawn: quant.aphq.calib_images, not the unread recon_images."""
    cfg = load_config([DEMO_CONFIG], ["quant.pipelines=[aphq]", "quant.aphq.iters=0", "quant.aphq.calib_images=2000"])
    assert train_image_demands(cfg, {"aphq"}, False) == {"quant.aphq.calib_images": 2000}
    cfg = load_config([DEMO_CONFIG], ["quant.pipelines=[aphq]", "quant.aphq.iters=5"])
    assert train_image_demands(cfg, {"aphq"}, False) == {"quant.aphq.recon_images": 1024}


def test_a_calibration_set_above_the_default_reconstruction_set_is_taken_at_iters_0():
    """recon_images bounds calib_images only where the reconstruction set is drawn: at iters=0 it could not be
    raised (it is refused there), so calib_images=2000 was refused for a recon_images nothing reads."""
    cfg = load_config([], ["quant.aphq.iters=0", "quant.aphq.calib_images=2000", "quant.aphq.batch_size=2000"])
    PIPELINES["aphq"].validate(parse_bits("w4a4"), pipeline_options(cfg, "aphq"))
    with pytest.raises(ValueError, match="calib_images=2000 exceeds recon_images=1024"):
        PIPELINES["aphq"].validate(parse_bits("w4a4"),
                                   pipeline_options(load_config([], ["quant.aphq.calib_images=2000"]), "aphq"))
