"""When train.py validates: every train.eval_every_steps update, also one that ends an epoch that
train.eval_every_epochs skips; the update that train.max_steps stops at, also at an epoch's end; and an
eval_every_steps update that a stop request cut off is validated first when the run resumes. The debug run has
4 updates per epoch."""
import json
import os
import signal

import train


def validated_steps(out_dir) -> list[int]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "val/top1" in r]


def test_every_eval_every_steps_update_is_validated_also_at_an_epoch_end_between_eval_every_epochs(debug_config):
    # updates 4 and 12 end epochs 1 and 3, which eval_every_epochs=2 does not validate: they were skipped
    cfg = debug_config("sched.epochs=4", "train.eval_every_epochs=2", "train.eval_every_steps=2",
                       "log.tensorboard=false")
    train.main(cfg)
    assert validated_steps(cfg.out_dir) == [2, 4, 6, 8, 10, 12, 14, 16]


def test_a_max_steps_stop_at_an_epoch_end_is_validated_and_reported_at_that_update(debug_config, caplog):
    # update 12 ends epoch 3, which eval_every_epochs=2 skips: the run ended reporting update 8's validation as
    # of update 12, and best.pt never saw the last weights
    cfg = debug_config("sched.epochs=4", "train.eval_every_epochs=2", "train.max_steps=12", "log.tensorboard=false")
    with caplog.at_level("INFO"):
        result = train.main(cfg)
    assert result.state.step == 12 and validated_steps(cfg.out_dir) == [8, 12]
    assert "on 16 images after 12 updates" in caplog.text


def test_a_stop_request_at_an_eval_every_steps_update_leaves_that_validation_to_the_resumed_run(debug_config,
                                                                                              monkeypatch):
    """The loop checks a stop request before eval_every_steps: update 2's validation was never made, in the
    stopped run or the resumed one, so best.pt and the metrics differed from an uninterrupted run's."""
    build = train.build_optimizer

    def stop_at_update_2(*args, **kwargs):  # SIGTERM, as a scheduler sends it, right after update 2's step
        optimizer = build(*args, **kwargs)
        steps = [0]

        def hook(*_):
            steps[0] += 1
            if steps[0] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        optimizer.register_step_post_hook(hook)
        return optimizer

    common = ("train.eval_every_steps=2", "log.tensorboard=false")
    monkeypatch.setattr(train, "build_optimizer", stop_at_update_2)
    stopped = train.main(debug_config(*common))
    assert stopped.reason == "preempted" and stopped.state.step == 2 and stopped.state.validation_due
    monkeypatch.setattr(train, "build_optimizer", build)
    resumed = debug_config(*common)
    assert train.main(resumed).reason == "finished"
    assert validated_steps(resumed.out_dir) == [2, 4, 6, 8]
