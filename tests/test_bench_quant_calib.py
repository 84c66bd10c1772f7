"""scripts/bench_quant.py: --calib reaches the pipelines that draw their own images (APHQ's calibration set, GPLQ's
calibration pass), which dropped it for a fixed 32; and --pipelines with no name is a usage error, where it timed
the float model alone and exited 0."""
from __future__ import annotations

import dataclasses

import cd_models  # noqa: F401  (one torch thread)
import pytest

import bench_quant

TINY = ["--device", "cpu", "--model", "vit_tiny_patch16_224", "--img-size", "32", "--depth", "1", "--embed-dim",
        "64", "--batch", "2", "--repeats", "1", "--warmup", "0"]


def run(pipeline: str, calib: int, monkeypatch) -> tuple[dict, list[int]]:
    """(the pipeline's report, the image counts it drew from the benchmark's random training data) of a
    bench_quant.py run of `pipeline` with --calib `calib`: what the pipeline itself reports and draws."""
    draws, reports = [], []
    make_data, quantize = bench_quant.random_pipeline_data, bench_quant.PIPELINES[pipeline]

    def recorded_data(size, classes):
        data = make_data(size, classes)

        def train_images(count, seed, train_transform):
            draws.append(count)
            return data.train_images(count, seed, train_transform)

        return dataclasses.replace(data, train_images=train_images)

    class Recorded:
        def __getattr__(self, key):  # validate, Options: the pipeline's own
            return getattr(quantize, key)

        def __call__(self, *args, **kwargs):
            qmodel, report = quantize(*args, **kwargs)
            reports.append(report)
            return qmodel, report

    monkeypatch.setattr(bench_quant, "random_pipeline_data", recorded_data)
    monkeypatch.setitem(bench_quant.PIPELINES, pipeline, Recorded())
    bench_quant.main([*TINY, "--calib", str(calib), "--pipelines", pipeline])
    (report,) = reports
    return report, draws


@pytest.mark.parametrize("calib", [3, 40])  # fewer and more than the 32 used whatever --calib said
def test_calib_is_aphq_s_calibration_set(calib, monkeypatch):
    report, draws = run("aphq", calib, monkeypatch)
    # APHQ calibrates on the first calib_images of the reconstruction images it draws, so it draws at least as many
    assert report["data"]["calibration_images"] == calib
    assert draws == [report["data"]["reconstruction_images"]] == [max(32, calib)]


@pytest.mark.parametrize("calib", [3, 40])
def test_calib_is_gplq_s_calibration_pass(calib, monkeypatch):
    _, draws = run("gplq", calib, monkeypatch)
    assert draws[0] == calib  # the LSQ initialisation pass is GPLQ's first draw (quant/gplq/pipeline.py)


def test_pipelines_without_a_name_is_one_error_line_before_any_timing(capsys, monkeypatch):
    monkeypatch.setattr(bench_quant, "timed_forward", lambda *a, **k: pytest.fail("timed after all"))
    with pytest.raises(SystemExit) as refused:
        bench_quant.main([*TINY, "--pipelines"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "argument --pipelines: expected at least one argument" in lines[0], lines
