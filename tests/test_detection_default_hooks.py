"""default_hooks entries that MMEngine's Runner would fail on (engine.detection.config.check_default_hooks): a key
its hook does not take, a misspelt hook name (a dict without a `type`), None under a name that is not one of the
Runner's own hooks. Each is one `error:` line before the Runner is built; each check is held against what
MMEngine's own code does with the entry.

Marked `detection`: the hook types are looked up in MMDetection's registry, which needs full mmcv
(scripts/install_mmcv.sh).
"""
from __future__ import annotations

import inspect
from collections import deque
from types import SimpleNamespace

import pytest

from detection_runs import SAMPLE_CONFIG, error_line

pytestmark = pytest.mark.detection


def _config(**hooks):
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    init_default_scope("mmdet")
    return Config(dict(default_hooks=hooks))


def _mmengine_saves_with(tmp_path, key, value) -> bool:
    """Whether MMEngine's CheckpointHook given `key`=`value` gets through its first save: the hook's own code,
    against a stand-in runner whose save_checkpoint takes what Runner.save_checkpoint takes."""
    from mmengine.fileio import get_file_backend
    from mmengine.hooks import CheckpointHook
    from mmengine.runner import Runner
    try:
        hook = CheckpointHook(**{"interval": 1, key: value})
    except TypeError:
        return False
    # what the hook's before_train sets
    hook.out_dir, hook.file_backend, hook.keep_ckpt_ids = str(tmp_path), get_file_backend(str(tmp_path)), deque()
    runner = SimpleNamespace(epoch=0, iter=0, work_dir=str(tmp_path),
                             message_hub=SimpleNamespace(update_info=lambda *args: None),
                             save_checkpoint=lambda *args, **kwargs: inspect.signature(Runner.save_checkpoint).bind(
                                 None, *args, **kwargs))
    try:
        hook._save_checkpoint(runner)
    except TypeError:  # an unexpected keyword, or one the hook gives itself (multiple values)
        return False
    return True


@pytest.mark.parametrize("key, value", [("interval", 2), ("max_keep_ckpts", 2), ("save_last", False),
                                        ("intervall", 2), ("filename", "x.pth"), ("meta", {}), ("by_epochs", True)])
def test_a_checkpoint_hook_key_is_refused_exactly_where_mmengine_s_first_save_fails(mmdet_ready, tmp_path, key,
                                                                                      value):
    """CheckpointHook takes **kwargs and passes them on to Runner.save_checkpoint: `intervall=2` was stored and
    failed with a TypeError at the first checkpoint, after a whole epoch, leaving no checkpoint."""
    from engine.detection import DetectionError
    from engine.detection.config import check_default_hooks
    cfg = _config(checkpoint={"type": "CheckpointHook", "interval": 1, key: value})
    if _mmengine_saves_with(tmp_path, key, value):
        assert check_default_hooks(cfg) is None
    else:
        with pytest.raises(DetectionError, match=rf"^default_hooks.checkpoint.{key}: CheckpointHook "
                                                 rf"\(default_hooks.checkpoint\) takes no argument '{key}'"):
            check_default_hooks(cfg)


def test_a_mistyped_hook_key_or_hook_name_is_one_error_line_before_the_runner_is_built(mmdet_ready, tmp_path,
                                                                                        capsys):
    """`default_hooks.checkpoint.intervall=2` trained an epoch, then failed without a checkpoint;
    `default_hooks.chekpoint.interval=2` failed in the Runner with a KeyError about a missing "type"."""
    work = tmp_path / "work"
    argv = ["--config", SAMPLE_CONFIG, "--data-root", str(tmp_path), "--work-dir", str(work)]
    line = error_line(capsys, argv + ["default_hooks.checkpoint.intervall=2"])
    assert line.startswith("error: default_hooks.checkpoint.intervall: CheckpointHook (default_hooks.checkpoint) "
                           "takes no argument 'intervall' (did you mean default_hooks.checkpoint.interval?)"), line
    line = error_line(capsys, argv + ["default_hooks.chekpoint.interval=2"])
    assert line.startswith("error: default_hooks.chekpoint has no `type` (did you mean "
                           "default_hooks.checkpoint?)"), line
    line = error_line(capsys, argv + ["default_hooks.logger.intervall=5"])  # a hook without **kwargs: its signature
    assert line.startswith("error: default_hooks.logger.intervall: LoggerHook (default_hooks.logger) takes no "
                           "argument 'intervall'"), line
    assert not work.exists()


def _runner_registers(hooks) -> bool:
    """Whether MMEngine's Runner.register_default_hooks takes `hooks` (a stand-in runner records the hooks)."""
    from mmengine.runner import Runner
    try:
        Runner.register_default_hooks(SimpleNamespace(register_hook=lambda hook: None), hooks)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("name", ["runtime_info", "timer", "sampler_seed", "logger", "param_scheduler", "checkpoint",
                                  "visualization", "chekpoint"])
def test_a_hook_set_to_none_is_taken_exactly_where_mmengine_leaves_it_out(mmdet_ready, name):
    """None leaves out one of the Runner's own hooks (legitimate MMEngine usage); under another name
    (`default_hooks.visualization=None`, MMDetection's hook) the Runner failed an assertion."""
    from engine.detection import DetectionError
    from engine.detection.config import check_default_hooks
    cfg = _config(**{name: None})
    if _runner_registers({name: None}):
        assert check_default_hooks(cfg) is None
    else:
        with pytest.raises(DetectionError, match=rf"^default_hooks.{name}=None: MMEngine's Runner leaves out only its "
                                                 "own default hooks with None"):
            check_default_hooks(cfg)


def test_entries_the_runner_builds_pass_and_ones_it_cannot_are_named(mmdet_ready):
    """A new hook with its type passes (the Runner adds it), and so does the sample config's set; a type no
    registry holds and a value that is no hook's dict are refused, as the Runner's build would fail on them."""
    from engine.detection import DetectionError, load_config
    from engine.detection.config import check_default_hooks
    check_default_hooks(load_config([SAMPLE_CONFIG]))
    check_default_hooks(_config(extra=dict(type="DetVisualizationHook", draw=False), checkpoint=None))
    with pytest.raises(DetectionError, match=r"^default_hooks.logger.type=Nope: no hook of that name is registered"):
        check_default_hooks(_config(logger=dict(type="Nope")))
    with pytest.raises(DetectionError, match=r"^default_hooks.checkpoint=5: give a hook's dict \(with its `type`\), "
                                             r"or None to leave it out$"):
        check_default_hooks(_config(checkpoint=5))
