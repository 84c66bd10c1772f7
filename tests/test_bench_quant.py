"""scripts/bench_quant.py refuses what it cannot time as asked with one `error:` line, before any timing: sizes of 0
(dropped for the model's defaults), a model timm does not know or that is no ViT, an image size its patches do not
divide, a thread count below 0; its --out folder is made before the timings, not found missing after them; and its
calibration clock stops on finished CUDA work."""
from __future__ import annotations

import json
import os
import types

import cd_models  # noqa: F401  (one torch thread)
import pytest
import torch

import bench_quant

SMALL = ["--device", "cpu", "--model", "vit_tiny_patch16_224", "--img-size", "32", "--depth", "1", "--embed-dim",
         "64", "--batch", "1", "--calib", "2", "--pipelines", "percentile"]


def refusal(argv, capsys, monkeypatch) -> tuple[object, list[str]]:
    """(exit status, error lines) of bench_quant.main(argv), which must stop before the first timing."""
    monkeypatch.setattr(bench_quant, "timed_forward", lambda *a, **k: pytest.fail("timed after all"))
    with pytest.raises(SystemExit) as done:
        bench_quant.main(argv)
    code = done.value.code
    message = code if isinstance(code, str) else capsys.readouterr().err  # sys.exit(text) prints it at exit
    return (1 if isinstance(code, str) else code), message.strip().splitlines()


@pytest.mark.parametrize("flag", ["--depth", "--img-size", "--embed-dim"])
def test_a_size_of_zero_is_refused_not_dropped(flag, capsys, monkeypatch):
    """`if v` dropped --depth 0 / --img-size 0 / --embed-dim 0: a 12-block ViT at 224 was timed under them."""
    argv = SMALL + [flag, "0"]
    code, lines = refusal(argv, capsys, monkeypatch)
    assert code == 2 and len(lines) == 1 and f"argument {flag}: 0: must be at least 1" in lines[0], lines


@pytest.mark.parametrize("argv, says", [
    (["--model", "nosuchmodel"], "--model nosuchmodel: not a timm model name"),   # was timm's RuntimeError
    (["--model", "resnet18"], "--model resnet18 is no vision Transformer"),        # was an AttributeError
    (["--model", "resnet18", "--img-size", "32"], "--model resnet18 does not take --img-size"),  # was a TypeError
    (["--threads", "-1"], "argument --threads: -1: must be at least 0"),          # was torch's RuntimeError
    (["--embed-dim", "200"], "--embed-dim 200: its 3 heads (dim // 64) do not divide it"),  # timm's AssertionError
    # 30 px in patches of 16: one patch, the other 14 pixel rows and columns dropped, timed as 16 px
    (["--model", "vit_tiny_patch16_224", "--img-size", "30", "--depth", "1"],
     "--img-size 30 is not a multiple of vit_tiny_patch16_224's patch size 16"),
])
def test_what_cannot_be_timed_is_one_error_line(argv, says, capsys, monkeypatch):
    code, lines = refusal(["--device", "cpu", "--batch", "1", *argv], capsys, monkeypatch)
    assert code in (1, 2) and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def test_out_in_a_folder_not_made_yet_is_made_before_the_timings(tmp_path, monkeypatch):
    """open(--out) after the timings raised FileNotFoundError for a folder that did not exist: the minutes of
    timing were lost."""
    out = tmp_path / "new" / "deeper" / "quant.json"
    folder_at_timing = []

    def timed(*args, **kwargs):
        folder_at_timing.append(out.parent.is_dir())
        return 0.5

    monkeypatch.setattr(bench_quant, "timed_forward", timed)
    bench_quant.main([*SMALL, "--out", str(out)])
    assert folder_at_timing == [True, True]
    assert json.loads(out.read_text())["pipelines"]["percentile"]["ratio_vs_fp"] == 1.0
    assert os.listdir(out.parent) == ["quant.json"]
    # the machine and versions, as bench_overhead.py and overhead_epochs.py record them ("cpu (1 threads)" before)
    from tests.test_bench_overhead import expected_environment, recorded_environment
    assert recorded_environment(json.loads(out.read_text())) == expected_environment()


@pytest.mark.parametrize("bits, says", [
    ("w4", "--bits w4: bit-width 'w4' is not of the form 'w4a4'"),
    ("w99a4", "--bits w99a4: bit-width 'w99a4': weight and activation bits must lie in"),
])
def test_a_bit_width_the_flag_refuses_is_a_usage_error_before_any_model_is_built(bits, says, capsys, monkeypatch):
    """A --bits of no bit-width's form exited 1 after parsing (the pipelines' check); a value the flag refuses on its
    own is a usage error, as argparse's: one line with status 2, before any model is built."""
    monkeypatch.setattr(bench_quant.timm, "create_model", lambda *a, **k: pytest.fail("a model was built"))
    code, lines = refusal([*SMALL, "--bits", bits], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def test_a_pipeline_given_twice_is_a_usage_error_before_any_timing(capsys, monkeypatch):
    """--pipelines percentile percentile timed it twice, printed two lines, and the JSON kept the second alone under
    one key: a figure printed that no file holds."""
    code, lines = refusal([*SMALL[:-1], "percentile", "repq", "percentile"], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "argument --pipelines: percentile given twice" in lines[0], lines


def test_the_calibration_clock_stops_on_finished_cuda_work(monkeypatch):
    """calibrate_s stopped its clock when the pipeline's Python returned, with the kernels it had queued on the GPU
    still to run (CUDA calls return before they run): the device is synchronized before the clock starts and
    before it stops, as for the forward timings. A stubbed torch.cuda and clock record the order."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))
    monkeypatch.setattr(bench_quant, "time", types.SimpleNamespace(
        perf_counter=lambda: events.append("clock") or float(len(events))))
    monkeypatch.setitem(bench_quant.PIPELINES, "percentile", lambda *a, **k: events.append("calibrate") or ("q", {}))
    qmodel, options, seconds = bench_quant.calibrate("percentile", None, torch.zeros(2, 3, 8, 8), "w4a4", 8,
                                                     torch.device("cuda"))
    assert events == ["sync cuda", "clock", "calibrate", "sync cuda", "clock"]
    assert (qmodel, options, seconds) == ("q", None, 5.0 - 2.0)  # the clock read at events 2 and 5


def test_overwrite_replaces_a_timing_json_of_its_own_and_refuses_another_file(tmp_path, capsys, monkeypatch):
    """--overwrite replaced whatever file --out named (an evaluate.py result, another benchmark's JSON): only a
    JSON of this script's is replaced; another file is one error line before any timing, and kept."""
    out = tmp_path / "t.json"
    out.write_text('{"model": "vit_small_patch16_224", "fp": {"top1": 79.9}}')
    code, lines = refusal([*SMALL, "--out", str(out), "--overwrite"], capsys, monkeypatch)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {out} is not a file bench_quant.py wrote"), lines
    assert json.loads(out.read_text()) == {"model": "vit_small_patch16_224", "fp": {"top1": 79.9}}
    monkeypatch.undo()
    own = [*SMALL, "--out", str(tmp_path / "own.json"), "--repeats", "1", "--warmup", "0"]
    bench_quant.main(own)
    bench_quant.main([*own, "--overwrite"])  # its own file: replaced
    assert set(json.loads((tmp_path / "own.json").read_text())["pipelines"]) == {"percentile"}
