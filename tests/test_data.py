"""Data: the digits split, folder data sets and their errors, seeded samplers, sharded evaluation."""
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DistributedSampler

from configs import load_config
from data import DataError, build_dataset, build_loaders, calibration_images
from data.digits import DigitsDataset
from data.samplers import SeededSampler, ShardedEvalSampler
from tests.conftest import DEMO_CONFIG


def test_digits_split_is_stratified_disjoint_and_fixed():
    train, val = DigitsDataset("train"), DigitsDataset("val")
    assert len(train) + len(val) == 1797 and len(val) == 360
    assert set(np.bincount(val.targets)) <= {35, 36, 37}  # stratified: ~36 of each digit
    as_bytes = lambda ds: {img.tobytes() for img in ds.images}
    assert len(as_bytes(train) & as_bytes(val)) < 5  # (the raw set holds a few duplicate images)
    assert DigitsDataset("val").targets == val.targets
    assert val.images[0].size == (32, 32) and val.images[0].mode == "RGB"


def test_seeded_sampler_resumes_mid_epoch_with_the_same_samples_and_seeds():
    base = DistributedSampler(range(50), num_replicas=1, rank=0, shuffle=True, seed=3)
    sampler = SeededSampler(base, seed=3, rank=0)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start=20)
    assert list(sampler) == full[20:]
    assert len(sampler) == 30
    sampler.set_epoch(3)
    assert [i for i, _ in sampler] != [i for i, _ in full]  # a new epoch reshuffles


def test_a_resume_position_at_or_past_the_end_of_the_epoch_leaves_nothing_to_read():
    """set_epoch(epoch, start=k) with k at or past the epoch's 10 samples (by hand): no sample and a length of
    0, not a negative length (a DataLoader refuses one)."""
    base = DistributedSampler(range(10), num_replicas=1, rank=0, shuffle=True, seed=3)
    sampler = SeededSampler(base, seed=3, rank=0)
    for start in (10, 13):
        sampler.set_epoch(1, start=start)
        assert list(sampler) == [] and len(sampler) == 0


def test_augmentation_does_not_depend_on_the_number_of_workers():
    cfg = load_config([DEMO_CONFIG], ["data.auto_augment=rand-m9-mstd0.5-inc1", "data.reprob=0.5"]).data
    batches = {}
    for workers in (0, 2):
        cfg.num_workers = workers
        loaders = build_loaders(cfg, img_size=32, batch_size_per_gpu=16, eval_batch_size_per_gpu=16, rank=0,
                                world_size=1, seed=0, num_classes=10)
        loaders.train.sampler.set_epoch(1)
        it = iter(loaders.train.loader)
        batches[workers] = [next(it) for _ in range(3)]
    for (x0, y0), (x2, y2) in zip(batches[0], batches[2]):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)


def test_sharded_evaluation_counts_every_image_once():
    shards = [list(ShardedEvalSampler(103, rank, 4)) for rank in range(4)]
    assert sorted(sum(shards, [])) == list(range(103))


def test_calibration_images_are_fixed_by_the_seed():
    cfg = load_config([DEMO_CONFIG]).data
    a = calibration_images(cfg, img_size=32, num_classes=10, count=8, seed=0)
    b = calibration_images(cfg, img_size=32, num_classes=10, count=8, seed=0)
    c = calibration_images(cfg, img_size=32, num_classes=10, count=8, seed=1)
    assert a.shape == (8, 3, 32, 32) and torch.equal(a, b) and not torch.equal(a, c)


def make_image_folder(root, classes=("cat", "dog"), per_class=3):
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(np.random.randint(0, 255, (40, 48, 3), dtype=np.uint8)).save(
                    root / split / c / f"{i}.png")


def test_image_folders_load_with_the_deit_pipeline(tmp_path):
    make_image_folder(tmp_path)
    cfg = load_config(None, [f"data.root={tmp_path}"]).data
    train = build_dataset(cfg, "train", img_size=32, num_classes=2, train_transform=True)
    val = build_dataset(cfg, "val", img_size=32, num_classes=2, train_transform=False)
    x, y = train[0]
    assert x.shape == (3, 32, 32) and y in (0, 1) and len(val) == 6


@pytest.mark.parametrize("layout, message", [
    ("missing", "does not exist"), ("no_split", "no 'train' split"), ("no_classes", "no class sub-folders"),
    ("no_images", "hold no images"), ("wrong_classes", "has 2 classes but model.num_classes=5"),
])
def test_malformed_folders_are_clear_errors(tmp_path, layout, message):
    root, classes = tmp_path / "data", 5
    if layout == "no_split":
        (root / "training").mkdir(parents=True)
    elif layout == "no_classes":
        (root / "train").mkdir(parents=True)
    elif layout == "no_images":
        (root / "train" / "cat").mkdir(parents=True)
        (root / "train" / "cat" / "notes.txt").write_text("x")
    elif layout == "wrong_classes":
        make_image_folder(root)
    cfg = load_config(None, [f"data.root={root}"]).data
    with pytest.raises(DataError, match=message):
        build_dataset(cfg, "train", img_size=32, num_classes=classes, train_transform=True)


@pytest.mark.parametrize("extra, message", [("emu", "class folder\\(s\\) emu hold no images"),
                                            (".ipynb_checkpoints", "1 image\\(s\\) outside a class folder")])
def test_an_empty_or_a_hidden_class_folder_is_refused(tmp_path, extra, message):
    """An empty class folder (timm makes no class of it) or images in a hidden one (timm makes a class of it)
    would shift every later label: both refused."""
    make_image_folder(tmp_path)
    (tmp_path / "train" / extra).mkdir()
    if extra.startswith("."):
        Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "train" / extra / "0.png")
    cfg = load_config(None, [f"data.root={tmp_path}"]).data
    with pytest.raises(DataError, match=message):
        build_dataset(cfg, "train", img_size=32, num_classes=2, train_transform=True)


def test_empty_root_and_odd_mixup_batch_are_clear_errors():
    with pytest.raises(DataError, match="data.root is empty"):
        build_dataset(load_config(None).data, "train", img_size=32, num_classes=1000, train_transform=True)
    cfg = load_config(None, ["data.dataset=synthetic"]).data  # mixup/cutmix on by default (DeiT)
    with pytest.raises(DataError, match="must be even"):
        build_loaders(cfg, img_size=32, batch_size_per_gpu=7, eval_batch_size_per_gpu=8, rank=0, world_size=1,
                      seed=0, num_classes=4)


def test_randaugment_posterize_at_full_magnitude_works():
    """rand-m9-mstd0.5-inc1 reaches magnitude 10, where timm's increasing posterize keeps 0 bits (Pillow 13
    refuses that: requirements.txt pins pillow<13)."""
    from timm.data.auto_augment import AugmentOp

    img = Image.fromarray(np.random.randint(0, 255, (16, 16, 3), dtype=np.uint8))
    out = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)(img)
    assert np.asarray(out).max() == 0  # no bits kept: a black image


def test_repeated_augmentation_follows_the_seed_and_sends_repeats_to_different_ranks():
    from timm.data.distributed_sampler import RepeatAugSampler

    def order(seed, rank, world=2, repeats=2):
        sampler = SeededSampler(
            RepeatAugSampler(range(600), num_replicas=world, rank=rank, num_repeats=repeats),
            seed=seed, rank=rank)
        sampler.set_epoch(3)
        return [i for i, _ in sampler]

    assert order(0, 0) != order(1, 0)  # train.seed changes the sample order (timm seeds by epoch alone)
    rank0, rank1 = order(5, 0), order(5, 1)
    # one shared permutation per epoch on every rank: the two copies of an image go to the two ranks
    assert len(set(rank0)) == len(rank0) and len(set(rank1)) == len(rank1)
    assert len(set(rank0) & set(rank1)) > 0.9 * len(rank0)


def test_class_folders_that_sort_as_one_name_are_refused(tmp_path):
    # timm orders classes by natural_key (lower case, numbers as numbers): a tie's order follows the hash seed,
    # so two processes could give the same folder different labels
    from data.folder import build_folder_dataset
    make_image_folder(tmp_path, classes=("a", "A", "b"), per_class=1)
    with pytest.raises(DataError, match=r"class folders (a, A|A, a) sort as one name"):
        build_folder_dataset(str(tmp_path), "train")


def test_class_names_are_in_label_order_which_is_timm_s_natural_order(tmp_path):
    # timm numbers class folders by natural_key (c2 before c10, as numbers); the names a checkpoint stores must
    # follow the labels, not a plain string sort (c10 before c2), or every name after c1 would be another class's.
    # Reference: the folder each image was read from, against the name class_names gives its label
    import os
    from data.folder import build_folder_dataset, class_names
    make_image_folder(tmp_path, classes=("c10", "c2", "c1"), per_class=1)
    dataset = build_folder_dataset(str(tmp_path), "val")
    names = class_names(dataset)
    assert names == ["c1", "c2", "c10"]
    for i in range(len(dataset)):
        folder = os.path.basename(os.path.dirname(dataset.filename(i, absolute=True)))
        assert names[int(dataset[i][1])] == folder


def test_a_tar_split_names_its_classes(tmp_path):
    import tarfile
    from data.folder import build_folder_dataset, class_names
    make_image_folder(tmp_path / "src", classes=("cat", "dog"), per_class=2)
    with tarfile.open(tmp_path / "val.tar", "w") as tar:
        tar.add(tmp_path / "src" / "val", arcname=".")
    dataset = build_folder_dataset(str(tmp_path), "val")
    labels = {int(dataset[i][1]) for i in range(len(dataset))}
    assert class_names(dataset) == ["cat", "dog"] and sorted(labels) == [0, 1]
    # what a resumed run must find again (train.py): the members' names, as tarfile lists them
    import hashlib
    from data.folder import folder_fingerprint
    with tarfile.open(tmp_path / "val.tar") as tar:
        names = sorted(m.name for m in tar if m.isfile())
    assert folder_fingerprint(dataset) == {"images": 4, "names_sha256": hashlib.sha256("\n".join(names).encode())
                                           .hexdigest()}


def test_the_fingerprint_of_a_tar_of_class_tars_names_each_image_with_its_class(tmp_path):
    """ImageNet's train tar holds one tar per class, whose members are bare file names: each name is hashed after
    its class tar's (the same file names in two classes are two images). A name the locale cannot decode (bytes
    of Latin-1 under UTF-8) is hashed as its bytes, not refused in a traceback."""
    import hashlib
    import io
    import os
    import tarfile
    from data.folder import build_folder_dataset, folder_fingerprint
    make_image_folder(tmp_path / "src", classes=("cat", "dog"), per_class=2)
    raw = os.fsdecode(b"caf\xe9.png")  # a lone surrogate under a UTF-8 locale
    os.rename(tmp_path / "src" / "val" / "dog" / "1.png", tmp_path / "src" / "val" / "dog" / raw)
    with tarfile.open(tmp_path / "val.tar", "w") as outer:
        for c in ("cat", "dog"):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for f in sorted(os.listdir(tmp_path / "src" / "val" / c)):
                    tar.add(tmp_path / "src" / "val" / c / f, arcname=f)
            info = tarfile.TarInfo(f"{c}.tar")
            info.size = inner.tell()
            inner.seek(0)
            outer.addfile(info, inner)
    dataset = build_folder_dataset(str(tmp_path), "val")
    names = sorted(["cat.tar/0.png", "cat.tar/1.png", "dog.tar/0.png", f"dog.tar/{raw}"])
    expected = hashlib.sha256("\n".join(names).encode("utf-8", "surrogateescape")).hexdigest()
    assert folder_fingerprint(dataset) == {"images": 4, "names_sha256": expected}
    folder = build_folder_dataset(str(tmp_path / "src"), "val")  # the folder it came from: no traceback either
    assert folder_fingerprint(folder)["images"] == 4


def test_loaders_pin_memory_only_in_a_process_that_uses_its_gpu(monkeypatch):
    """train.device=cpu on a GPU machine: pinning would open a CUDA context on GPU 0 in every rank."""
    from configs.schema import DataConfig
    from data.loader import _worker_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    for used, pinned in ((False, False), (True, True)):
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: used)
        assert _worker_args(DataConfig(num_workers=0))["pin_memory"] is pinned
    assert _worker_args(DataConfig(num_workers=0, pin_memory=False))["pin_memory"] is False


def test_digits_images_are_sklearns_digits_upscaled_with_their_own_labels():
    """Every (image, label) of both splits is an sklearn digit, its 0..16 levels scaled to 0..255 and upscaled
    bicubically to 32 x 32, with that digit's label; the two splits hold every digit once."""
    from collections import Counter

    from sklearn.datasets import load_digits

    raw = load_digits()
    labels_of = {}
    for image, label in zip(raw.images, raw.target):
        levels = np.round(image * 255 / 16).astype(np.uint8)
        key = Image.fromarray(levels).resize((32, 32), Image.BICUBIC).convert("RGB").tobytes()
        labels_of.setdefault(key, set()).add(int(label))
    train, val = DigitsDataset("train"), DigitsDataset("val")
    for split in (train, val):
        for image, label in zip(split.images, split.targets):
            assert label in labels_of.get(image.tobytes(), ())
    assert Counter(train.targets + val.targets) == Counter(raw.target.tolist())


def test_sample_seeds_differ_between_epochs_ranks_and_positions():
    """A sample's augmentation seed is a function of (seed, epoch, global position): no two samples of two
    epochs on two ranks share one, so no position repeats its augmentation across epochs or ranks."""
    seeds = []
    for epoch in (0, 1):
        for rank in (0, 1):
            sampler = SeededSampler(DistributedSampler(range(40), num_replicas=2, rank=rank, seed=3), seed=3,
                                    rank=rank)
            sampler.set_epoch(epoch)
            seeds += [seed for _, seed in sampler]
    assert len(seeds) == 80 and len(set(seeds)) == 80


@pytest.mark.parametrize("repeated", [False, True])
def test_a_samples_seed_is_the_same_under_any_number_of_processes(repeated):
    """Two ranks' (index, seed) streams, dealt round-robin, are the one-process stream: the same sample at the same
    global position gets the same augmentation (LM window offset) whatever the process count (an independent
    reference: the 1-process sampler itself)."""
    from timm.data.distributed_sampler import RepeatAugSampler

    def stream(rank, world):
        base = (RepeatAugSampler(range(512), num_replicas=world, rank=rank, num_repeats=3) if repeated else
                DistributedSampler(range(40), num_replicas=world, rank=rank, seed=3))
        sampler = SeededSampler(base, seed=3, rank=rank)
        sampler.set_epoch(2)
        return list(sampler)

    one, ranks = stream(0, 1), [stream(r, 2) for r in (0, 1)]
    dealt = [pair for both in zip(*ranks) for pair in both]
    assert dealt == one[:len(dealt)] and len(dealt) >= len(one) - 1


def test_mixup_cutmix_and_the_transforms_take_the_configured_settings():
    """data.mixup / cutmix / mixup_prob / mixup_switch_prob / mixup_mode / label_smoothing reach timm's Mixup,
    and scale / ratio / hflip / reprob / crop_pct the transforms (eval: resize to floor(img_size / crop_pct))."""
    from timm.data.random_erasing import RandomErasing
    from torchvision import transforms as T

    from data.loader import build_mixup
    from data.transforms import build_transform

    cfg = load_config([DEMO_CONFIG], ["data.mixup=0.3", "data.cutmix=0.7", "data.mixup_prob=0.6",
                                      "data.mixup_switch_prob=0.2", "data.mixup_mode=elem", "data.label_smoothing=0.05",
                                      "data.scale=[0.3, 0.9]", "data.ratio=[0.5, 2.0]", "data.hflip=0.2",
                                      "data.reprob=0.4", "data.crop_pct=0.8"]).data
    mixup = build_mixup(cfg, num_classes=7)
    assert (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.mix_prob, mixup.switch_prob, mixup.mode,
            mixup.label_smoothing, mixup.num_classes) == (0.3, 0.7, 0.6, 0.2, "elem", 0.05, 7)
    cfg.mixup = 0.0  # cutmix alone is still on; both off is no mixing at all
    assert build_mixup(cfg, num_classes=7).cutmix_alpha == 0.7
    cfg.cutmix = 0.0
    assert build_mixup(cfg, num_classes=7) is None
    train = {type(t).__name__: t for t in build_transform(cfg, 32, is_training=True).transforms}
    crop = train["RandomResizedCropAndInterpolation"]
    assert tuple(crop.scale) == (0.3, 0.9) and tuple(crop.ratio) == (0.5, 2.0)
    assert train["RandomHorizontalFlip"].p == 0.2
    assert next(t for t in train.values() if isinstance(t, RandomErasing)).probability == 0.4
    evaluation = build_transform(cfg, 32, is_training=False).transforms
    resize = next(t for t in evaluation if isinstance(t, T.Resize))
    assert resize.size in (40, [40], (40, 40))  # floor(32 / 0.8)


@pytest.mark.parametrize("repeated_aug", [0, 2, 3])
def test_the_training_order_follows_train_seed_and_data_repeated_aug(repeated_aug):
    """Another train.seed deals the images in another order, and data.repeated_aug=k shows each image k times
    an epoch (DeiT's repeated augmentation; 0 or 1: once)."""
    from collections import Counter

    from data.loader import build_train_loader

    def order(seed):
        cfg = load_config([DEMO_CONFIG], [f"data.repeated_aug={repeated_aug}"]).data
        batches = build_train_loader(cfg, img_size=32, batch_size_per_gpu=8, rank=0, world_size=1, seed=seed,
                                     num_classes=10)
        batches.sampler.set_epoch(0)
        return [index for index, _ in batches.sampler]

    first = order(0)
    assert order(1) != first
    # the epoch's last image may be cut short of its k copies
    assert Counter(Counter(first).values()).most_common(1)[0][0] == max(repeated_aug, 1)


def test_seed_all_seeds_every_global_generator_as_documented(monkeypatch):
    import random

    from engine.rng import mix_seed, seed_all
    seed = 2 ** 40 + 2 ** 31 + 7  # numpy takes it modulo 2^32 (bit 31 set: not modulo 2^31)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.random.default_generator.manual_seed(seed)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    cuda_seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", cuda_seeds.append)
    for cuda in (False, True):
        seed_all(seed, cuda=cuda)
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
        assert cuda_seeds == ([seed] if cuda else [])  # data workers leave the CUDA generators alone
    seeds = {mix_seed(a, b) for a in range(40) for b in range(40)}
    assert len(seeds) == 1600 and all(0 <= s < 2 ** 63 for s in seeds)  # distinct, 63-bit
    assert mix_seed(1, 2) != mix_seed(2, 1) and mix_seed(3) == mix_seed(3)


def test_mix_seed_is_the_documented_splitmix64_variant():
    """engine.rng.mix_seed as its docstring gives it, written out with numpy's wrapping uint64 arithmetic over many
    inputs at once: start at the golden ratio 0x9E3779B97F4A7C15; per part, xor it in, multiply by 0xBF58476D1CE4E5B9,
    xorshift 27, multiply by 0x94D049BB133111EB, xorshift 31; keep the top 63 bits. The augmentation of every
    sample is seeded by it, so a run resumed on another version draws the same images only if it stays this."""
    from engine.rng import mix_seed

    rng = np.random.default_rng(0)
    parts = rng.integers(0, 2 ** 63, size=(3, 500), dtype=np.uint64)
    parts[:, :4] = [[0, 1, 2 ** 63 - 1, 7], [0, 0, 5, 2 ** 62], [0, 1, 1, 3]]
    h = np.full(500, 0x9E3779B97F4A7C15, dtype=np.uint64)
    for p in parts:
        h = (h ^ p) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h = h ^ (h >> np.uint64(31))
    want = (h >> np.uint64(1)).tolist()
    assert [mix_seed(*map(int, column)) for column in parts.T] == want


def test_a_seeded_sample_runs_under_its_seed_and_leaves_the_global_generators_as_they_were():
    """SeededDataset[(index, seed)] reads the sample with python, numpy and torch seeded by `seed`, and the caller's
    generators go on as if it had not run (with data.num_workers=0 the main process reads the samples: its own
    draws, e.g. dropout, must not restart from the last sample's seed)."""
    import random

    from data.samplers import SeededDataset

    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return random.random(), float(np.random.rand()), torch.rand(1).item()

    def reseed(seed):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    reseed(5)
    under_seed_5 = Draws()[0]
    reseed(1)
    want = Draws()[0]
    reseed(1)
    assert SeededDataset(Draws())[(0, 5)] == under_seed_5
    assert Draws()[0] == want


def _synthetic(overrides=()):
    """The data section of synthetic images (50 of them unless `overrides` set another count)."""
    given = {item.split("=", 1)[0] for item in overrides}
    size = [] if "data.synthetic_train_size" in given else ["data.synthetic_train_size=50"]
    return load_config(None, ["data.dataset=synthetic", *size, "data.repeated_aug=0", "data.num_workers=0",
                              *overrides]).data


@pytest.mark.parametrize("n, world, batch", [(12, 1, 16), (12, 5, 4), (100, 3, 40), (300, 8, 64), (600, 7, 80)])
def test_too_few_images_under_repeated_augmentation_explain_timms_epoch_by_its_own_rule(n, world, batch):
    """The refusal said timm's RepeatAugSampler "draws the set rounded down to a multiple of 256" for any set: 12
    images, which that rule would leave none of, gave the one process 12. The message's rule, evaluated, must be the
    epoch timm's sampler gives (the reference: its len, built here with its own defaults)."""
    import math
    import re

    from timm.data.distributed_sampler import RepeatAugSampler

    from data.loader import build_train_loader

    share = len(RepeatAugSampler(range(n), num_replicas=world, rank=0, num_repeats=3))
    assert share < batch  # the case refused
    with pytest.raises(DataError) as e:
        data = load_config(None, ["data.dataset=synthetic", f"data.synthetic_train_size={n}", "data.repeated_aug=3",
                                  "data.num_workers=0"]).data
        build_train_loader(data, img_size=8, batch_size_per_gpu=batch, rank=0, world_size=world, seed=0,
                           num_classes=3)
    message = str(e.value)
    assert f"give each of {world} processes {share} per epoch" in message
    (how, a, b), = re.findall(r"RepeatAugSampler gives each process [^;]*\b(floor|ceil)\((\d+) / (\d+)\) per epoch",
                              message)
    assert getattr(math, how)(int(a) / int(b)) == share and int(b) == world
    assert ("rounded down to a multiple of 256" in message) is (n >= 256)


def test_training_shards_are_one_shuffled_epoch_dealt_to_the_ranks():
    """world_size ranks share one permutation of the epoch (at train.seed 0, torch's DistributedSampler one:
    torch.randperm seeded with the epoch; other seeds' orders: tests/test_sample_order.py), cut to a multiple of
    world_size (drop_last) and dealt round-robin: no image twice in an epoch over all ranks, none left out but the
    cut."""
    from data.loader import build_train_loader

    seed, epoch, world = 0, 2, 3
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(epoch)).tolist()[:48]  # 50 // 3 * 3
    shards = []
    for rank in range(world):
        batches = build_train_loader(_synthetic(), img_size=8, batch_size_per_gpu=4, rank=rank, world_size=world,
                                     seed=seed, num_classes=3)
        batches.sampler.set_epoch(epoch)
        shards.append([index for index, _ in batches.sampler])
        assert shards[-1] == perm[rank::world]
    assert sorted(sum(shards, [])) == sorted(perm) and len(set(perm)) == 48


def test_training_batches_are_all_full_and_one_batch_per_rank_is_enough():
    """drop_last: an epoch of 50 images in batches of 8 is 6 full batches (the 2 left over wait for another
    epoch's shuffle); 8 images make one batch, 7 are refused before the run."""
    from data.loader import build_train_loader

    batches = build_train_loader(_synthetic(), img_size=8, batch_size_per_gpu=8, rank=0, world_size=1, seed=0,
                                 num_classes=3)
    batches.sampler.set_epoch(0)
    assert [len(y) for _, y in batches.loader] == [8] * 6
    one = build_train_loader(_synthetic(["data.synthetic_train_size=8"]), img_size=8, batch_size_per_gpu=8, rank=0,
                             world_size=1, seed=0, num_classes=3)
    one.sampler.set_epoch(0)
    assert [len(y) for _, y in one.loader] == [8]
    with pytest.raises(DataError, match="8 training images give each of 1 processes 8 per epoch, fewer than one "
                                        "batch of 9"):
        build_train_loader(_synthetic(["data.synthetic_train_size=8"]), img_size=8, batch_size_per_gpu=9, rank=0,
                           world_size=1, seed=0, num_classes=3)


def test_no_calibration_images_is_refused_naming_the_setting():
    with pytest.raises(DataError, match=r"^quant.calib_images=0: give at least 1 image"):
        calibration_images(load_config([DEMO_CONFIG]).data, img_size=32, num_classes=10, count=0, seed=0)


@pytest.mark.parametrize("cpus, local, want", [(64, 1, 8), (16, 2, 7), (4, 2, 1), (2, 1, 1), (3, 4, 0)])
def test_automatic_worker_count_is_the_process_share_of_its_cpus_less_one_at_most_8(monkeypatch, cpus, local, want):
    """data.num_workers=null: min(8, CPUs this process may run on // processes on this machine - 1), never
    below 0; a number given is taken as it is."""
    import os

    from data.loader import worker_count

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    assert worker_count(None) == want
    assert worker_count(3) == 3 and worker_count(0) == 0


def _deit_seeded(transform, image, seed: int):
    """`transform(image)` with Python's, NumPy's and torch's generators at `seed` (timm's RandomResizedCrop and
    RandAugment draw from `random`, RandAugment's op choice from NumPy, random erasing's pixels from torch)."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return transform(image)


def test_the_default_train_and_eval_transforms_are_deits_pixel_for_pixel():
    """The schema's default data section builds DeiT's pipelines, output for output: train as DeiT's main.py asks
    timm for it (create_transform with its arguments: color jitter 0.3, unread under a RandAugment policy, the
    rand-m9-mstd0.5-inc1 policy, bicubic, random erasing 0.25 / pixel / 1 region; timm's ImageNet mean and std), eval
    built from torchvision directly (resize the short side to int(size / 0.875), bicubic; center crop; ImageNet
    mean / std), under the same seeds, on images that are not square."""
    from timm.data import create_transform
    from torchvision import transforms as T

    from data.transforms import build_transform

    size = 64
    data = load_config(None).data
    deit_train = create_transform(size, is_training=True, color_jitter=0.3, auto_augment="rand-m9-mstd0.5-inc1",
                                  interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1)
    deit_eval = T.Compose([T.Resize(int(size / 0.875), interpolation=T.InterpolationMode.BICUBIC),
                           T.CenterCrop(size), T.ToTensor(),
                           T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))])
    train, evaluation = build_transform(data, size, is_training=True), build_transform(data, size, is_training=False)
    rng = np.random.default_rng(0)
    erased = 0
    for width, height in ((96, 80), (70, 120)):
        gradient = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
        pixels = (gradient + rng.integers(0, 60, (height, width, 3))).clip(0, 255).astype(np.uint8)
        image = Image.fromarray(pixels)
        for seed in range(16):
            want = _deit_seeded(deit_train, image, seed)
            got = _deit_seeded(train, image, seed)
            assert got.shape == want.shape == (3, size, size) and torch.equal(got, want), (width, seed)
            erased += int(not torch.equal(want, _deit_seeded(T.Compose(deit_train.transforms[:-1]), image, seed)))
        want = deit_eval(image)
        assert want.shape == (3, size, size) and torch.equal(evaluation(image), want)
    assert 0 < erased < 32  # random erasing (p 0.25) acted on some of the outputs compared, not all


def test_every_train_and_eval_transform_setting_reaches_timm():
    """data.interpolation / mean / std / remode / recount / color_jitter / auto_augment (train) and interpolation /
    mean / std / crop_mode (eval) are what the pipelines apply, not timm's defaults (bilinear is timm's own, so
    nearest is asked here)."""
    from timm.data.auto_augment import RandAugment
    from timm.data.random_erasing import RandomErasing
    from torchvision import transforms as T

    from data.transforms import build_transform

    cfg = load_config([DEMO_CONFIG], ["data.interpolation=nearest", "data.mean=[0.1, 0.2, 0.3]",
                                      "data.std=[0.4, 0.5, 0.6]", "data.remode=rand", "data.recount=3",
                                      "data.reprob=0.5", "data.color_jitter=0.2", "data.auto_augment="]).data
    cfg.crop_mode = "squash"  # a folder data set's key (the digits are square: every mode crops them alike)
    nearest = T.InterpolationMode.NEAREST

    def by_type(transform):
        return {type(t).__name__: t for t in transform.transforms}

    train = by_type(build_transform(cfg, 32, is_training=True))
    assert train["RandomResizedCropAndInterpolation"].interpolation == nearest
    assert train["ColorJitter"].brightness == (0.8, 1.2) and train["ColorJitter"].saturation == (0.8, 1.2)
    erasing = next(t for t in train.values() if isinstance(t, RandomErasing))
    assert (erasing.mode, erasing.min_count, erasing.max_count) == ("rand", 1, 3)
    for transform in (train, by_type(build_transform(cfg, 32, is_training=False))):
        assert transform["Normalize"].mean.tolist() == pytest.approx([0.1, 0.2, 0.3])
        assert transform["Normalize"].std.tolist() == pytest.approx([0.4, 0.5, 0.6])
    evaluation = build_transform(cfg, 32, is_training=False).transforms
    resize = next(t for t in evaluation if isinstance(t, T.Resize))
    assert resize.interpolation == nearest and resize.size in ((32, 32), [32, 32])  # squash: both sides, no aspect kept
    cfg.auto_augment = "rand-m9-mstd0.5-inc1"
    train = build_transform(cfg, 32, is_training=True).transforms
    assert any(isinstance(t, RandAugment) for t in train)


@pytest.mark.parametrize("jitter", [0.0, 0.1])
def test_color_jitter_reaches_the_colorjitter_of_deit3s_three_augment(jitter):
    """data.auto_augment=3a (DeiT III's 3-Augment) keeps timm's colour jitter on: the ColorJitter built holds
    data.color_jitter for brightness, contrast and saturation (torchvision: (1 - s, 1 + s), None at 0), not timm's
    0.3, and follows the 3-Augment policy."""
    from timm.data.auto_augment import AutoAugment
    from torchvision import transforms as T

    from data.transforms import build_transform

    cfg = load_config([DEMO_CONFIG], ["data.auto_augment=3a", f"data.color_jitter={jitter}"]).data
    train = build_transform(cfg, 32, is_training=True).transforms
    (jitters,) = [t for t in train if isinstance(t, T.ColorJitter)]
    want = None if jitter == 0 else (1 - jitter, 1 + jitter)
    for factor in (jitters.brightness, jitters.contrast, jitters.saturation):
        assert factor == (pytest.approx(want) if want else None)
    assert jitters.hue is None
    assert [type(t) for t in train].index(AutoAugment) < train.index(jitters)


def test_synthetic_images_follow_seed_and_index_and_labels_are_index_mod_classes():
    """Synthetic sample i is a function of (seed, i), labelled i % num_classes; val (seed 1) holds other
    images than train (seed 0)."""
    from data.synthetic import SyntheticDataset

    data = SyntheticDataset(7, 4, num_classes=3, seed=2)
    assert [data[i][1] for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert torch.equal(data[5][0], SyntheticDataset(9, 4, num_classes=3, seed=2)[5][0])
    assert not torch.equal(data[5][0], data[4][0])
    cfg = load_config(None, ["data.dataset=synthetic"]).data
    train, val = (build_dataset(cfg, split, img_size=4, num_classes=3, train_transform=False) for split in
                  ("train", "val"))
    assert not torch.equal(train[0][0], val[0][0])


def test_a_digits_split_other_than_train_or_val_is_refused_not_read_as_val():
    with pytest.raises(ValueError, match="digits has splits 'train' and 'val', not 'test'"):
        DigitsDataset("test")


def test_each_rank_of_a_distributed_evaluation_loads_its_own_share_of_the_val_set():
    """The val loader of rank r of 3 yields the images r, r + 3, ... (synthetic labels are the indices here), so
    that the ranks together score every image exactly once, not rank 0's share three times."""
    from data.loader import build_eval_loader

    cfg = _synthetic(["data.synthetic_val_size=11"])
    labels = [[int(y) for _, ys in build_eval_loader(cfg, img_size=4, batch_size_per_gpu=2, rank=rank, world_size=3,
                                                      num_classes=100) for y in ys] for rank in range(3)]
    assert labels == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]


def test_digits_takes_its_image_size_val_fraction_and_transform():
    """img_size, val_fraction and transform reach the data set: 16-px RGB images, a 10 % val split (sklearn rounds
    0.1 * 1,797 = 179.7 up to 180 test images), and each item is the transform's output with its label."""
    val = DigitsDataset("val", img_size=16, val_fraction=0.1, transform=lambda img: ("seen", img.size, img.mode))
    assert len(val) == 180 and len(DigitsDataset("train", img_size=16, val_fraction=0.1)) == 1797 - 180
    assert [val[i] for i in (0, 179)] == [(("seen", (16, 16), "RGB"), val.targets[i]) for i in (0, 179)]


def test_a_model_of_another_class_count_is_refused_for_digits():
    """digits has 10 classes: a classifier configured for 9 is refused before training, not trained on labels 0..9."""
    from configs.schema import DataConfig
    with pytest.raises(DataError, match="10"):
        build_dataset(DataConfig(dataset="digits"), "val", img_size=16, num_classes=9, train_transform=False)
    assert len(build_dataset(DataConfig(dataset="digits"), "val", img_size=16, num_classes=10,
                             train_transform=False)) == 360


@pytest.mark.parametrize("world, rank", [(1, 0), (2, 1)])
def test_repeated_augmentation_deals_each_epoch_its_own_order_of_the_runs_seed_and_the_epoch(world, rank):
    """data.repeated_aug: timm's RepeatAugSampler shuffles by the epoch number it is given, which SeededSampler
    mixes from (train.seed, epoch). Written out by hand (DeiT's RASampler): a permutation of a generator seeded
    mix_seed(seed, epoch) mod 2^31, each index repeated k times in a row, dealt round-robin to the ranks, each
    rank's first floor(n // 256 * 256 / world) kept. A seed that leaves out the epoch gave every epoch one order."""
    from timm.data.distributed_sampler import RepeatAugSampler

    from data.samplers import SeededSampler
    from engine.rng import mix_seed

    n, k, seed = 600, 3, 5
    sampler = SeededSampler(RepeatAugSampler(range(n), num_replicas=world, rank=rank, shuffle=True, num_repeats=k),
                            seed=seed, rank=rank)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append([index for index, _ in sampler])
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(seed, epoch) % 2 ** 31)).tolist()
        dealt = [i for i in perm for _ in range(k)][rank::world]
        assert orders[-1] == dealt[:n // 256 * 256 // world], epoch
    assert orders[0] != orders[1] != orders[2] != orders[0]


@pytest.mark.parametrize("val, message", [("missing", "no 'val' split"), ("empty", "val has no class sub-folders")])
def test_a_missing_or_empty_val_folder_is_refused_before_the_training_split_is_read(
        tmp_path, monkeypatch, val, message):
    """build_loaders reads the whole training split first (timm walks and sorts every file: minutes on ImageNet);
    a val split that is not there or holds no class folders is refused before that."""
    import data.loader

    make_image_folder(tmp_path)
    if val == "missing":
        (tmp_path / "val").rename(tmp_path / "held_out")
    elif val == "empty":
        for folder in (tmp_path / "val").iterdir():
            for image in folder.iterdir():
                image.unlink()
            folder.rmdir()
    read = []
    real = data.loader.build_folder_dataset
    monkeypatch.setattr(data.loader, "build_folder_dataset",
                        lambda root, split, transform=None: read.append(split) or real(root, split, transform))
    cfg = load_config(None, [f"data.root={tmp_path}", "data.dataset=folder", "data.repeated_aug=0",
                             "data.num_workers=0"]).data
    with pytest.raises(DataError, match=message):
        build_loaders(cfg, img_size=32, batch_size_per_gpu=2, eval_batch_size_per_gpu=2, rank=0, world_size=1,
                      seed=0, num_classes=2)
    assert read == []  # no split was read image by image before the refusal


@pytest.mark.parametrize("listing", [list, lambda files: list(reversed(files))])
def test_images_whose_names_sort_as_one_take_the_same_place_in_any_copy(tmp_path, monkeypatch, listing):
    # timm orders images by natural_key (lower case, numbers as numbers), which ties 1.png with 01.png and x.png with
    # X.png: left to the directory listing (ext4's follows its hash seed, so another copy lists otherwise), index i
    # would be another image on another node or after a copy, under the same fingerprint (sorted names). The
    # reference: natural_key, then the name itself, whatever order the folder lists its files in (two listings)
    import os
    from timm.data.readers import reader_image_folder
    from timm.utils.misc import natural_key
    from data.folder import build_folder_dataset
    names = ["01.png", "1.png", "2.png", "X.png", "x.png", "y.png"]
    os.makedirs(tmp_path / "val" / "a")
    for i, name in enumerate(names):
        Image.fromarray(np.full((4, 4, 3), i * 40, np.uint8)).save(tmp_path / "val" / "a" / name)
    walk = os.walk

    def listed(top, **kwargs):  # the copy's listing order
        for folder, subfolders, files in walk(top, **kwargs):
            yield folder, subfolders, listing(sorted(files))
    monkeypatch.setattr(reader_image_folder.os, "walk", listed)
    dataset = build_folder_dataset(str(tmp_path), "val")
    read = [os.path.basename(dataset.filename(i)) for i in range(len(dataset))]
    assert read == sorted(names, key=lambda name: (natural_key(name), name))
