"""quant.gplq.pca_images: the teacher PCA's images per rank, read from one epoch of the training loader (full
batches of each rank's shard). Left at its default (null) it is up to 10,000, capped at one epoch; a count given is
used as it is, so one above the images is refused, as init_images and stage2_images are: by evaluate.py before any
work, and by the pipeline when stage 1 fits the PCA."""
import pytest
import torch

from configs import load_config
from device_utils import cpu_pipeline_data
from models.factory import build_model
from quant import PIPELINES
from quant.plan import too_few_for_a_batch, train_image_demands
from quant_models import tiny_vit
from tests.conftest import DEBUG_CONFIG, run_entry

pytestmark = pytest.mark.usefixtures("one_thread")


def epoch_images(size: int, world_size: int, batch: int) -> int:
    """The reference: what one epoch of a rank's loader gives (its shard, in full batches)."""
    return size // world_size // batch * batch


def gplq(pca_images, num_images: int = 14, batch: int = 4) -> dict:
    options = dict(steps=1, batch_size_per_gpu=batch, init_images=4, qwt=False,
                   **({} if pca_images is None else {"pca_images": pca_images}))
    _, report = PIPELINES["gplq"](tiny_vit(depth=1), None, "w4a4", options, data=cpu_pipeline_data(num_images))
    return report["stage1"]


def test_the_default_is_capped_at_one_epoch_and_a_count_that_fits_is_used_as_given():
    assert gplq(None)["pca_samples"] == epoch_images(14, 1, 4) == 12
    assert gplq(12)["pca_samples"] == 12 and gplq(5)["pca_samples"] == 5


@pytest.mark.parametrize("count", [13, 14, 100])
def test_the_pipeline_refuses_a_count_above_one_epoch(count):
    with pytest.raises(ValueError, match=rf"^pca_images={count}: one epoch of the training loader gives it 12 images; "
                                         r"give at most that, or null"):
        gplq(count)


@pytest.mark.parametrize("size, world_size, batch", [(64, 1, 5), (64, 2, 4), (64, 2, 5), (100, 3, 7)])
def test_evaluate_refuses_a_count_above_a_ranks_epoch_before_any_work(size, world_size, batch):
    held = epoch_images(size, world_size, batch)

    def refusal(count):
        cfg = load_config([DEBUG_CONFIG], [f"quant.gplq.pca_images={count}", f"quant.gplq.batch_size_per_gpu={batch}"])
        return too_few_for_a_batch(cfg, ["gplq"], size, "train", world_size)
    assert refusal(held) is None
    assert refusal(held + 1).startswith(f"quant.gplq.pca_images={held + 1}: the train split has {size} images")
    assert refusal(held + 1).endswith(f"gives{' each process' if world_size > 1 else ''} {held} of them (full "
                                      f"batches of {batch}); give at most {held}")


def test_only_a_count_given_is_a_demand_on_the_split():
    assert "quant.gplq.pca_images" not in train_image_demands(load_config([DEBUG_CONFIG]), ["gplq"], False)
    given = load_config([DEBUG_CONFIG], ["quant.gplq.pca_images=100"])
    assert train_image_demands(given, ["gplq"], False)["quant.gplq.pca_images"] == 100


@pytest.mark.parametrize("count, says", [
    (100, "quant.gplq.pca_images=100: the train split has 64 images; give at most that"),
    (62, "quant.gplq.pca_images=62: the train split has 64 images, and one epoch of the training loader gives 60 of "
         "them (full batches of 5); give at most 60")])
def test_evaluate_says_it_in_one_error_line(tmp_path, capsys, count, says):
    cfg = load_config([DEBUG_CONFIG])
    weights = tmp_path / "w.pt"
    torch.save(build_model(cfg.model).state_dict(), weights)
    code, _, err = run_entry("evaluate.py", [
        "--config", DEBUG_CONFIG, f"model.pretrained={weights}", "--quant", "gplq", "--bits", "w4a4",
        f"quant.gplq.pca_images={count}", "quant.gplq.batch_size_per_gpu=5", "quant.gplq.init_images=8",
        "quant.gplq.stage2_images=8", "--out", str(tmp_path / "r.json")], capsys)
    errors = [line for line in err.strip().splitlines() if not line[:2].isdigit()]  # not the log's INFO lines
    assert code != 0 and errors == [f"error: {says}"], err
