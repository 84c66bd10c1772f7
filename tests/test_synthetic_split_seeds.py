"""The synthetic train and val splits never share an image, at any size a split may have.

torch's CPU generator keeps only the low 32 bits of a seed, so two images are apart only when their seeds differ in
those bits; the reference here is that rule (checked on torch itself) and the definition of a train image as
torch.randn under the seed of its index."""
import pytest
import torch

from configs import load_config
from data import DataError, build_dataset
from data.synthetic import SyntheticDataset

LOW_32 = (1 << 32) - 1
MOST = 1 << 28  # images per split: 16 splits share the 32 bits


def splits(train_size, val_size=512, img_size=4):
    """(train, val) of data.dataset=synthetic as the loader builds them (lazily: no image is drawn up front)."""
    cfg = load_config(None, ["data.dataset=synthetic", f"data.synthetic_train_size={train_size}",
                             f"data.synthetic_val_size={val_size}"]).data
    return tuple(build_dataset(cfg, split, img_size=img_size, num_classes=1000, train_transform=False)
                 for split in ("train", "val"))


def test_torch_draws_the_same_numbers_for_seeds_equal_in_their_low_32_bits():
    """The rule the seeds below are held to."""
    def draw(seed):
        return torch.randn(8, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(5), draw(5 + (1 << 32))) and not torch.equal(draw(5), draw(6))


def test_no_two_images_of_any_splits_share_the_low_32_bits_of_their_seeds():
    """Every split seed against the indices that collided before (1_000_003 + i of train with i of val) and the
    ends of the index range."""
    from data.synthetic import SPLIT_SEEDS, image_seed

    indices = [0, 1, 7, 1_000_002, 1_000_003, 1_000_003 + 7, 2_000_006, MOST - 1]
    seeds = [image_seed(split, i) & LOW_32 for split in range(SPLIT_SEEDS) for i in indices]
    assert len(set(seeds)) == len(seeds)
    assert image_seed(0, 1_000_003 + 7) & LOW_32 != image_seed(1, 7) & LOW_32


def test_train_images_past_the_millionth_are_not_val_images():
    """The reviewer's case: a train split of 1.1 M images (drawn lazily) and the default val split."""
    train, val = splits(1_100_000)
    for i in (0, 7, 511):
        assert not torch.equal(train[1_000_003 + i][0], val[i][0])
        assert not torch.equal(train[i][0], val[i][0])


def test_a_train_image_is_randn_under_the_seed_of_its_index():
    train, _ = splits(64, img_size=5)
    for i in (0, 9, 63):
        want = torch.randn(3, 5, 5, generator=torch.Generator().manual_seed(i))
        assert torch.equal(train[i][0], want) and train[i][1] == i


@pytest.mark.parametrize("setting", ["data.synthetic_train_size", "data.synthetic_val_size"])
def test_a_split_of_more_images_than_seeds_is_refused_naming_the_setting(setting):
    sizes = {"data.synthetic_train_size": 64, "data.synthetic_val_size": 64, setting: MOST + 1}
    with pytest.raises(DataError, match=rf"{MOST + 1} synthetic images in one split: .*set .*{setting}.* at "
                                        rf"most {MOST}") as refused:
        splits(sizes["data.synthetic_train_size"], sizes["data.synthetic_val_size"])
    assert "\n" not in str(refused.value)
    assert len(SyntheticDataset(MOST, 4, 10)) == MOST  # the largest split is taken
