"""scripts/bench_integrations.py refuses sizes and thread counts it cannot time with one usage error line before
any run: a batch of 0 printed a table timed on empty batches, a width of 0 or a depth of 0 ended in a traceback
(ZeroDivisionError, cd's UnsupportedModelError), 0 or -1 threads in torch's RuntimeError."""
import pytest
import torch

from tests.conftest import load_script


@pytest.mark.parametrize("argv, says", [
    (["--batch", "0"], "argument --batch: 0: must be at least 1"),
    (["--width", "0"], "argument --width: 0: must be at least 1"),
    (["--depth", "0"], "argument --depth: 0: must be at least 1"),
    (["--threads", "0"], "argument --threads: 0: must be at least 1"),
    (["--threads", "-1"], "argument --threads: -1: must be at least 1"),
    (["--width", "129"], "--width 129: its 2 heads (width // 64) do not divide it"),
])
def test_sizes_and_threads_it_cannot_time_are_one_error_line_before_any_run(monkeypatch, capsys, argv, says):
    bench = load_script("bench_integrations")
    monkeypatch.setattr(bench, "_table", None)  # reached: a TypeError, not the refusal
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as refused:
            bench.main(["--frameworks", "plain", *argv])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("error: ") and says in err
    assert len(err.strip().splitlines()) == 1, err
