"""A run's per-layer maxima files left without their result file are refused by a sweep with --run --evaluate before
anything starts.

evaluate.py writes eval_best_act_max.csv / .png beside eval_best.json and refuses to overwrite such a file that its
result file did not write. A run whose eval_best.json was deleted to evaluate it again, its maxima files left, was
validated again and then failed at its evaluation ('give --out another name': the sweep's to name), and the later runs
were not started. The reference for each case is evaluate.py's own handling of the run's evaluate.py command."""
import shutil

import pytest

import evaluate
import train
from configs import load_config
from engine.run_dir import RunDirError
from tests.conftest import DEBUG_CONFIG
from tests.sweep_refusals import refused_at_start

import sweep  # noqa: E402  (scripts/, on the path of the tests)

ITEMS = ["sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false"]
EVALUATED = ["quant.pipelines=[rtn]"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder with run 'a' trained (tiny.yaml, 4 updates) and evaluated into eval_best.json and its maxima files."""
    folder = tmp_path_factory.mktemp("sweep") / "a"
    train.main(load_config([DEBUG_CONFIG], [*ITEMS, f"out_dir={folder}"]))
    evaluate.main(evaluate.parse_args(["--checkpoint", str(folder / "best.pt"), "--out",
                                       str(folder / "eval_best.json"), *EVALUATED]))
    assert (folder / "eval_best_act_max.csv").is_file() and (folder / "eval_best_act_max.png").is_file()
    return folder


def sweep_of(trained, tmp_path, evaluated=EVALUATED, keep=("eval_best.json",)) -> tuple[str, dict]:
    """A sweep file whose run 'b' (not trained) comes before run 'a': a copy of the trained run without its result
    files but `keep` and the maxima files; (its path, run a's expanded run)."""
    folder = tmp_path / "runs" / "a"
    shutil.copytree(trained, folder)
    for name in {"eval_best.json"} - set(keep):
        (folder / name).unlink()
    path = tmp_path / "s.yaml"
    path.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\n"
                    f"evaluate: [{', '.join(repr(e) for e in evaluated)}]\n"
                    f"runs:\n  b: [{', '.join(ITEMS)}]\n  a: [{', '.join(ITEMS)}]\n")
    return str(path), sweep.expand(str(path), [])[1]


def evaluate_run(run: dict) -> None:
    """evaluate.py's own run of the sweep's evaluate.py command for `run`, after the sweep's move of a result file it
    would not add to (this copy's, beside the original: sweep.run_one)."""
    command = sweep.commands(run, "", evaluate=True)[1]
    sweep.move_stale_result(*reversed(sweep.evaluation_paths(run)))
    evaluate.main(evaluate.parse_args(command[command.index("evaluate.py") + 1:]))


def test_maxima_files_without_their_result_are_refused_before_anything_starts(trained, tmp_path, monkeypatch, capsys):
    path, run = sweep_of(trained, tmp_path, keep=())
    monkeypatch.setattr(sweep, "run_one", lambda *a: pytest.fail("a run started"))
    message = refused_at_start(path)
    folder = tmp_path / "runs" / "a"
    assert f"{folder / 'eval_best_act_max.csv'} and {folder / 'eval_best_act_max.png'} are there" in message
    assert "move them out of the folder" in message and "--out" not in message
    assert capsys.readouterr().out == "" and not (tmp_path / "runs" / "b").exists()
    with pytest.raises(RunDirError, match="eval_best_act_max.csv exists and was not written for this result file"):
        evaluate_run(run)  # evaluate.py's own refusal, after the training


@pytest.mark.parametrize("case", ["result there", "no maxima files written"])
def test_what_evaluate_py_takes_is_not_refused(trained, tmp_path, case):
    """The result file's own maxima files (evaluate.py replaces them), and maxima files an evaluation that writes none
    (quant.act_max_csv=false) leaves alone."""
    evaluated = EVALUATED if case == "result there" else [*EVALUATED, "quant.act_max_csv=false"]
    path, run = sweep_of(trained, tmp_path, evaluated, keep=("eval_best.json",) if case == "result there" else ())
    sweep.refuse_maxima_files_without_their_result(sweep.expand(path, []))
    evaluate_run(run)  # takes it
    assert (tmp_path / "runs" / "a" / "eval_best.json").is_file()
