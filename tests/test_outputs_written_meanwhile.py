"""A script's output that another command wrote after this one started (both given the same --out, both past the
check at their start) is kept: without --overwrite this command is refused with one `error:` line naming the file
and --overwrite, and leaves no temporary; with --overwrite it replaces it. Checked at the writer
(run_dir.write_whole, also on a file system without hard links) and in the scripts whose outputs cost most."""
from __future__ import annotations

import errno
import json
import os

import pytest

from engine import run_dir
from engine.run_dir import RunDirError, write_whole
from tests.conftest import load_script

THEIRS = "the other command's output"


def write(text: str):
    def to(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    return to


@pytest.fixture(params=["hard links", "no hard links"])
def file_system(request, monkeypatch):
    """Both kinds of file system: one without hard links (os.link fails with EPERM, as on some FUSE mounts)."""
    if request.param == "no hard links":
        def no_link(src, dst, **kw):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(run_dir.os, "link", no_link)
    return request.param


def test_a_new_output_is_written(tmp_path, file_system):
    path = tmp_path / "out.json"
    write_whole(str(path), write("ours"), overwrite=False)
    assert path.read_text() == "ours" and os.listdir(tmp_path) == ["out.json"]


def test_an_output_written_meanwhile_is_kept_without_overwrite(tmp_path, file_system):
    path = tmp_path / "out.json"
    path.write_text(THEIRS)
    with pytest.raises(RunDirError) as refused:
        write_whole(str(path), write("ours"), overwrite=False)
    assert str(path) in str(refused.value) and "--overwrite" in str(refused.value)
    assert path.read_text() == THEIRS and os.listdir(tmp_path) == ["out.json"]


def test_overwrite_replaces_it(tmp_path, file_system):
    path = tmp_path / "out.json"
    path.write_text(THEIRS)
    write_whole(str(path), write("ours"), overwrite=True)
    assert path.read_text() == "ours" and os.listdir(tmp_path) == ["out.json"]


def written_after_the_check(module, monkeypatch, text: str = THEIRS) -> None:
    """The script's start-up check passes, then another command writes `text` to each output it checked."""
    if not hasattr(module, "refuse_existing_outputs"):  # imported inside main(): from engine.run_dir then
        module = run_dir
    check = module.refuse_existing_outputs

    def then_another_command_writes(paths, overwrite, *args, **kwargs):
        check(paths, overwrite, *args, **kwargs)
        for path in paths:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    monkeypatch.setattr(module, "refuse_existing_outputs", then_another_command_writes)


def refused_line(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as refused:
        main(argv)
    code = refused.value.code
    message = code if isinstance(code, str) else capsys.readouterr().err.strip()
    assert code not in (0, None) and "\n" not in message.strip(), message
    return message


def test_bench_overhead_keeps_an_apply_json_written_meanwhile(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_overhead")
    written_after_the_check(bench, monkeypatch)
    argv = ["--device", "cpu", "--small", "--apply-only", "--widths", "32", "--steps", "1", "--warmup", "0",
            "--threads", "1", "--out", str(tmp_path)]
    message = refused_line(bench.main, argv, capsys)
    assert message.startswith(f"error: {tmp_path / 'apply.json'} ") and "--overwrite" in message, message
    assert (tmp_path / "apply.json").read_text() == THEIRS and os.listdir(tmp_path) == ["apply.json"]


def test_overhead_epochs_keeps_outputs_written_meanwhile(tmp_path, monkeypatch, capsys):
    from tests.conftest import ROOT
    from tests.test_bench_overhead import run_commands_with

    epochs = load_script("overhead_epochs")
    written_after_the_check(epochs, monkeypatch)

    def finished_run(cmd, cwd):  # a train.py stand-in: a run that timed its epochs
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("out_dir="))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"epoch/train_seconds": 1.0}) + "\n")
        return type("Done", (), {"returncode": 0})()

    run_commands_with(monkeypatch, finished_run)
    monkeypatch.chdir(ROOT)
    argv = ["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8", "--models",
            "--methods", "baseline", "--epochs", "1", "--runs", "1", "--out", str(tmp_path)]
    message = refused_line(epochs.main, argv, capsys)
    assert message.startswith(f"error: {tmp_path / 'epochs.json'} ") and "--overwrite" in message, message
    assert (tmp_path / "epochs.json").read_text() == THEIRS and (tmp_path / "epochs.png").read_text() == THEIRS
    assert sorted(os.listdir(tmp_path)) == ["epochs.json", "epochs.png", "runs"]


def test_bench_quant_keeps_a_file_written_meanwhile(tmp_path, monkeypatch, capsys):
    from tests.test_bench_quant import SMALL
    bench_quant = load_script("bench_quant")
    written_after_the_check(bench_quant, monkeypatch)
    out = tmp_path / "q.json"
    message = refused_line(bench_quant.main, SMALL + ["--out", str(out)], capsys)
    assert message.startswith(f"error: {out} ") and "--overwrite" in message, message
    assert out.read_text() == THEIRS and os.listdir(tmp_path) == ["q.json"]


# An apply.json of the script's own (its keys), as another bench_overhead.py command writes it
ITS_OWN = '{"model": {}, "warmup": 0, "steps": 1, "apply_only": []}'


def test_with_overwrite_the_script_replaces_its_own(tmp_path, monkeypatch):
    bench = load_script("bench_overhead")
    written_after_the_check(bench, monkeypatch, ITS_OWN)
    bench.main(["--device", "cpu", "--small", "--apply-only", "--widths", "32", "--steps", "1", "--warmup", "0",
                "--threads", "1", "--out", str(tmp_path), "--overwrite"])
    assert (tmp_path / "apply.json").read_text() != ITS_OWN and os.listdir(tmp_path) == ["apply.json"]


def test_with_overwrite_the_script_keeps_another_s_file_written_meanwhile(tmp_path, monkeypatch, capsys):
    """--overwrite replaces only the script's own outputs (engine.outputs.refuse_others_files), also at the write:
    another's file put there after the start-up check is kept, with one error line."""
    bench = load_script("bench_overhead")
    written_after_the_check(bench, monkeypatch)
    argv = ["--device", "cpu", "--small", "--apply-only", "--widths", "32", "--steps", "1", "--warmup", "0",
            "--threads", "1", "--out", str(tmp_path), "--overwrite"]
    message = refused_line(bench.main, argv, capsys)
    assert message.startswith(f"error: {tmp_path / 'apply.json'} is not a file bench_overhead.py wrote"), message
    assert (tmp_path / "apply.json").read_text() == THEIRS and os.listdir(tmp_path) == ["apply.json"]


def test_compare_act_max_keeps_a_table_and_figure_written_meanwhile(tmp_path, monkeypatch, capsys):
    from tests.test_compare_act_max import run_rows
    from tests.test_compare_act_max import write as write_run
    compare = load_script("compare_act_max")
    written_after_the_check(compare, monkeypatch)
    runs = tmp_path / "runs"
    runs.mkdir()
    write_run(runs / "m_s0_act_max.csv", run_rows([9.0, 2.0], [1.0, 8.0], [4.0, 3.0]))
    out = tmp_path / "cmp"
    message = refused_line(compare.main, [f"m={runs}/m_s*_act_max.csv", "--out", str(out)], capsys)
    assert message.startswith(f"error: {out}.csv ") and "--overwrite" in message, message
    assert (tmp_path / "cmp.csv").read_text() == THEIRS and (tmp_path / "cmp.png").read_text() == THEIRS
    assert sorted(os.listdir(tmp_path)) == ["cmp.csv", "cmp.png", "runs"]


# A symbolic link as the output is written through, as open(path, "w") writes: its target gets the output and the
# link stays (a link often places a table into a paper's sources)

def linked(tmp_path, target_text=None):
    """(the link out/table.md, its target paper/table.md, holding `target_text` where given)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "paper").mkdir()
    target = tmp_path / "paper" / "table.md"
    if target_text is not None:
        target.write_text(target_text)
    link = tmp_path / "out" / "table.md"
    link.symlink_to(target)
    return link, target


def test_overwrite_writes_through_a_link_to_its_target(tmp_path, file_system):
    from engine.outputs import write_text

    link, target = linked(tmp_path, "old")
    run_dir.refuse_existing_outputs([str(link)], overwrite=True)
    write_text(str(link), "new\n", True)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    assert os.listdir(tmp_path / "out") == ["table.md"] and os.listdir(tmp_path / "paper") == ["table.md"]


def test_a_link_to_a_file_is_an_existing_output(tmp_path, file_system):
    link, target = linked(tmp_path, THEIRS)
    with pytest.raises(RunDirError) as refused:  # at the start
        run_dir.refuse_existing_outputs([str(link)], overwrite=False)
    assert str(link) in str(refused.value) and "--overwrite" in str(refused.value)
    with pytest.raises(RunDirError) as refused:  # at the write (another command made the target meanwhile)
        write_whole(str(link), write("ours"), overwrite=False)
    assert str(target) in str(refused.value) and "--overwrite" in str(refused.value)
    assert link.is_symlink() and target.read_text() == THEIRS
    assert os.listdir(tmp_path / "out") == ["table.md"] and os.listdir(tmp_path / "paper") == ["table.md"]


def test_a_dangling_link_without_overwrite_gets_its_target_written(tmp_path, file_system):
    link, target = linked(tmp_path)
    run_dir.refuse_existing_outputs([str(link)], overwrite=False)  # no file there yet: not an existing output
    write_whole(str(link), write("ours"), overwrite=False)
    assert link.is_symlink() and target.read_text() == "ours"
    assert os.listdir(tmp_path / "paper") == ["table.md"]


def test_a_link_that_leads_to_no_folder_or_round_is_refused_by_name(tmp_path):
    (tmp_path / "nowhere.md").symlink_to(tmp_path / "missing" / "table.md")
    (tmp_path / "a.md").symlink_to(tmp_path / "b.md")
    (tmp_path / "b.md").symlink_to(tmp_path / "a.md")
    for name, says in (("nowhere.md", "folder does not exist"), ("a.md", "loop")):
        path = str(tmp_path / name)
        for refuse in (lambda: run_dir.refuse_existing_outputs([path], overwrite=True),
                       lambda: write_whole(path, write("ours"), overwrite=True)):
            with pytest.raises(RunDirError) as refused:
                refuse()
            assert str(refused.value).startswith(f"{path} is a link") and says in str(refused.value)
    assert sorted(os.listdir(tmp_path)) == ["a.md", "b.md", "nowhere.md"]
    assert all(os.path.islink(tmp_path / n) for n in ("a.md", "b.md", "nowhere.md"))


def test_a_scripts_output_that_is_a_link_is_written_through_with_overwrite(tmp_path):
    bench = load_script("bench_overhead")
    (tmp_path / "out").mkdir()
    (tmp_path / "kept").mkdir()
    target = tmp_path / "kept" / "apply.json"
    target.write_text(ITS_OWN)  # an earlier apply.json of the script: --overwrite replaces only its own
    (tmp_path / "out" / "apply.json").symlink_to(target)
    bench.main(["--device", "cpu", "--small", "--apply-only", "--widths", "32", "--steps", "1", "--warmup", "0",
                "--threads", "1", "--out", str(tmp_path / "out"), "--overwrite"])
    assert (tmp_path / "out" / "apply.json").is_symlink()
    assert target.read_text() != ITS_OWN and "apply_only" in json.loads(target.read_text())  # the new, through it


def test_overhead_epochs_with_overwrite_keeps_another_s_outputs_written_during_its_runs(tmp_path, monkeypatch,
                                                                                          capsys):
    """--overwrite replaces only the protocol's own epochs.json / epochs.png (engine.outputs.refuse_others_files),
    also at the write after the runs: another's files put there while the runs trained are kept, with one error
    line."""
    from tests.conftest import ROOT
    from tests.test_bench_overhead import run_commands_with

    epochs = load_script("overhead_epochs")

    def run_while_another_writes(cmd, cwd):  # a train.py stand-in; meanwhile another command writes both files
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("out_dir="))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"epoch/train_seconds": 1.0}) + "\n")
        for name in ("epochs.json", "epochs.png"):
            (tmp_path / name).write_text(THEIRS)
        return type("Done", (), {"returncode": 0})()

    run_commands_with(monkeypatch, run_while_another_writes)
    monkeypatch.chdir(ROOT)
    argv = ["--recipe", "configs/debug/tiny.yaml", "--global-batch", "16", "--batches", "8", "--models",
            "--methods", "baseline", "--epochs", "1", "--runs", "1", "--out", str(tmp_path), "--overwrite"]
    message = refused_line(epochs.main, argv, capsys)
    assert message.startswith(f"error: {tmp_path / 'epochs.json'} is not a file overhead_epochs.py wrote"), message
    assert (tmp_path / "epochs.json").read_text() == THEIRS and (tmp_path / "epochs.png").read_text() == THEIRS
    assert sorted(os.listdir(tmp_path)) == ["epochs.json", "epochs.png", "runs"]


@pytest.mark.parametrize("name", ["timing.out", "timing"])
def test_a_json_of_its_own_at_an_out_not_named_json_is_replaced_with_overwrite(tmp_path, name):
    """A script whose only output is a JSON (bench_quant, bench_aphq_block, crosscheck_aphq, crosscheck_lm_quant)
    writes it at any --out; its second run with --overwrite was refused there, its own file read as a CSV without
    'the header of its columns'. The file is judged by its JSON keys whatever its name; another file is refused."""
    from engine.outputs import refuse_others_files
    path = tmp_path / name
    path.write_text(json.dumps({"model": "vit", "block": "blocks.5", "hessian_batch_s": 1.0}, indent=2))
    refuse_others_files([str(path)], "scripts/bench.py", json_keys=("model", "hessian_batch_s"))  # its own: taken
    path.write_text('{"model": "vit", "fp": {"top1": 79.9}}')
    with pytest.raises(RunDirError, match=r"is not a file bench\.py wrote \(a JSON object with the keys model, "
                                          r"hessian_batch_s is not there\)"):
        refuse_others_files([str(path)], "scripts/bench.py", json_keys=("model", "hessian_batch_s"))
