"""A result file that the sweep's evaluate.py command would refuse to add to (settings changed since it was evaluated)
is refused before anything starts, and the refusal names where the change comes from: an override given on the
sweep's command line (the sweep file as it was: "put the settings in <sweep file> back" pointed at an unchanged
file), or the sweep file. The reference is evaluate.py's own refusal of the command, and the command with the fix
made: the named overrides dropped, the sweep takes it."""
import os

import pytest

import evaluate
import train
from configs import load_config
from engine.eval_results import ResultsError
from tests.conftest import DEBUG_CONFIG
from tests.sweep_refusals import refused_at_start

import sweep  # noqa: E402  (scripts/, on the path of the tests)

ITEMS = ["sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false"]  # run 'a' as it trained
EVALUATED = ["quant.pipelines=[percentile]"]  # its evaluation, with the config's calibration settings


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """out_root with run 'a' trained (tiny.yaml, 4 updates) and evaluated (percentile) into its eval_best.json."""
    root = tmp_path_factory.mktemp("sweep")
    folder = root / "runs" / "a"
    train.main(load_config([DEBUG_CONFIG], [*ITEMS, f"out_dir={folder}"]))
    evaluate.main(evaluate.parse_args(["--checkpoint", str(folder / "best.pt"), "--out",
                                       str(folder / "eval_best.json"), *EVALUATED]))
    return root


def sweep_file(root, path, evaluated=EVALUATED) -> str:
    """A sweep of run 'a' in root/runs, evaluated with `evaluated`."""
    path.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {root / 'runs'}\n"
                    f"evaluate: [{', '.join(repr(e) for e in evaluated)}]\nruns:\n  a: [{', '.join(ITEMS)}]\n")
    return str(path)


def evaluate_refuses(trained, overrides) -> None:
    """evaluate.py's own refusal of the run's evaluation with `overrides`: the change is a real one."""
    folder = trained / "runs" / "a"
    with pytest.raises(ResultsError, match="--recompute"):
        evaluate.main(evaluate.parse_args(["--checkpoint", str(folder / "best.pt"), "--out",
                                           str(folder / "eval_best.json"), *overrides]))


@pytest.mark.parametrize("given, named, says", [
    # data.num_workers reaches evaluate.py too, and changes no setting of the file's: not named
    (["quant.calib_images=16", "data.num_workers=0"], "quant.calib_images=16", "calibration.images 32 -> 16"),
    # two overrides that each change a setting: dropping one alone leaves a change, and both are named
    (["quant.calib_images=16", "quant.calib_seed=5"], "quant.calib_images=16 quant.calib_seed=5", "calibration."),
], ids=["one", "two"])
def test_a_change_from_the_command_line_names_the_override_not_the_sweep_file(trained, tmp_path, capsys, given,
                                                                             named, says):
    path = sweep_file(trained, tmp_path / "s.yaml")
    message = refused_at_start(path, *given)
    assert says in message and f"set by the command line's {named}, " in message, message
    assert f"drop {named} from the command line" in message and "--recompute" in message, message
    assert path not in message and "back as they were" not in message, message
    assert capsys.readouterr().out == ""
    evaluate_refuses(trained, [*EVALUATED, *given])
    # the fix it names: without those overrides the sweep plans the run's evaluation as it is, with no --recompute
    kept = [o for o in given if o not in named.split()]
    runs = sweep.expand(path, kept)
    sweep.plan_changed_evaluations(runs, recompute=False, world_size=1, sweep_path=path, overrides=kept)
    assert "--recompute" not in sweep.commands(runs[0], "", evaluate=True)[1]
    # and --recompute, which it offers too, passes evaluate.py's on
    runs = sweep.expand(path, given)
    sweep.plan_changed_evaluations(runs, recompute=True, world_size=1, sweep_path=path, overrides=given)
    assert "--recompute" in sweep.commands(runs[0], "", evaluate=True)[1]


def test_a_change_in_the_sweep_file_names_the_file_also_beside_an_override_that_changes_nothing(trained, tmp_path,
                                                                                                capsys):
    evaluated = [*EVALUATED, "quant.calib_images=16"]
    path = sweep_file(trained, tmp_path / "s.yaml", evaluated)
    message = refused_at_start(path, "data.num_workers=0")
    assert "calibration.images 32 -> 16" in message and f"put the settings in {path} back as they were" in message
    assert "command line" not in message, message
    assert capsys.readouterr().out == ""
    evaluate_refuses(trained, evaluated)


def test_a_change_from_both_names_the_override_and_the_sweep_file(trained, tmp_path, capsys):
    evaluated = [*EVALUATED, "quant.calib_images=16"]
    path = sweep_file(trained, tmp_path / "s.yaml", evaluated)
    message = refused_at_start(path, "quant.calib_seed=5", "data.num_workers=0")
    assert f"set by the command line's quant.calib_seed=5 and by {path}, " in message, message
    assert f"drop quant.calib_seed=5 from the command line and put the settings in {path} back" in message, message
    assert capsys.readouterr().out == ""
    evaluate_refuses(trained, [*evaluated, "quant.calib_seed=5"])


def test_a_quant_setting_a_config_file_changed_since_the_evaluation_is_refused_before_anything_starts(tmp_path,
                                                                                                     capsys):
    """A quant.* setting that a config file of the sweep changed since the run was evaluated (a layer's
    quant.calib_images: 16): train.py, at the run's turn, records the run's quant.* in best.pt (train.py
    record_quant_in_checkpoints), from which evaluate.py takes them. The sweep resolved the evaluation from best.pt as
    it was before that turn, found no change, and the run failed at its evaluation after its training, the later runs
    not started. The reference is train.py's turn, then evaluate.py's refusal of the run's command."""
    folder = tmp_path / "runs" / "a"
    train.main(load_config([DEBUG_CONFIG], [*ITEMS, f"out_dir={folder}"]))
    evaluate.main(evaluate.parse_args(["--checkpoint", str(folder / "best.pt"), "--out",
                                       str(folder / "eval_best.json"), *EVALUATED]))
    layer = tmp_path / "calibration.yaml"
    layer.write_text("quant:\n  calib_images: 16\n")
    path = tmp_path / "s.yaml"
    path.write_text(f"configs: [configs/debug/tiny.yaml, {layer}]\nout_root: {tmp_path / 'runs'}\n"
                    f"evaluate: [{', '.join(repr(e) for e in EVALUATED)}]\nruns:\n  a: [{', '.join(ITEMS)}]\n")
    capsys.readouterr()
    message = refused_at_start(str(path))
    assert "calibration.images 32 -> 16" in message and "--recompute" in message, message
    assert capsys.readouterr().out == ""
    (run,) = sweep.expand(str(path), [])
    train.main(load_config([layer_path(c) for c in run["configs"]], run["overrides"]))  # the run's turn
    command = sweep.commands(run, "", evaluate=True)[1]
    with pytest.raises(ResultsError, match=r"calibration.images 32 -> 16.*--recompute"):
        evaluate.main(evaluate.parse_args(command[command.index("evaluate.py") + 1:]))


def layer_path(config: str) -> str:
    """A sweep's config file as its commands read it, from the repository root."""
    return os.path.join(sweep.ROOT, config)
