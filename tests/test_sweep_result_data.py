"""A run's result file evaluated on other data (another data.root) is refused by a sweep with --run --evaluate before
anything starts.

evaluate.py adds to a result file only for the data it was written of (its 'data': data.root, the val split, the eval
transform). A sweep requeued with another data.root (the data set copied to the node's own disk) validated its first
finished run again and then failed at its evaluation ('give --out another file': the sweep's to name), and the later
runs were not started. The reference is evaluate.py's own handling of the run's evaluate.py command."""
import os
import shutil

import pytest

import evaluate
import train
from configs import ConfigError, load_config
from engine.eval_results import ResultsError
from tests.conftest import DEBUG_CONFIG, make_folder
from tests.sweep_refusals import refused_at_start

import sweep  # noqa: E402  (scripts/, on the path of the tests)

ITEMS = ["sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false", "data.dataset=folder"]
EVALUATED = ["quant.pipelines=[rtn]"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tmp/runs/a: run 'a' trained on the image folder tmp/d1 (tiny.yaml's 4 classes) and evaluated there; tmp/d2:
    a copy of the images at another path."""
    root = tmp_path_factory.mktemp("sweep")
    make_folder(root / "d1", {"train": {f"c{i}": 4 for i in range(4)}, "val": {f"c{i}": 2 for i in range(4)}})
    shutil.copytree(root / "d1", root / "d2")
    folder = root / "runs" / "a"
    train.main(load_config([DEBUG_CONFIG], [*ITEMS, f"data.root={root / 'd1'}", f"out_dir={folder}"]))
    evaluate.main(evaluate.parse_args(["--checkpoint", str(folder / "best.pt"), "--out",
                                       str(folder / "eval_best.json"), f"data.root={root / 'd1'}", *EVALUATED]))
    return root


def sweep_file(root) -> str:
    """A sweep whose run 'b' (not trained) comes before run 'a', each on the data.root its command line gives."""
    path = root / "s.yaml"
    path.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {root / 'runs'}\nevaluate: {EVALUATED}\n"
                    f"runs:\n  b: [{', '.join(ITEMS)}, train.seed=1]\n  a: [{', '.join(ITEMS)}]\n")
    return str(path)


def evaluate_run(run: dict) -> None:
    """evaluate.py's own run of the sweep's evaluate.py command for `run`."""
    command = sweep.commands(run, "", evaluate=True)[1]
    evaluate.main(evaluate.parse_args(command[command.index("evaluate.py") + 1:]))


def test_a_result_of_another_data_root_is_refused_before_anything_starts(trained, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "run_one", lambda *a: pytest.fail("a run started"))
    given = f"data.root={trained / 'd2'}"
    message = refused_at_start(sweep_file(trained), given)
    assert f"holds its evaluation of other data (data.root: '{trained / 'd1'}' in the file, '{trained / 'd2'}' " \
           "now)" in message and "--out" not in message
    assert capsys.readouterr().out == "" and not (trained / "runs" / "b").exists()
    with pytest.raises(ResultsError, match="holds results of another evaluation"):  # evaluate.py's, after training
        evaluate_run(sweep.expand(sweep_file(trained), [given])[1])


def test_a_result_of_the_same_data_is_not_refused(trained):
    runs = sweep.expand(sweep_file(trained), [f"data.root={trained / 'd1'}"])
    sweep.refuse_results_of_other_data(runs)
    evaluate_run(runs[1])  # takes it


def test_a_result_of_other_data_is_refused_with_the_quant_settings_train_py_records_before_the_evaluation(trained,
                                                                                                         tmp_path):
    """The data of a result file are compared as evaluate.py resolves the run's command once the run's train.py has
    recorded the run's quant.* in best.pt. Read from best.pt as it was (quant.pipelines [rtn], since changed to
    [percentile] in a config file of the sweep), the command's quant.calib_images=16 was one no pipeline reads, that
    resolution was refused, and the other data.root went unchecked: the run failed at its evaluation after training.
    The reference is train.py's turn, then evaluate.py's refusal of the run's command."""
    layer = tmp_path / "plan.yaml"
    layer.write_text("quant:\n  pipelines: [rtn]\n")
    folder = tmp_path / "runs" / "a"
    train.main(load_config([DEBUG_CONFIG, str(layer)], [*ITEMS, f"data.root={trained / 'd1'}", f"out_dir={folder}"]))
    evaluate.main(evaluate.parse_args(["--checkpoint", str(folder / "best.pt"), "--out",
                                       str(folder / "eval_best.json"), f"data.root={trained / 'd1'}"]))
    layer.write_text("quant:\n  pipelines: [percentile]\n")
    path = tmp_path / "s.yaml"
    path.write_text(f"configs: [configs/debug/tiny.yaml, {layer}]\nout_root: {tmp_path / 'runs'}\n"
                    f"runs:\n  a: [{', '.join(ITEMS)}]\n")
    given = [f"data.root={trained / 'd2'}", "quant.calib_images=16"]
    (run,) = sweep.expand(str(path), given)
    with pytest.raises(ConfigError, match=r"holds its evaluation of other data \(data.root: "):
        sweep.refuse_results_of_other_data([run])
    train.main(load_config([os.path.join(sweep.ROOT, c) for c in run["configs"]], run["overrides"]))  # its turn
    with pytest.raises(ResultsError, match="holds results of another evaluation"):
        evaluate_run(run)
