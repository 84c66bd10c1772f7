"""quant.gplq.pca_images: the teacher PCA's images per rank, read from one epoch of the training loader (full
batches of each rank's shard). Its default, 10000 (what checkpoints, result files and stage-1 identities of every
release record), is capped at one epoch; a count the user gives (a key of the options mapping or of the command's
overrides / --config files, or a value other than the default) is used as it is, so one above the epoch is refused in
one error line naming the real maximum: by evaluate.py before any work, and by the pipeline when stage 1 fits the
PCA."""
import dataclasses
import json

import pytest
import torch

import train
from configs import load_config
from configs.quant import GPLQOptions
from device_utils import cpu_pipeline_data
from engine.eval_results import settings_change
from engine.quant_settings import quant_settings
from models.factory import build_model
from quant import PIPELINES
from quant.gplq.pipeline import stage1_identity
from quant.plan import too_few_for_a_batch, train_image_demands
from quant.spec import parse_bits
from quant_models import tiny_vit
from tests.conftest import DEBUG_CONFIG, run_entry

pytestmark = pytest.mark.usefixtures("one_thread")


def epoch_images(size: int, world_size: int, batch: int) -> int:
    """The reference: what one epoch of a rank's loader gives (its shard, in full batches)."""
    return size // world_size // batch * batch


def gplq(options, num_images: int = 14, batch: int = 4) -> dict:
    """GPLQ's stage-1 report through the Python API; `options`: pca_images as a mapping key (an int), left out
    (None), or a GPLQOptions dataclass carrying it (a dataclass)."""
    small = dict(steps=1, batch_size_per_gpu=batch, init_images=4, qwt=False)
    if isinstance(options, GPLQOptions):
        options = dataclasses.replace(options, **small)
    else:
        options = {**small, **({} if options is None else {"pca_images": options})}
    _, report = PIPELINES["gplq"](tiny_vit(depth=1), None, "w4a4", options, data=cpu_pipeline_data(num_images))
    return report["stage1"]


def test_the_default_is_10000_as_every_earlier_record_holds():
    assert GPLQOptions().pca_images == 10000


def test_the_default_is_capped_at_one_epoch_and_a_count_that_fits_is_used_as_given():
    assert gplq(None)["pca_samples"] == epoch_images(14, 1, 4) == 12
    assert gplq(GPLQOptions(pca_images=10000))["pca_samples"] == 12  # an old config's recorded default
    assert gplq(12)["pca_samples"] == 12 and gplq(5)["pca_samples"] == 5


@pytest.mark.parametrize("count", [13, 14, 100, 10000])
def test_the_pipeline_refuses_a_count_given_above_one_epoch(count):
    with pytest.raises(ValueError, match=rf"^pca_images={count}: one epoch of the training loader gives it 12 images; "
                                         r"give at most that, or leave pca_images out"):
        gplq(count)  # a key of the mapping, even at the default's value


def test_the_pipeline_refuses_a_dataclass_value_other_than_the_default_above_one_epoch():
    with pytest.raises(ValueError, match=r"^pca_images=13: one epoch of the training loader gives it 12 images"):
        gplq(GPLQOptions(pca_images=13))


def plan_refusal(size: int, world_size: int, batch: int, count: int, given: bool = True):
    cfg = load_config([DEBUG_CONFIG], [f"quant.gplq.pca_images={count}", f"quant.gplq.batch_size_per_gpu={batch}"])
    return too_few_for_a_batch(cfg, ["gplq"], size, "train", world_size,
                               {"quant.gplq.pca_images"} if given else ())


@pytest.mark.parametrize("size, world_size, batch", [(64, 1, 5), (64, 2, 4), (64, 2, 5), (100, 3, 7), (1437, 1, 16)])
def test_evaluate_refuses_a_count_above_a_ranks_epoch_naming_a_maximum_it_accepts(size, world_size, batch):
    held = epoch_images(size, world_size, batch)
    assert plan_refusal(size, world_size, batch, held) is None
    for count in (held + 1, size, size + 1, 10000):  # above the epoch, the split, or the old default given
        said = plan_refusal(size, world_size, batch, count)
        assert said.startswith(f"quant.gplq.pca_images={count}: the train split has {size} images")
        assert said.endswith(f"gives{' each process' if world_size > 1 else ''} {held} of them (full batches of "
                             f"{batch}); give at most {held}")


def test_the_default_not_given_is_no_demand_on_the_split():
    # a checkpoint's recorded 10000 on the 1437 images of the digits split (1424 in full batches of 16)
    assert plan_refusal(1437, 1, 16, 10000, given=False) is None
    # a value other than the default is the user's all the same
    assert plan_refusal(1437, 1, 16, 5000, given=False).endswith("give at most 1424")
    # the split's size is no second check with another maximum: the loader's epoch says it (above)
    assert "quant.gplq.pca_images" not in train_image_demands(
        load_config([DEBUG_CONFIG], ["quant.gplq.pca_images=100"]), ["gplq"], False)


def test_a_stage1_identity_and_a_result_recorded_with_10000_still_match():
    cfg = load_config([DEBUG_CONFIG])
    recorded = quant_settings(cfg, "gplq")
    recorded["options"] = {**recorded["options"], "pca_images": 10000}  # as results of before were written
    assert settings_change({"settings": recorded}, quant_settings(cfg, "gplq"), "gplq") is None
    model = tiny_vit(depth=1)
    identity = stage1_identity(model, parse_bits("w4a4"), GPLQOptions(), cpu_pipeline_data(8))
    assert identity["stage1"]["pca_images"] == 10000


def evaluate(tmp_path, capsys, *args: str) -> tuple[int, list[str]]:
    """evaluate.py's exit code and its error lines (not the log's INFO lines)."""
    # stage2_images is read only with QwT on: given beside quant.gplq.qwt=false it is refused as ignored
    stage2 = [] if "quant.gplq.qwt=false" in args else ["quant.gplq.stage2_images=8"]
    code, _, err = run_entry("evaluate.py", [*args, "--quant", "gplq", "--bits", "w4a4",
                                             "quant.gplq.batch_size_per_gpu=5", "quant.gplq.init_images=8",
                                             *stage2, "--out", str(tmp_path / "r.json")], capsys)
    return code, [line for line in err.strip().splitlines() if not line[:2].isdigit()]


@pytest.mark.parametrize("count, says", [
    (100, "quant.gplq.pca_images=100: the train split has 64 images, and one epoch of the training loader gives 60 "
          "of them (full batches of 5); give at most 60"),
    (62, "quant.gplq.pca_images=62: the train split has 64 images, and one epoch of the training loader gives 60 of "
         "them (full batches of 5); give at most 60"),
    (10000, "quant.gplq.pca_images=10000: the train split has 64 images, and one epoch of the training loader gives "
            "60 of them (full batches of 5); give at most 60")])
def test_evaluate_says_it_in_one_error_line(tmp_path, capsys, count, says):
    weights = tmp_path / "w.pt"
    torch.save(build_model(load_config([DEBUG_CONFIG]).model).state_dict(), weights)
    code, errors = evaluate(tmp_path, capsys, "--config", DEBUG_CONFIG, f"model.pretrained={weights}",
                            f"quant.gplq.pca_images={count}")
    assert code != 0 and errors == [f"error: {says}"]


def test_evaluate_runs_a_checkpoint_that_recorded_10000_capped_at_one_epoch(tmp_path, capsys):
    """A run whose config records quant.gplq.pca_images: 10000 (every checkpoint of an earlier release does), on the
    64 synthetic images of the debug config: its evaluation takes the PCA's images from one epoch (60 in full
    batches of 5), as those releases did, though the user never gave the count."""
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "train.max_steps=1",
                                            "log.tensorboard=false"]))
    best = tmp_path / "run" / "best.pt"
    payload = torch.load(best, map_location="cpu", weights_only=True)
    payload["config"]["quant"]["gplq"]["pca_images"] = 10000  # as an earlier release saved it
    torch.save(payload, best)
    code, errors = evaluate(tmp_path, capsys, "--checkpoint", str(best),
                            "quant.gplq.steps=1", "quant.gplq.qwt=false")
    assert code == 0, errors
    entry = json.loads((tmp_path / "r.json").read_text())["quant"]["gplq"]["w4a4"]
    assert entry["settings"]["options"]["pca_images"] == 10000
    assert entry["report"]["stage1"]["pca_samples"] == epoch_images(64, 1, 5)
