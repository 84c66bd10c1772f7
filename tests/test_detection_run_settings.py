"""scripts/train_detection.py's checks of the Runner settings it hands to MMEngine as they are (the checkpoint
hook's by_epoch, log_level): a value MMEngine would take otherwise than the check is refused before any work, as
one `error:` line. Each check is held against MMEngine's own reading of the value (its CheckpointHook, its
logger). They run before any model or data set is built, so with mmcv-lite too: part of the default suite."""
from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("mmdet")

from detection_runs import SAMPLE_CONFIG, error_line  # noqa: E402

EPOCH_LOOP = dict(type="EpochBasedTrainLoop", max_epochs=2)


def _saves_after_an_iteration(by_epoch) -> bool:
    """Whether MMEngine's CheckpointHook, given `by_epoch`, saves after a training iteration (an iteration
    checkpoint) of a stand-in runner in its first of 4 iterations."""
    from mmengine.hooks import CheckpointHook
    hook = CheckpointHook(interval=1, by_epoch=by_epoch)
    saved = []
    hook._save_checkpoint = saved.append  # what is saved is not the point, only whether
    hook.after_train_iter(SimpleNamespace(iter=0, max_iters=4, logger=logging.getLogger("stand-in")), batch_idx=0)
    return bool(saved)


@pytest.mark.parametrize("by_epoch", [True, 1, "yes", False, 0, None])
def test_an_epoch_loop_refuses_exactly_the_by_epoch_values_mmengine_saves_by_iteration_with(by_epoch):
    """`by_epoch=0` (None, any false value) saves iteration checkpoints just as False does; only False was refused,
    and a resume after an interruption trained the same iterations again."""
    from engine.detection import DetectionError
    from train_detection import check_checkpointing
    cfg = dict(default_hooks=dict(checkpoint=dict(type="CheckpointHook", by_epoch=by_epoch)), train_cfg=EPOCH_LOOP)
    if _saves_after_an_iteration(by_epoch):
        with pytest.raises(DetectionError, match=rf"^default_hooks.checkpoint.by_epoch={by_epoch!r} with an "
                                                 r"EpochBasedTrainLoop: the hook saves by iteration"):
            check_checkpointing(cfg, "w")
    else:
        assert check_checkpointing(cfg, "w") is None


@pytest.mark.parametrize("value", ["0", "None"])
def test_a_false_by_epoch_other_than_false_is_one_error_line_before_any_work(tmp_path, capsys, value):
    work = tmp_path / "work"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(tmp_path), "--work-dir", str(work),
                               f"default_hooks.checkpoint.by_epoch={value}"])
    assert line.startswith(f"error: default_hooks.checkpoint.by_epoch={value} with an EpochBasedTrainLoop"), line
    assert not work.exists()


@pytest.mark.parametrize("train_cfg, epochs", [
    (dict(type="mmengine.EpochBasedTrainLoop", max_epochs=2), True),  # the type with its registry's scope
    (dict(by_epoch=True, max_epochs=2), True),  # no type: MMEngine's loop builder reads by_epoch
    (dict(by_epoch=False, max_iters=8), False),
    (dict(type="IterBasedTrainLoop", max_iters=8), False)])
def test_iteration_checkpoints_are_refused_for_every_spelling_of_an_epoch_loop_only(train_cfg, epochs):
    """Runner.build_train_loop builds an EpochBasedTrainLoop from its type (scoped or not) or, without a type,
    from a true by_epoch; the check took a train_cfg without a type for an epoch loop whatever its by_epoch."""
    from engine.detection import DetectionError
    from train_detection import check_checkpointing
    cfg = dict(default_hooks=dict(checkpoint=dict(type="CheckpointHook", by_epoch=False, interval=4)),
               train_cfg=train_cfg)
    if epochs:
        with pytest.raises(DetectionError, match="with an EpochBasedTrainLoop"):
            check_checkpointing(cfg, "w")
    else:
        assert check_checkpointing(cfg, "w") is None


def _mmengine_logs_at(level) -> bool:
    """Whether MMEngine's logger, as the Runner builds it, takes `level` (it indexes logging's table of names)."""
    from mmengine.logging import MMLogger
    name = f"level-check-{next(_names)}"
    try:
        MMLogger.get_instance(name, logger_name=name, log_level=level)
    except (KeyError, TypeError, ValueError):
        return False
    return True


_names = itertools.count()


@pytest.mark.parametrize("level", ["INFO", "DEBUG", "WARN", "CRITICAL", 10, 35, "LOUD", "info", "Debug", None, 1.5])
def test_a_log_level_is_refused_exactly_where_mmengine_s_logger_cannot_take_it(level):
    """`log_level=LOUD` failed with a KeyError traceback from inside the Runner (MMLogger's look-up in logging's
    table of capitalised names), after the work dir was made."""
    from engine.detection import DetectionError
    from train_detection import check_log_level
    if _mmengine_logs_at(level):
        assert check_log_level({"log_level": level}) is None
    else:
        with pytest.raises(DetectionError, match=rf"^log_level={level!r}: give one of logging's level names, in "
                                                 r"capitals \(NOTSET, DEBUG, INFO, WARN, WARNING, ERROR, CRITICAL, "
                                                 r"FATAL\), or a whole number$"):
            check_log_level({"log_level": level})


def test_an_unknown_log_level_is_one_error_line_before_any_work(tmp_path, capsys):
    work = tmp_path / "work"
    line = error_line(capsys, ["--config", SAMPLE_CONFIG, "--data-root", str(tmp_path), "--work-dir", str(work),
                               "log_level=LOUD"])
    assert line.startswith("error: log_level='LOUD': give one of logging's level names"), line
    assert not work.exists()
