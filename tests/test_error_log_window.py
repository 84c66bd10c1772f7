"""A run that an error stops between two log steps writes checkpoint.pt at the last completed update with the log
window open since the last log step, and the same command resumes it: the window then ends where a run never stopped
ends it, with the same train/loss, whether the error came inside an update (part of its micro-batches done, read
again on resume) or at an update's boundary."""
import pytest

import train
from configs import load_config
from tests.conftest import DEBUG_CONFIG
from tests.test_loop_errors import fail_at_train_sample
from tests.test_resume_kills import logged_series

# tiny config: 8 samples a micro-batch, two micro-batches an update; one log step, at update 4 (the run's last)
RUN = ("train.log_every_steps=4", "train.max_steps=4")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: metrics.jsonl's train/ records of the run straight through."""
    out_dir = tmp_path_factory.mktemp("straight") / "run"
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out_dir}", *RUN]))
    return logged_series(out_dir)


@pytest.mark.parametrize("sample", [45, 33], ids=["inside_update_3", "at_update_3s_start"])
def test_a_run_resumed_after_an_error_logs_the_window_of_a_run_never_stopped(tmp_path, debug_config, monkeypatch,
                                                                            straight, sample):
    """Sample 45 is in update 3's second micro-batch (its first done), sample 33 in its first. The window 1-4 holds
    updates 1-2 when the error comes; inside update 3 the checkpoint carried none of it, and the resumed run logged
    the mean of updates 3-4 only."""
    assert [r["step"] for r in straight] == [4]
    fail_at_train_sample(monkeypatch, sample)
    with pytest.raises(RuntimeError, match="file server"):
        train.main(debug_config(*RUN, name="crash"))
    monkeypatch.undo()
    resumed = train.main(debug_config(*RUN, name="crash"))
    assert resumed.state.step == 4 and logged_series(tmp_path / "crash") == straight
