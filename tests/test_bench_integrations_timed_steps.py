"""scripts/bench_integrations.py times the same per-step quantity in every runner: the gaps between end-of-step
time stamps, after a first step that is never timed, since it holds the framework's start and CD's one-time pair
check (built before the plain loop, at train start in the frameworks), and after `--warmup` more; the median is
over `--steps` gaps. It was not so: with --warmup 0 the frameworks' first gap began before their train-start
hooks, so it held the pair check (+433 ms per step in hf against +6.8 ms in the plain loop), and every runner
took its median over --steps + 1 gaps."""
import functools
import time

import pytest
import torch

from tests.conftest import load_script

STEPS = 3


def test_step_times_is_the_median_of_the_gaps_after_the_warmup_ones():
    bench = load_script("bench_integrations")
    stamps = [100.0, 100.5, 101.5, 104.5, 105.0]  # gaps 0.5, 1, 3, 0.5 (exact in binary)
    assert bench.step_times(stamps, 0) == 0.75  # the median of 0.5, 0.5, 1, 3
    assert bench.step_times(stamps, 1) == 1.0  # the median of 1, 3, 0.5


@pytest.mark.parametrize("framework, warmup", [("plain", 0), ("hf", 0), ("lightning", 0), ("mmengine", 0),
                                               ("plain", 2)])
def test_every_runner_times_steps_gaps_that_all_begin_after_cds_pair_check(framework, warmup, monkeypatch):
    if framework != "plain":
        pytest.importorskip({"hf": "transformers"}.get(framework, framework))
    import cd.decay

    bench = load_script("bench_integrations")
    events: list[tuple] = []  # ("built", end time) at each ColinearityDecay built; ("timed", stamps, warmup)
    original = cd.decay.ColinearityDecay.__init__

    @functools.wraps(original)  # the integrations check their arguments against its signature
    def built(self, *args, **kwargs):
        original(self, *args, **kwargs)  # the pair check runs in here
        events.append(("built", time.perf_counter()))

    timed = bench.step_times

    def recorded(stamps, warmup_):
        events.append(("timed", list(stamps), warmup_))
        return timed(stamps, warmup_)

    monkeypatch.setattr(cd.decay.ColinearityDecay, "__init__", built)
    monkeypatch.setattr(bench, "step_times", recorded)
    threads = torch.get_num_threads()
    try:
        bench.main(["--frameworks", framework, "--warmup", str(warmup), "--steps", str(STEPS), "--repeats", "1",
                    "--width", "32", "--depth", "1", "--batch", "2"])
    finally:
        torch.set_num_threads(threads)
    runs = [i for i, e in enumerate(events) if e[0] == "timed"]
    assert len(runs) == 2  # without CD, then with CD
    for i in runs:
        _, stamps, given = events[i]
        assert given == warmup and len(stamps) - 1 - warmup == STEPS  # gaps left after the warmup ones
    with_cd = runs[1]
    last_built = max(e[1] for e in events[:with_cd] if e[0] == "built")  # the run's own CD, built in the run
    assert events[with_cd][1][0] > last_built  # no gap, timed or warmup, holds the pair check
