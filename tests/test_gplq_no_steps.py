"""GPLQ at quant.gplq.steps=0: no stage-1 update, so no loss, no teacher PCA and no teacher forward. The options only
stage 1's updates read (optimizer, AMP, logging, checkpoint interval, the PCA loss) are refused where given, as the
reconstruction settings are at quant.aphq.iters=0; a pca_weight of 0 says no PCA loss, which holds, and passes."""
import pytest
import torch

import quant.gplq.pipeline as gplq_pipeline
import quant.gplq.qat as gplq_qat
from configs.loader import ConfigError, load_config
from configs.quant import GPLQOptions
from device_utils import cpu_pipeline_data
from quant import PIPELINES
from quant_models import images, tiny_vit
from tests.conftest import quant_option_refusal

pytestmark = pytest.mark.usefixtures("one_thread")

# what stage 1 alone reads, each with a value other than its default
STAGE1_ONLY = {"lr": 1e-2, "scale_lr": 1e-2, "weight_decay": 0.05, "amp": "bf16", "log_every": 3, "ckpt_every": 7,
               "pca_weight": 0.5, "pca_variance": 0.9, "pca_multiple": 8, "pca_images": 8}
BASE = dict(steps=0, batch_size_per_gpu=4, init_images=8, stage2_images=8)


def quantize(options: GPLQOptions):
    """GPLQ on a tiny ViT with `options` handed over as the dataclass (parse_options then checks nothing)."""
    return PIPELINES["gplq"](tiny_vit(), images(8), "w4a4", options, data=cpu_pipeline_data(num_images=16))


def test_no_teacher_pca_and_no_teacher_forward_without_updates(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("computed for a loss that no update reads")
    monkeypatch.setattr(gplq_pipeline, "fit_pca", never)
    monkeypatch.setattr(gplq_qat, "penultimate", never)
    _, report = quantize(GPLQOptions(**BASE))
    assert report["stage1"]["steps"] == 0
    assert report["stage1"]["pca_dims"] is None and report["stage1"]["pca_samples"] is None


@pytest.mark.parametrize("key", sorted(STAGE1_ONLY))
def test_each_refused_option_changes_nothing_at_steps_0(key):
    """The property the refusals rest on: at steps 0 the quantized model is the same whatever the option says."""
    reference, _ = quantize(GPLQOptions(**BASE))
    changed, _ = quantize(GPLQOptions(**BASE, **{key: STAGE1_ONLY[key]}))
    ref, new = reference.state_dict(), changed.state_dict()
    assert ref.keys() == new.keys()
    assert all(torch.equal(ref[k], new[k]) if torch.is_tensor(ref[k]) else ref[k] == new[k] for k in ref)


@pytest.mark.parametrize("key", sorted(STAGE1_ONLY))
def test_the_config_refuses_a_stage1_option_at_steps_0_and_takes_it_with_steps(key):
    override = f"quant.gplq.{key}={STAGE1_ONLY[key]}"
    with pytest.raises(ConfigError, match=f"quant.gplq.{key}=.* would be ignored: .*quant.gplq.steps"):
        load_config([], ["quant.gplq.steps=0", override])
    assert getattr(load_config([], ["quant.gplq.steps=2", override]).quant.gplq, key) == STAGE1_ONLY[key]


def test_the_options_steps_0_reads_are_taken():
    """Read without updates: the LSQ initialisation (images, seed), QwT's batch (qwt is on), the layout; and
    pca_weight=0, which says what steps 0 does (GPLQ's detection recipe gives it)."""
    load_config([], ["quant.gplq.steps=0", "quant.gplq.pca_weight=0", "quant.gplq.init_images=64",
                     "quant.gplq.seed=3", "quant.gplq.batch_size_per_gpu=8", "quant.gplq.act_granularity=tensor"])


def test_the_api_refuses_it_too():
    with pytest.raises(ValueError, match="quant.gplq.lr=0.01 would be ignored"):
        PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", {**BASE, "lr": 1e-2})


def test_evaluate_refuses_it_with_one_error_line(tmp_path, capsys):
    line = quant_option_refusal(tmp_path, capsys, "gplq", "quant.gplq.steps=0", "quant.gplq.lr=1e-3")
    assert line.startswith("error: quant.gplq.lr=0.001 would be ignored") and "quant.gplq.steps" in line


def test_the_batch_is_unread_at_steps_0_without_qwt_and_refused_there():
    """batch_size_per_gpu is stage 1's loader batch and QwT's capture batch: at steps 0 with qwt=false neither runs,
    so the model is the same whatever it says, and it was taken (and recorded as a setting) without a word. With
    QwT on it is its batch, and taken."""
    reference, _ = quantize(GPLQOptions(**{**BASE, "qwt": False}))
    changed, _ = quantize(GPLQOptions(**{**BASE, "qwt": False, "batch_size_per_gpu": 2}))
    ref, new = reference.state_dict(), changed.state_dict()
    assert all(torch.equal(ref[k], new[k]) if torch.is_tensor(ref[k]) else ref[k] == new[k] for k in ref)
    with pytest.raises(ConfigError, match=r"^quant.gplq.batch_size_per_gpu=8 would be ignored: .*quant.gplq.steps=0, "
                                          r"quant.gplq.qwt=false"):
        load_config([], ["quant.gplq.steps=0", "quant.gplq.qwt=false", "quant.gplq.batch_size_per_gpu=8"])
    with pytest.raises(ValueError, match=r"^quant.gplq.batch_size_per_gpu=8 would be ignored"):  # the Python API
        PIPELINES["gplq"](tiny_vit(), images(2), "w4a4", {"steps": 0, "qwt": False, "batch_size_per_gpu": 8})
    for taken in (["quant.gplq.steps=0"], ["quant.gplq.steps=1", "quant.gplq.qwt=false"]):
        assert load_config([], [*taken, "quant.gplq.batch_size_per_gpu=8"]).quant.gplq.batch_size_per_gpu == 8


def test_a_split_below_the_default_batch_quantizes_at_steps_0_without_qwt():
    """At steps 0 no update reads the loader, yet it was built at the default batch (16): a split of fewer images
    was refused ('the stage-1 training loader is empty'; evaluate.py: 'give at most N'), and the batch to give is
    refused as unread without QwT. No loader is built there now, and evaluate.py's plan checks no batch."""
    from quant.plan import too_few_for_a_batch
    options = GPLQOptions(steps=0, qwt=False, init_images=8)
    _, report = PIPELINES["gplq"](tiny_vit(), images(8), "w4a4", options, data=cpu_pipeline_data(num_images=8))
    assert report["stage1"]["steps"] == 0
    cfg = load_config([], ["quant.gplq.steps=0", "quant.gplq.qwt=false"])
    assert too_few_for_a_batch(cfg, ["gplq"], 8, "train", 1) is None
    cfg = load_config([], ["quant.gplq.steps=1", "quant.gplq.qwt=false"])
    assert too_few_for_a_batch(cfg, ["gplq"], 8, "train", 1).startswith("quant.gplq.batch_size_per_gpu=16: ")


def test_evaluate_refuses_the_batch_at_steps_0_without_qwt_with_one_error_line(tmp_path, capsys):
    line = quant_option_refusal(tmp_path, capsys, "gplq", "quant.gplq.steps=0", "quant.gplq.qwt=false",
                                "quant.gplq.batch_size_per_gpu=8")
    assert line.startswith("error: quant.gplq.batch_size_per_gpu=8 would be ignored") and "qwt" in line
