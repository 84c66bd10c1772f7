"""Training splits given as MMEngine / MMDetection dataset wrappers (RepeatDataset, ClassBalancedDataset,
MultiImageMixDataset, ConcatDataset): the images quantization draws from them (engine/detection/feeds.py), the
overrides of their inner datasets an evaluation refuses because its pipelines do not read them
(evaluate_detection.evaluation_reads), and a wrapped test split (its pipeline, --max-images).

Marked `detection`: they need MMDetection with full mmcv (scripts/install_mmcv.sh).
"""
from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from detection_runs import SAMPLE_CONFIG

pytestmark = pytest.mark.detection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the sample's training dataset, once in a ConcatDataset of a RepeatDataset of a ClassBalancedDataset, once bare
NESTED = """_base_ = [{base!r}]
train_dataloader = dict(dataset=dict(_delete_=True, type="ConcatDataset", datasets=[
    dict(type="RepeatDataset", times=2, dataset=dict(type="ClassBalancedDataset", oversample_thr=0.9,
                                                    dataset={{{{_base_.train_dataloader.dataset}}}})),
    {{{{_base_.train_dataloader.dataset}}}}]))
"""


def _wrapped(cfg, kind):
    """`cfg` with its training dataset wrapped as `kind` (the wrapper's own settings as a config would give them)."""
    inner = copy.deepcopy(cfg.train_dataloader.dataset)
    if kind == "RepeatDataset":
        outer = dict(type=kind, times=3, dataset=inner)
    elif kind == "ClassBalancedDataset":
        outer = dict(type=kind, oversample_thr=0.9, dataset=inner)  # repeats the images of the rarer class
    elif kind == "MultiImageMixDataset":  # the loading transforms inside, the rest on the mixed images
        pipeline = inner.pop("pipeline")
        inner["pipeline"], outer = pipeline[:2], dict(type=kind, dataset=inner, pipeline=pipeline[2:])
    else:
        outer = dict(type="RepeatDataset", times=2, dataset=dict(type="ClassBalancedDataset", oversample_thr=0.9,
                                                                   dataset=inner))
    cfg.train_dataloader.dataset = outer
    return cfg


def _split_images(sample, name="train2017"):
    with open(os.path.join(sample, "annotations", f"instances_{name}.json")) as f:
        return {image["id"] for image in json.load(f)["images"]}


@pytest.mark.parametrize("kind", ["RepeatDataset", "ClassBalancedDataset", "MultiImageMixDataset", "nested"])
def test_a_wrapped_training_split_gives_each_of_its_images_once_with_the_test_pipeline(sample, kind):
    """A wrapper that repeats or mixes its dataset's images (3 times, by class frequency, mosaic) is the same
    training split to draw calibration images from: its 8 images, each once and as the test pipeline makes it. The
    repeats counted 24 (12) images, so that --calib-images 24 drew 8 images three times each, and a
    MultiImageMixDataset failed with a KeyError traceback on the first image drawn."""
    from engine.detection import DetectionError, TrainingImages, load_config
    from mmdet.registry import TRANSFORMS
    cfg = _wrapped(load_config([SAMPLE_CONFIG], data_root=sample), kind)
    images = TrainingImages(cfg)
    ids = _split_images(sample)
    assert len(images) == len(ids) == 8
    indices, samples = images.draw(8, 0, "--calib-images")
    assert sorted(s["data_samples"].img_id for s in samples) == sorted(ids)
    with pytest.raises(DetectionError, match=r"^--calib-images 9: the training split has only 8 images"):
        images.check(9, "--calib-images")
    # each image is what the config's test transforms, built here one by one, make of the file
    transforms = [TRANSFORMS.build(t) for t in copy.deepcopy(cfg.test_dataloader.dataset.pipeline)]
    root = os.path.join(sample, "train2017")
    for got in samples:
        expected = {"img_path": got["data_samples"].img_path, "img_id": got["data_samples"].img_id,
                    "instances": []}
        assert os.path.dirname(expected["img_path"]) == root
        for transform in transforms:
            expected = transform(expected)
        assert torch.equal(got["inputs"], expected["inputs"])
        assert got["data_samples"].metainfo["scale_factor"] == expected["data_samples"].metainfo["scale_factor"]
        assert got["data_samples"].metainfo.get("flip") in (None, False)


def test_the_datasets_a_concat_dataset_joins_are_drawn_from_all_and_whole(sample):
    """A ConcatDataset training split is the images of every dataset it joins (here train2017's 8 and val2017's 4),
    each dataset whole: an `indices` of an inner dataset, which the evaluation refuses as an override, is dropped
    as the outer one is (it kept 2 of the 8 images)."""
    from engine.detection import TrainingImages, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    train = copy.deepcopy(cfg.train_dataloader.dataset)
    train["indices"] = [0, 1]
    val = copy.deepcopy(cfg.test_dataloader.dataset)
    cfg.train_dataloader.dataset = dict(type="ConcatDataset", datasets=[train, val])
    images = TrainingImages(cfg)
    assert len(images) == 12
    _, samples = images.draw(12, 0, "--calib-images")
    drawn = {(os.path.basename(os.path.dirname(s["data_samples"].img_path)), s["data_samples"].img_id)
             for s in samples}
    assert drawn == ({("train2017", i) for i in _split_images(sample)}
                     | {("val2017", i) for i in _split_images(sample, "val2017")})


def _nested_config(tmp_path):
    path = tmp_path / "nested.py"
    path.write_text(NESTED.format(base=os.path.join(ROOT, SAMPLE_CONFIG)))
    return str(path)


INNER = "train_dataloader.dataset.datasets.0.dataset.dataset"  # the CocoDataset under both wrappers


@pytest.mark.parametrize("pipelines, override, unread, instead", [
    (["percentile"], f"{INNER}.pipeline=[]", f"{INNER}.pipeline", "give test_dataloader.dataset.pipeline instead"),
    (["repq"], f"{INNER}.pipeline.2.scale=(32,32)", f"{INNER}.pipeline", "give test_dataloader.dataset.pipeline"),
    (["aphq"], "train_dataloader.dataset.datasets.1.pipeline=[]", "train_dataloader.dataset.datasets.1.pipeline",
     "give test_dataloader.dataset.pipeline"),
    (["repq", "aphq"], "train_dataloader.dataset.datasets.1.indices=[0]",
     "train_dataloader.dataset.datasets.1.indices", "drop it"),
    (["repq"], f"{INNER}.indices=[0]", f"{INNER}.indices", "drop it"),
    (["percentile"], "train_dataloader.dataset.datasets.0.times=5", "train_dataloader.dataset.datasets.0.times",
     "drop it"),
    (["aphq"], "train_dataloader.dataset.datasets.0.dataset.oversample_thr=0.5",
     "train_dataloader.dataset.datasets.0.dataset.oversample_thr", "drop it"),
    (["repq"], f"{INNER}.max_refetch=5", f"{INNER}.max_refetch", "drop it")])  # the draw refuses a dropped image
def test_evaluation_refuses_settings_of_wrapped_training_datasets_its_pipelines_do_not_read(mmdet_ready, tmp_path,
                                                                                            pipelines, override,
                                                                                            unread, instead):
    """Percentile, RepQ-ViT and APHQ give every dataset a wrapper holds the test pipeline, whole, and take its images
    once each (TrainingImages): an override of an inner dataset's pipeline or indices, or of a wrapper's repeats,
    was accepted and changed nothing, as the same override of an unwrapped dataset is refused for."""
    from engine.detection import DetectionError, load_config, parse_overrides
    from evaluate_detection import evaluation_reads
    key = override.split("=")[0]
    with pytest.raises(DetectionError, match=rf"^override {re.escape(key)}: .*test pipeline.* does not read "
                                             rf"{re.escape(unread)}, so it would change nothing; {instead}"):
        load_config([_nested_config(tmp_path)], parse_overrides([override]), reads=evaluation_reads(pipelines))


@pytest.mark.parametrize("pipelines, override", [
    (["percentile"], "train_dataloader.dataset.datasets.1.ann_file=annotations/instances_val2017.json"),  # images
    (["repq"], f"{INNER}.filter_cfg.min_size=4"),  # which images the split keeps
    (["gplq"], f"{INNER}.pipeline.2.scale=(32,32)"),  # GPLQ's stage 1 trains with the training pipeline
    (["gplq", "repq"], "train_dataloader.dataset.datasets.0.times=5"),  # and its loader's repeats
    (["gplq"], f"{INNER}.max_refetch=5")])  # and its refetches of images the training pipeline drops
def test_evaluation_takes_settings_of_wrapped_training_datasets_a_pipeline_reads(mmdet_ready, tmp_path, pipelines,
                                                                                 override):
    from engine.detection import load_config, parse_overrides
    from evaluate_detection import evaluation_reads
    (key, value), = parse_overrides([override]).items()
    cfg = load_config([_nested_config(tmp_path)], {key: value}, reads=evaluation_reads(pipelines))
    node = cfg
    for part in key.split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    assert node == value


def test_an_image_a_concat_dataset_joins_twice_is_drawn_once(sample):
    """One dataset given twice in a ConcatDataset (to oversample it) is its 8 images: each drawn and counted once (the
    16 entries let --calib-images 16 put every image in the calibration batch twice)."""
    from engine.detection import DetectionError, TrainingImages, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    train = copy.deepcopy(cfg.train_dataloader.dataset)
    cfg.train_dataloader.dataset = dict(type="ConcatDataset", datasets=[train, dict(type="RepeatDataset", times=2,
                                                                                      dataset=copy.deepcopy(train))])
    images = TrainingImages(cfg)
    assert len(images) == 8
    for seed in range(3):
        _, samples = images.draw(5, seed, "--calib-images")
        assert len({s["data_samples"].img_id for s in samples}) == 5
    _, samples = images.draw(8, 0, "--calib-images")
    assert sorted(s["data_samples"].img_id for s in samples) == sorted(_split_images(sample))
    with pytest.raises(DetectionError, match=r"^--calib-images 9: the training split has only 8 images"):
        images.draw(9, 0, "--calib-images")


def test_an_evaluation_refuses_more_calibration_images_than_a_wrapped_split_has_before_any_work(sample, tmp_path):
    """The nested wrappers' split is the sample's 8 training images (its entries: 8 * 2 * repeats + 8): --calib-images 9
    is refused before the full-precision score, and nothing is written."""
    from engine.detection import DetectionError, load_config
    from evaluate_detection import main
    from mmdet.registry import MODELS
    weights = tmp_path / "random.pth"
    torch.save({"state_dict": MODELS.build(load_config([SAMPLE_CONFIG]).model).state_dict(),
                "meta": {"dataset_meta": {"classes": ("box", "disc")}}}, weights)
    out = tmp_path / "x.json"
    with pytest.raises(DetectionError, match=r"^--calib-images 9: the training split has only 8 images"):
        main(["--config", _nested_config(tmp_path), "--checkpoint", str(weights), "--data-root", sample,
              "--quant", "percentile", "--calib-images", "9", "--out", str(out), "--device", "cpu"])
    assert not out.exists()


def _wrapped_test_split(cfg, second_pipeline=None):
    """`cfg` with its test dataset in a ConcatDataset (twice; the second with `second_pipeline` if given)."""
    first, second = copy.deepcopy(cfg.test_dataloader.dataset), copy.deepcopy(cfg.test_dataloader.dataset)
    if second_pipeline is not None:
        second["pipeline"] = second_pipeline
    cfg.test_dataloader = dict(cfg.test_dataloader, dataset=dict(type="ConcatDataset", datasets=[first, second]))
    return cfg


def test_the_training_images_get_the_pipeline_of_a_wrapped_test_split(sample):
    """A test split in a ConcatDataset has no pipeline of its own: the training images get that of the datasets it
    joins (a KeyError traceback before, after the detector was built); datasets of different test pipelines have no
    one to give, and are one error line naming them."""
    from engine.detection import DetectionError, TrainingImages, load_config, pipeline_of_test_split
    plain = load_config([SAMPLE_CONFIG], data_root=sample)
    expected = [dict(t) for t in plain.test_dataloader.dataset.pipeline]
    cfg = _wrapped_test_split(copy.deepcopy(plain))
    assert [dict(t) for t in pipeline_of_test_split(cfg)] == expected
    got, = TrainingImages(cfg).draw(1, 0, "--calib-images")[1]
    reference, = TrainingImages(plain).draw(1, 0, "--calib-images")[1]
    assert torch.equal(got["inputs"], reference["inputs"])
    other = _wrapped_test_split(copy.deepcopy(plain), expected[:1] + expected[2:])  # no Resize
    with pytest.raises(DetectionError, match=r"^test_dataloader.dataset.datasets.0.pipeline and "
                                             r"test_dataloader.dataset.datasets.1.pipeline differ"):
        TrainingImages(other)


def test_max_images_with_a_wrapped_test_split_is_one_error_line(sample):
    """MMEngine's wrappers take no `indices`: --max-images on a ConcatDataset test split failed with a TypeError
    reported as an annotation file that cannot be read."""
    from engine.detection import DetectionError, build_loader, load_config
    cfg = _wrapped_test_split(load_config([SAMPLE_CONFIG], data_root=sample))
    with pytest.raises(DetectionError, match=r"^--max-images 1: test_dataloader.dataset is a ConcatDataset, which "
                                             r"takes no indices; drop --max-images"):
        build_loader(cfg, "test", 1)
    assert len(build_loader(cfg, "test").dataset) == 2 * len(_split_images(sample, "val2017"))


def test_an_image_a_concat_dataset_joins_under_a_relative_and_an_absolute_root_is_drawn_once(sample):
    """A file is one image whichever way its folder is spelled: the sample's training dataset joined once under its
    absolute root and once under that root relative to the working folder is its 8 images (the annotation file's),
    each drawn once."""
    from engine.detection import TrainingImages, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    train = copy.deepcopy(cfg.train_dataloader.dataset)
    relative = dict(copy.deepcopy(train), data_root=os.path.join(os.path.relpath(sample), ""))
    cfg.train_dataloader.dataset = dict(type="ConcatDataset", datasets=[train, relative])
    images = TrainingImages(cfg)
    assert len(images.dataset) == 16 and len(images) == len(_split_images(sample)) == 8
    _, samples = images.draw(8, 0, "--calib-images")
    assert sorted(s["data_samples"].img_id for s in samples) == sorted(_split_images(sample))


def test_seeds_apart_by_two_to_the_32_draw_their_own_images(sample):
    """Seeds are 64-bit (configs' Seed range): a seed and that seed + 2**32 are two seeds, not one. With C(8, 3) = 56
    sets, four seeds all drawing their partner's set would mean the seed is cut to 32 bits."""
    from engine.detection import TrainingImages, load_config
    images = TrainingImages(load_config([SAMPLE_CONFIG], data_root=sample))
    assert any(images.draw(3, seed, "--calib-images")[0] != images.draw(3, seed + 2 ** 32, "--calib-images")[0]
               for seed in range(4))


MIXED = """_base_ = [{base!r}]
train_dataloader = dict(dataset=dict(_delete_=True, type="MultiImageMixDataset", pipeline=[],
                                     dataset={{{{_base_.train_dataloader.dataset}}}}))
"""


@pytest.mark.parametrize("override, unread, instead", [
    ("train_dataloader.dataset.skip_type_keys=['Resize']", "train_dataloader.dataset.skip_type_keys", "drop it"),
    ("train_dataloader.dataset.pipeline=[]", "train_dataloader.dataset.pipeline",
     "give test_dataloader.dataset.pipeline instead"),
    ("train_dataloader.dataset.dataset.pipeline=[]", "train_dataloader.dataset.dataset.pipeline",
     "give test_dataloader.dataset.pipeline instead"),
    ("train_dataloader.dataset.dataset.filter_cfg.min_size=4", None, None)])
def test_evaluation_refuses_the_mixing_settings_of_a_multi_image_mix_training_split(mmdet_ready, tmp_path, override,
                                                                                    unread, instead):
    """A MultiImageMixDataset's images are drawn unmixed with the test pipeline: which transforms skip the mixed
    images, and either pipeline, change nothing for percentile, RepQ-ViT and APHQ; which images the inner dataset
    keeps does."""
    from engine.detection import DetectionError, load_config, parse_overrides
    from evaluate_detection import evaluation_reads
    path = tmp_path / "mixed.py"
    path.write_text(MIXED.format(base=os.path.join(ROOT, SAMPLE_CONFIG)))
    (key, value), = parse_overrides([override]).items()
    if unread is None:
        cfg = load_config([str(path)], {key: value}, reads=evaluation_reads(["repq"]))
        assert cfg.train_dataloader.dataset.dataset.filter_cfg.min_size == value
        return
    with pytest.raises(DetectionError, match=rf"^override {re.escape(key)}: .* does not read {re.escape(unread)}, so "
                                             rf"it would change nothing; {instead}"):
        load_config([str(path)], {key: value}, reads=evaluation_reads(["repq"]))


def test_max_images_with_a_test_split_in_a_repeat_dataset_is_one_error_line(sample):
    """A wrapper of one dataset (RepeatDataset's `dataset`) takes no `indices` either: a TypeError before, reported as
    an annotation file that cannot be read."""
    from engine.detection import DetectionError, build_loader, load_config
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    cfg.test_dataloader = dict(cfg.test_dataloader, dataset=dict(type="RepeatDataset", times=2,
                                                                 dataset=copy.deepcopy(cfg.test_dataloader.dataset)))
    with pytest.raises(DetectionError, match=r"^--max-images 1: test_dataloader.dataset is a RepeatDataset, which "
                                             r"takes no indices; drop --max-images"):
        build_loader(cfg, "test", 1)


def test_the_training_images_get_the_pipeline_of_a_test_split_in_a_repeat_dataset(sample):
    """A wrapper of one dataset (`dataset`) has no pipeline of its own either: the training images get that of the
    dataset it wraps."""
    from engine.detection import load_config, pipeline_of_test_split
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    expected = [dict(t) for t in cfg.test_dataloader.dataset.pipeline]
    cfg.test_dataloader = dict(cfg.test_dataloader, dataset=dict(type="RepeatDataset", times=2,
                                                                 dataset=copy.deepcopy(cfg.test_dataloader.dataset)))
    assert [dict(t) for t in pipeline_of_test_split(cfg)] == expected and expected


def _mixed_test_split(cfg, wrapper_steps=None, **settings):
    """`cfg` with its test dataset in a MultiImageMixDataset: the loading transform inside, the rest (or
    `wrapper_steps`) on the wrapper, as MMDetection's mosaic recipes split them."""
    inner = copy.deepcopy(cfg.test_dataloader.dataset)
    pipeline = inner.pop("pipeline")
    inner["pipeline"] = pipeline[:1]
    steps = pipeline[1:] if wrapper_steps is None else wrapper_steps
    cfg.test_dataloader = dict(cfg.test_dataloader, dataset=dict(type="MultiImageMixDataset", dataset=inner,
                                                                 pipeline=steps, **settings))
    return cfg


def test_the_training_images_get_the_whole_pipeline_of_a_multi_image_mix_test_split(sample):
    """A MultiImageMixDataset test split runs its dataset's pipeline and then its own: the training images got the
    inner one alone (LoadImageFromFile: a dict without `inputs`, a KeyError traceback in the calibration step), where
    the scored images are resized and packed. Its skip_type_keys are left out as MMDetection leaves them out."""
    from engine.detection import TrainingImages, build_loader, load_config, pipeline_of_test_split
    plain = load_config([SAMPLE_CONFIG], data_root=sample)
    expected = [dict(t) for t in plain.test_dataloader.dataset.pipeline]
    cfg = _mixed_test_split(copy.deepcopy(plain))
    assert [dict(t) for t in pipeline_of_test_split(cfg)] == expected
    got, = TrainingImages(cfg).draw(1, 0, "--calib-images")[1]
    reference, = TrainingImages(plain).draw(1, 0, "--calib-images")[1]
    assert torch.equal(got["inputs"], reference["inputs"])
    scored = next(iter(build_loader(cfg, "test")))["inputs"][0]  # the wrapper resizes what the test loop scores
    assert scored.shape == next(iter(build_loader(plain, "test")))["inputs"][0].shape
    skipped = _mixed_test_split(copy.deepcopy(plain), skip_type_keys=["Resize"])
    kept = [t["type"] for t in expected if t["type"] != "Resize"]
    assert [t["type"] for t in pipeline_of_test_split(skipped)] == kept


def test_a_multi_image_mix_test_split_that_mixes_images_is_one_error_line(sample):
    """A mixing transform (Mosaic) of the test split's wrapper has no one-image form to give the training images;
    skipped (skip_type_keys), it is not run and not refused."""
    from engine.detection import DetectionError, load_config, pipeline_of_test_split
    plain = load_config([SAMPLE_CONFIG], data_root=sample)
    steps = [dict(type="Mosaic", img_scale=(64, 64))] + list(plain.test_dataloader.dataset.pipeline[1:])
    cfg = _mixed_test_split(copy.deepcopy(plain), steps)
    with pytest.raises(DetectionError, match=r"^test_dataloader.dataset.pipeline.0 \(Mosaic\) mixes other test "
                                             r"images .*skip_type_keys"):
        pipeline_of_test_split(cfg)
    skipped = _mixed_test_split(copy.deepcopy(plain), steps, skip_type_keys=["Mosaic"])
    assert [dict(t) for t in pipeline_of_test_split(skipped)] == [dict(t) for t in
                                                                   plain.test_dataloader.dataset.pipeline]


@pytest.mark.parametrize("concat", [False, True])
def test_a_training_image_the_test_pipeline_drops_is_one_error_line_not_another_image(sample, concat):
    """The training split is no test-mode dataset: an image its (test) pipeline drops was replaced by a random other
    one, drawn with numpy's global state up to max_refetch times, so that --calib-images 8 of the sample's 8 images
    calibrated on 2, 2, 4, 4, 4, 6, 6, 4. Here the image whose boxes are all smallest is dropped by FilterAnnotations
    and named, also where the split joins it with val2017 in a ConcatDataset (whose own dataset[i] replaces it)."""
    from engine.detection import DetectionError, TrainingImages, load_config
    with open(os.path.join(sample, "annotations", "instances_train2017.json")) as f:
        data = json.load(f)
    widest: dict = {}  # image id -> the largest min(width, height) of its boxes
    for ann in data["annotations"]:
        widest[ann["image_id"]] = max(widest.get(ann["image_id"], 0.0), min(ann["bbox"][2:]))
    (first, low), (_, second) = sorted(widest.items(), key=lambda item: item[1])[:2]
    assert low < second  # only the first is dropped
    name = next(image["file_name"] for image in data["images"] if image["id"] == first)
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    pipeline = list(cfg.test_dataloader.dataset.pipeline)  # boxes are filtered before the resize scales them
    pipeline.insert(1, dict(type="LoadAnnotations", with_bbox=True))
    pipeline.insert(2, dict(type="FilterAnnotations", min_gt_bbox_wh=((low + second) / 2,) * 2))
    cfg.test_dataloader.dataset.pipeline = pipeline
    if concat:  # train2017 first: its image is the first dropped one drawn
        cfg.train_dataloader.dataset = dict(type="ConcatDataset", datasets=[
            copy.deepcopy(cfg.train_dataloader.dataset), copy.deepcopy(cfg.test_dataloader.dataset)])
    images = TrainingImages(cfg)
    with pytest.raises(DetectionError, match=rf"^the test pipeline drops the training image .*{re.escape(name)} "):
        images.draw(len(images), 0, "--calib-images")


@pytest.mark.parametrize("split", ["train", "test"])
def test_lazy_init_of_a_split_gives_the_same_images(sample, split):
    """MMEngine's lazy_init only puts off reading the annotations to the first use: the scored images under
    --max-images and the images drawn for calibration are those of the split without it (honoured, not ignored:
    the indices --max-images sets still apply when the file is read)."""
    from engine.detection import TrainingImages, build_loader, load_config
    plain = load_config([SAMPLE_CONFIG], data_root=sample)
    lazy = copy.deepcopy(plain)
    lazy[f"{split}_dataloader"].dataset.lazy_init = True
    if split == "test":
        got = [b["data_samples"][0].img_id for b in build_loader(lazy, "test", 2)]
        assert len(got) == 1 and got == [b["data_samples"][0].img_id for b in build_loader(plain, "test", 2)]
        assert len(build_loader(lazy, "test", 2).dataset) == 2
    else:
        drawn = TrainingImages(lazy).draw(3, 1, "--calib-images")
        reference = TrainingImages(plain).draw(3, 1, "--calib-images")
        assert drawn[0] == reference[0]
        assert all(torch.equal(a["inputs"], b["inputs"]) for a, b in zip(drawn[1], reference[1]))


class _PlainImages(torch.utils.data.Dataset):
    """A training split as a plain torch Dataset (no MMEngine BaseDataset: no prepare_data, no get_data_info), as a
    project may register in mmdet's DATASETS: the sorted image files of `folder`, given `pipeline`; `drop` names a
    file whose item is None, as a pipeline that drops it returns."""

    def __init__(self, folder, pipeline, drop=None):
        from mmengine.dataset import Compose
        self.paths = sorted(os.path.join(folder, name) for name in os.listdir(folder))
        self.pipeline, self.drop = Compose(pipeline), drop

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        if os.path.basename(self.paths[index]) == self.drop:
            return None
        return self.pipeline({"img_path": self.paths[index], "img_id": index, "instances": []})


def test_a_training_split_that_is_a_plain_torch_dataset_gives_its_items(sample):
    """A registered dataset without MMEngine's prepare_data (a plain torch Dataset) failed with an AttributeError on
    the first image drawn: its items are drawn as dataset[i] gives them (each the test transforms, built here one by
    one, applied to its file), and an item that is None (its pipeline dropped the image) is one error line."""
    from engine.detection import DetectionError, TrainingImages, load_config
    from mmdet.registry import DATASETS, TRANSFORMS
    DATASETS.register_module(name="PlainTrainImages", force=True, module=_PlainImages)
    cfg = load_config([SAMPLE_CONFIG], data_root=sample)
    folder = os.path.join(sample, "train2017")
    cfg.train_dataloader.dataset = dict(type="PlainTrainImages", folder=folder)
    indices, samples = TrainingImages(cfg).draw(3, 0, "--calib-images")
    paths = sorted(os.path.join(folder, name) for name in os.listdir(folder))
    transforms = [TRANSFORMS.build(t) for t in copy.deepcopy(cfg.test_dataloader.dataset.pipeline)]
    assert len(samples) == 3 == len(set(indices))
    for index, got in zip(indices, samples):
        expected = {"img_path": paths[index], "img_id": index, "instances": []}
        for transform in transforms:
            expected = transform(expected)
        assert got["data_samples"].img_path == paths[index]
        assert torch.equal(got["inputs"], expected["inputs"])
    cfg.train_dataloader.dataset = dict(type="PlainTrainImages", folder=folder,
                                        drop=os.path.basename(paths[indices[0]]))
    with pytest.raises(DetectionError, match=rf"^the test pipeline drops training image {indices[0]} of the "
                                             r"_PlainImages dataset \(its item is None\)"):
        TrainingImages(cfg).draw(3, 0, "--calib-images")
