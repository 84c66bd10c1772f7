"""scripts/bench_overhead.py times CD as train.py runs it: both CD arms (the training step's and `apply` against
its floor) get the update norms on every --norms-every-th update, by default train.py's log interval
(`train.log_every_steps` of the default config), and the reports record the value. It timed
ColinearityDecay's own default, norms on every update, which no training run uses."""
from __future__ import annotations

import json

import cd_models  # noqa: F401  (one torch thread)
import pytest

from configs import load_config
from tests.conftest import load_script


@pytest.fixture
def built(monkeypatch):
    """(the script, the norms_every of every ColinearityDecay it builds, in order); training steps skipped (what is
    checked here is the decay each arm builds, not a timing), and no figure drawn."""
    bench = load_script("bench_overhead")
    made = []

    class Recorded(bench.ColinearityDecay):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.norms_every)

    monkeypatch.setattr(bench, "ColinearityDecay", Recorded)
    monkeypatch.setattr(bench.Runner, "step", lambda self: None)
    monkeypatch.setattr(bench, "plot", lambda *args, **kwargs: None)
    return bench, made


def train_py_norms_every() -> int:
    """train.py passes cfg.train.log_every_steps as CD's norms_every (train.py, `ColinearityDecay.from_config`)."""
    return load_config([]).train.log_every_steps


STEP = ["--device", "cpu", "--small", "--batches", "2", "--widths", "64", "--width-batch", "2", "--warmup", "0",
        "--steps", "1"]
APPLY = ["--device", "cpu", "--small", "--apply-only", "--widths", "64", "--warmup", "0", "--steps", "1"]


@pytest.mark.parametrize("given, expected", [([], None), (["--norms-every", "7"], 7)])
@pytest.mark.slow
def test_both_cd_arms_of_the_step_protocol_get_norms_every(built, tmp_path, given, expected):
    bench, made = built
    expected = expected or train_py_norms_every()
    report = bench.main([*STEP, *given, "--out", str(tmp_path)])
    # per configuration (2: one per sweep): the training step's Runner, then measure_apply's decay
    assert made == [expected] * 4
    assert report["norms_every"] == expected
    assert json.loads((tmp_path / "overhead.json").read_text())["norms_every"] == expected


@pytest.mark.parametrize("given, expected", [([], None), (["--norms-every", "1"], 1)])
def test_apply_only_gets_norms_every_and_records_it(built, tmp_path, given, expected):
    bench, made = built
    expected = expected or train_py_norms_every()
    report = bench.main([*APPLY, *given, "--out", str(tmp_path)])
    assert made == [expected]
    assert report["norms_every"] == json.loads((tmp_path / "apply.json").read_text())["norms_every"] == expected


def test_a_norms_every_below_one_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        load_script("bench_overhead").main([*APPLY, "--norms-every", "0", "--out", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and "argument --norms-every: 0: must be at least 1" in lines[0]
    assert not list(tmp_path.iterdir())
