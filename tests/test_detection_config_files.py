"""Keys of the --config files themselves (engine.detection.config check_file_keys, check_legacy_keys): a key that
the class its dict builds does not take, and MMDetection 2.x's top-level settings, are one `error:` line naming
the file and the key before the Runner is built, as the same mistake given as an override is. What a class takes
is read here from the class itself (torch's optimizers, MMEngine's loops, MMDetection's registry), and that a key
fails or is left unread from what MMEngine's code does with it.

Marked `detection`: the config's types are looked up in MMDetection's registries, which need full mmcv
(scripts/install_mmcv.sh).
"""
from __future__ import annotations

import inspect

import pytest

from detection_runs import SAMPLE_CONFIG, error_line

pytestmark = pytest.mark.detection


def _fragment(tmp_path, text: str) -> str:
    """A config file of `text`, to give after the sample config."""
    path = tmp_path / "fragment.py"
    path.write_text(text)
    return str(path)


def _takes(cls) -> set:
    """The keyword arguments of `cls`'s constructor."""
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def _registered(name: str):
    """The class MMDetection's registries build for the type `name`."""
    from mmdet.registry import DATASETS, METRICS, MODELS, TRANSFORMS
    return next(c for r in (MODELS, TRANSFORMS, METRICS, DATASETS) for c in [r.get(name)] if c is not None)


# (file text, the dotted key refused, the class that does not take it, the key it names as meant or None)
FILE_TYPOS = [
    ("optim_wrapper = dict(optimizer=dict(weight_decay=0.1, betas_=(0.9, 0.99)))\n", "optim_wrapper.optimizer.betas_",
     lambda: __import__("torch").optim.AdamW, "optim_wrapper.optimizer.betas"),
    ("train_cfg = dict(max_epoch=3)\n", "train_cfg.max_epoch",
     lambda: __import__("mmengine.runner", fromlist=["x"]).EpochBasedTrainLoop, "train_cfg.max_epochs"),
    # no type: the Runner builds the loop by by_epoch (Runner.build_train_loop), and passes it the other keys
    ("train_cfg = dict(_delete_=True, by_epoch=False, max_iter=8)\n", "train_cfg.max_iter",
     lambda: __import__("mmengine.runner", fromlist=["x"]).IterBasedTrainLoop, "train_cfg.max_iters"),
    ("val_evaluator = dict(metricc=['bbox'])\n", "val_evaluator.metricc", lambda: _registered("CocoMetric"),
     "val_evaluator.metric"),
    ("val_dataloader = dict(batch_sizes=2)\n", "val_dataloader.batch_sizes",
     lambda: __import__("torch").utils.data.DataLoader, "val_dataloader.batch_size"),
    ("train_dataloader = dict(dataset=dict(pipeline=[dict(type='LoadImageFromFile', to_float_32=True)]))\n",
     "train_dataloader.dataset.pipeline.0.to_float_32", lambda: _registered("LoadImageFromFile"),
     "train_dataloader.dataset.pipeline.0.to_float32"),
    ("model = dict(neck=dict(out_channel=32))\n", "model.neck.out_channel", lambda: _registered("FPN"),
     "model.neck.out_channels"),
    # classes whose __init__ takes **kwargs and hands them to its parent's: MMEngine's MultiStepLR (its mixin's
    # __init__(optimizer, *args, **kwargs)) builds a MultiStepParamScheduler, CocoDataset a BaseDataset
    ("param_scheduler = [dict(type='MultiStepLR', milestones=[8, 11], gama=0.5, by_epoch=True)]\n",
     "param_scheduler.0.gama", lambda: __import__("mmengine.optim", fromlist=["x"]).MultiStepParamScheduler,
     "param_scheduler.0.gamma"),
    ("train_dataloader = dict(dataset=dict(filter_cfgg=dict(min_size=8)))\n", "train_dataloader.dataset.filter_cfgg",
     lambda: __import__("mmengine.dataset", fromlist=["x"]).BaseDataset, "train_dataloader.dataset.filter_cfg"),
]


@pytest.mark.parametrize("text, key, cls, meant", FILE_TYPOS)
def test_a_config_file_key_its_class_does_not_take_is_refused_naming_the_file(mmdet_ready, tmp_path, text, key,
                                                                             cls, meant):
    """A misspelt argument in a config file (`betas_`) was passed to its class when runner.train() built it: a
    TypeError traceback after the Runner had made its log folder, or (train_cfg) an error line blaming the loaders
    and the annotation files. It is refused as the override of the same key is, naming the file."""
    from engine.detection import DetectionError, load_config
    cls, part = cls(), key.rsplit(".", 1)[1]
    assert part not in _takes(cls) and meant.rsplit(".", 1)[1] in _takes(cls)  # what the class takes
    fragment = _fragment(tmp_path, text)
    with pytest.raises(DetectionError) as refused:
        load_config([SAMPLE_CONFIG, fragment])
    message = str(refused.value)
    assert message.startswith(f"--config {fragment}: {key}: ") and f"takes no argument '{part}'" in message, message
    assert f"(did you mean {meant}" in message, message


def test_the_shipped_configs_load_with_each_method_fragment(mmdet_ready):
    """The checks of the files' keys refuse none of the shipped detector configs, alone or with a method fragment
    (their schedulers, datasets and model parts take every key they give)."""
    import glob
    import os
    from engine.detection import load_config
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    detectors = sorted(glob.glob(os.path.join(root, "configs", "detection", "*.py"))) + [SAMPLE_CONFIG]
    fragments = [None] + sorted(glob.glob(os.path.join(root, "configs", "detection", "method", "*.py")))
    assert len(detectors) >= 4 and len(fragments) >= 4
    for detector in detectors:
        for fragment in fragments:
            load_config([detector] + ([fragment] if fragment else []))


def test_a_loaders_num_batch_per_epoch_is_taken_in_a_file_and_an_override(mmdet_ready, tmp_path):
    """`num_batch_per_epoch` is no argument of torch's DataLoader, but MMEngine's Runner.build_dataloader takes it
    out and trains (or evaluates) on that many batches of the dataset: a file or an override giving it is kept."""
    import torch
    from engine.detection import load_config, parse_overrides
    from mmengine.runner import Runner
    assert "num_batch_per_epoch" not in _takes(torch.utils.data.DataLoader)
    loader = Runner.build_dataloader(dict(dataset=list(range(10)), batch_size=2, num_batch_per_epoch=2,
                                          sampler=dict(type="DefaultSampler", shuffle=False)))
    assert len(loader) == 2  # what the Runner does with it
    cfg = load_config([SAMPLE_CONFIG, _fragment(tmp_path, "train_dataloader = dict(num_batch_per_epoch=2)\n")])
    assert cfg.train_dataloader.num_batch_per_epoch == 2
    cfg = load_config([SAMPLE_CONFIG], parse_overrides(["val_dataloader.num_batch_per_epoch=1"]))
    assert cfg.val_dataloader.num_batch_per_epoch == 1


def test_the_optimizer_typo_of_a_file_is_one_error_line_before_the_work_dir_is_made(mmdet_ready, tmp_path, capsys):
    """Through train_detection.py: the reviewer's file (weight decay and a misspelt betas) fails as one line, and
    nothing is written (the Runner made its timestamped log folder before its optimizer failed)."""
    import torch
    with pytest.raises(TypeError):  # what the Runner's build of the optimizer does with the key
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], weight_decay=0.1, betas_=(0.9, 0.99))
    fragment = _fragment(tmp_path, FILE_TYPOS[0][0])
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--config", fragment, "--work-dir", str(tmp_path / "run"),
                               "train_cfg.max_epochs=1"])
    assert line.startswith(f"error: --config {fragment}: optim_wrapper.optimizer.betas_: "), line
    assert "did you mean optim_wrapper.optimizer.betas?" in line, line
    assert not (tmp_path / "run").exists()


def test_a_file_key_left_invalid_by_an_override_of_its_type_names_the_override(mmdet_ready):
    """The Swin recipe's AdamW betas under `optim_wrapper.optimizer.type=SGD`: SGD takes no betas, and the line
    names the file's key and the override that changed the type."""
    import torch
    from engine.detection import DetectionError, load_config, parse_overrides
    assert "betas" not in _takes(torch.optim.SGD)
    with pytest.raises(DetectionError) as refused:
        load_config([SAMPLE_CONFIG], parse_overrides(["optim_wrapper.optimizer.type=SGD"]))
    message = str(refused.value)
    assert message.startswith("--config ") and ("optim_wrapper.optimizer.betas (its type set by the override "
                                                "optim_wrapper.optimizer.type): SGD") in message, message


def test_a_file_key_left_invalid_by_a_later_files_type_names_that_file(mmdet_ready, tmp_path):
    """A later --config that sets `optim_wrapper.optimizer.type='SGD'` without `_delete_=True` keeps the Swin
    recipe's AdamW betas (MMEngine merges the dicts): the line names the recipe's key, the file that changed the
    type, and the way to replace the dict there; with `_delete_=True` the file passes."""
    import torch
    from engine.detection import DetectionError, load_config
    assert "betas" not in _takes(torch.optim.SGD) and "momentum" in _takes(torch.optim.SGD)
    sgd = "optim_wrapper = dict(optimizer=dict({}type='SGD', lr=0.01, momentum=0.9))\n"
    fragment = _fragment(tmp_path, sgd.format(""))
    with pytest.raises(DetectionError) as refused:
        load_config([SAMPLE_CONFIG, fragment])
    message = str(refused.value)
    assert message.startswith(f"--config {SAMPLE_CONFIG}: optim_wrapper.optimizer.betas (its type set by --config "
                              f"{fragment}; give _delete_=True there to replace the dict): SGD"), message
    cfg = load_config([SAMPLE_CONFIG, _fragment(tmp_path, sgd.format("_delete_=True, "))])
    assert cfg.optim_wrapper.optimizer.type == "SGD" and "betas" not in cfg.optim_wrapper.optimizer


def test_helper_variables_and_a_parts_own_dicts_pass_while_a_typo_beside_them_is_refused(mmdet_ready, tmp_path):
    """Top-level variables a file copies into its settings (`size`, `dims` of the sample config) are not read by
    the Runner and stay allowed, and so are keys of a model part's own dicts, which the part's code may read
    before building the rest (FCNMaskHead takes upsample_cfg.scale_factor out, where the deconv's class does not
    take it); the same file with a misspelt optimizer argument is refused."""
    from engine.detection import DetectionError, load_config
    from mmengine.runner import Runner
    helpers = ("size = 32\nmy_lr = 2e-3\nnote = dict(type='NoSuchType', anything=1)\n"
               "optim_wrapper = dict(optimizer=dict(lr=my_lr))\n"
               "model = dict(roi_head=dict(mask_head=dict(upsample_cfg=dict(type='deconv', scale_factor=2))))\n")
    assert not {"size", "my_lr", "note"} & _takes(Runner)
    assert "scale_factor" not in _takes(_registered("deconv"))
    cfg = load_config([SAMPLE_CONFIG, _fragment(tmp_path, helpers)])
    assert cfg.optim_wrapper.optimizer.lr == 2e-3 and cfg.size == 32
    with pytest.raises(DetectionError, match=r"optim_wrapper.optimizer.lrr: .*did you mean optim_wrapper.optimizer.lr"):
        load_config([SAMPLE_CONFIG, _fragment(tmp_path, helpers + "optim_wrapper = dict(optimizer=dict(lrr=1))\n")])


@pytest.mark.parametrize("key, value, successor", [
    ("lr_config", "dict(policy='step', step=[8, 11])", "param_scheduler"),
    ("optimizer_config", "dict(grad_clip=None)", "optim_wrapper"),
    ("runner", "dict(type='EpochBasedRunner', max_epochs=12)", "train_cfg"),
    ("evaluation", "dict(interval=1, metric=['bbox', 'segm'])", "val_evaluator"),
    ("checkpoint_config", "dict(interval=1)", "default_hooks.checkpoint"),
    ("log_config", "dict(interval=50, hooks=[dict(type='TextLoggerHook')])", "default_hooks.logger"),
    ("total_epochs", "12", "train_cfg.max_epochs"),
    ("workflow", "[('train', 1)]", "train_cfg")])
def test_an_mmdetection_2_setting_in_a_file_is_refused_naming_its_successor(mmdet_ready, tmp_path, key, value,
                                                                            successor):
    """MMDetection 2.x's lr_config (and the other top-level keys of its configs) trained with exit code 0, read by
    nothing, yet recorded in train_detection_config.json as a setting of the run. MMEngine's Runner reads none of
    them; the key named instead is one it reads."""
    from engine.detection import DetectionError, load_config
    from mmengine.runner import Runner
    assert key not in _takes(Runner) and successor.split(".")[0] in _takes(Runner)
    fragment = _fragment(tmp_path, f"{key} = {value}\n")
    with pytest.raises(DetectionError) as refused:
        load_config([SAMPLE_CONFIG, fragment])
    message = str(refused.value)
    assert message.startswith(f"--config {fragment}: {key} is a setting of MMDetection 2.x configs"), message
    assert f"give {successor}" in message, message


def test_a_variable_with_a_2_x_name_that_the_file_copies_into_a_setting_passes(mmdet_ready, tmp_path):
    """`total_epochs = 3` copied into train_cfg.max_epochs is a variable of the file, as `max_epochs` is: it
    passes and sets the loop's epochs. The same name left unused is 2.x's setting, refused, and so is a 2.x dict
    (checkpoint_config) even where the file copies it into the key that replaced it."""
    from engine.detection import DetectionError, load_config
    from mmengine.runner import Runner
    assert "total_epochs" not in _takes(Runner)
    copied = "total_epochs = 3\ntrain_cfg = dict(max_epochs=total_epochs)\n"
    cfg = load_config([SAMPLE_CONFIG, _fragment(tmp_path, copied)])
    assert cfg.train_cfg.max_epochs == 3
    assert load_config([SAMPLE_CONFIG]).train_cfg.max_epochs != 3  # an unused 3 below is no copy of the config's
    fragment = _fragment(tmp_path, "total_epochs = 3\n")
    with pytest.raises(DetectionError, match=rf"^--config {fragment}: total_epochs is a setting of MMDetection 2.x"):
        load_config([SAMPLE_CONFIG, fragment])
    fragment = _fragment(tmp_path, "checkpoint_config = dict(type='CheckpointHook', interval=1)\n"
                                   "default_hooks = dict(checkpoint=checkpoint_config)\n")
    with pytest.raises(DetectionError, match=rf"^--config {fragment}: checkpoint_config is a setting of MMDetection"):
        load_config([SAMPLE_CONFIG, fragment])


def test_a_file_key_the_evaluation_does_not_read_is_left_to_the_training(mmdet_ready, tmp_path, capsys):
    """evaluate_detection.py builds no optimizer: a file's optimizer typo is not its refusal, while a typo in
    what it reads (the test loader) is, naming the file."""
    from engine.detection import DetectionError, load_config
    from evaluate_detection import evaluation_reads
    reads = evaluation_reads([])
    assert "optim_wrapper" not in reads.keys and "test_dataloader" in reads.keys
    load_config([SAMPLE_CONFIG, _fragment(tmp_path, FILE_TYPOS[0][0])], reads=reads)
    fragment = _fragment(tmp_path, "test_dataloader = dict(batch_sizes=2)\n")
    with pytest.raises(DetectionError, match=rf"^--config {fragment}: test_dataloader.batch_sizes: "):
        load_config([SAMPLE_CONFIG, fragment], reads=reads)
