"""A usage error (an unknown flag, a bad choice, a missing value or subcommand) at any entry point is one
`error:` line naming the input and pointing at --help, with argparse's exit status 2, as every other refusal
is; --help still prints the help and exits 0. Every entry point builds its parser from
configs.cli.OneLineParser (python -m cd from its own copy: `cd` installs without configs)."""
import ast
import glob
import logging
import os
import subprocess
import sys

import pytest

from tests.conftest import DEBUG_CONFIG, ROOT, run_entry

ENTRY_POINTS = sorted({os.path.relpath(p, ROOT) for pattern in ("train.py", "evaluate*.py", "scripts/*.py",
                                                                 "cd/__main__.py")
                       for p in glob.glob(os.path.join(ROOT, pattern))})


def plain_parsers(path: str) -> list[int]:
    """Lines of `path` that build a plain argparse.ArgumentParser (a call, not a subclass's base)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "argparse" and \
                any(alias.name == "ArgumentParser" for alias in node.names):
            lines.append(node.lineno)  # `from argparse import ArgumentParser`: a plain one under another name
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "ArgumentParser":
                lines.append(node.lineno)
    return lines


def test_no_entry_point_builds_a_plain_argparse_parser():
    assert {"train.py", "evaluate.py", "evaluate_detection.py", "scripts/sweep.py",
            "scripts/mechanism.py", "cd/__main__.py"} <= set(ENTRY_POINTS)  # the glob finds them
    plain = {path: lines for path in ENTRY_POINTS if (lines := plain_parsers(path))}
    assert not plain, f"argparse.ArgumentParser prints a two-line usage error; use configs.cli.OneLineParser: {plain}"


def test_the_check_finds_a_plain_parser(tmp_path):
    """The AST check above is not blind: it flags each spelling of a plain parser, not a subclass."""
    for code, found in (("import argparse\np = argparse.ArgumentParser()\n", [2]),
                        ("from argparse import ArgumentParser\n", [1]),
                        ("import argparse\nclass P(argparse.ArgumentParser):\n    pass\np = P()\n", [])):
        (tmp_path / "s.py").write_text(code)
        assert plain_parsers(str(tmp_path / "s.py")) == found, code


def one_error_line(err: str, prog: str, says: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {prog}: ") and says in lines[0], lines[0]
    assert lines[0].endswith(f"; see {prog} --help"), lines[0]


@pytest.mark.parametrize("path, argv, prog, says", [
    ("train.py", ["--frobnicate"], "train.py", "unrecognized arguments: --frobnicate"),
    ("train.py", ["--config"], "train.py", "argument --config: expected one argument"),
    ("evaluate.py", ["--checkpoint", "x.pt", "--frobnicate"], "evaluate.py", "unrecognized arguments: --frobnicate"),
    ("evaluate.py", ["--amp", "fp8"], "evaluate.py", "argument --amp: invalid choice: 'fp8'"),
    ("scripts/mechanism.py", ["figures"], "mechanism.py", "unknown subcommand 'figures'; give one of surrogate"),
    ("scripts/mechanism.py", ["remove", "--out", "o", "--pipeline", "gptq"], "mechanism.py remove",
     "argument --pipeline: invalid choice: 'gptq'"),
    ("scripts/mechanism.py", ["energies", "--out", "o", "--device", "cpu"], "mechanism.py energies",
     "unrecognized arguments: --device"),
    ("scripts/paper_table.py", ["r.json", "--frobnicate"], "paper_table.py", "unrecognized arguments: --frobnicate"),
    ("scripts/paper_table.py", ["r.json", "--layout", "columns"], "paper_table.py",
     "argument --layout: invalid choice: 'columns'"),
    ("scripts/bench_overhead.py", ["--batches", "0"], "bench_overhead.py", "argument --batches: 0: must be at least"),
    # values a flag refuses on its own, checked after parsing (these exited 1): a usage error as argparse's
    ("scripts/bench_quant.py", ["--bits", "w4"], "bench_quant.py", "--bits w4: bit-width 'w4' is not of the form"),
    ("scripts/overhead_epochs.py", ["--batches", "--models"], "overhead_epochs.py",
     "--batches and --models are both empty: there is nothing to measure"),
    # flags sweep.py refuses together or alone (these exited 1): usage errors, before the sweep file (absent) is read
    ("scripts/sweep.py", ["no/such/sweep.yaml", "--eval-amp", "bf16"], "sweep.py",
     "--eval-amp bf16 sets the autocast of the evaluate.py commands, which only --evaluate adds"),
    ("scripts/sweep.py", ["no/such/sweep.yaml", "--recompute", "--evaluate"], "sweep.py",
     "--recompute is passed on to the evaluate.py commands"),
    ("scripts/sweep.py", ["no/such/sweep.yaml", "--recompute", "--run"], "sweep.py", "add --evaluate, or drop"),
    ("scripts/sweep.py", ["no/such/sweep.yaml", "--only", "train.max_steps=5"], "sweep.py",
     "--only needs the names of runs to keep"),
    # the optional `overrides` beside it is not named as required (Python 3.11's parse_intermixed_args did)
    ("scripts/sweep.py", [], "sweep.py", "the following arguments are required: sweep; see"),
])
def test_a_usage_error_is_one_error_line_with_status_2(path, argv, prog, says, capsys):
    code, out, err = run_entry(path, argv, capsys)
    assert code == 2 and not out
    one_error_line(err, prog, says)


@pytest.mark.parametrize("path, argv", [("train.py", []), ("evaluate.py", []), ("scripts/mechanism.py", ["remove"]),
                                        ("scripts/paper_table.py", [])])
def test_help_still_prints_the_help_and_exits_0(path, argv, capsys):
    code, out, err = run_entry(path, [*argv, "--help"], capsys)
    assert code == 0 and out.startswith("usage: ") and not err


def test_python_m_cd_usage_error_is_one_error_line_with_status_2(capsys):
    from cd.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--modle", "vit_tiny_patch16_224"])
    assert done.value.code == 2
    one_error_line(capsys.readouterr().err, "python -m cd", "unrecognized arguments: --modle")


def test_a_subparser_is_a_one_line_parser_too(capsys):
    """No entry point has subparsers yet; one added with add_subparsers inherits the class."""
    from configs.cli import OneLineParser

    parser = OneLineParser(prog="tool.py")
    sub = parser.add_subparsers(dest="command").add_parser("run")
    sub.add_argument("--k", type=int)
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["run", "--k", "x"])
    assert done.value.code == 2
    one_error_line(capsys.readouterr().err, "tool.py run", "argument --k: invalid int value: 'x'")


@pytest.mark.parametrize("path, argv, prog, says", [
    # argparse kept the last of a repeated single-value flag without a word: B alone was scored
    ("evaluate.py", ["--checkpoint", "A/best.pt", "--checkpoint", "B/best.pt", "--quant", "percentile", "--bits",
                     "w8a8"], "evaluate.py", "--checkpoint is given twice; give it once"),
    ("evaluate.py", ["--checkpoint", "A/best.pt", "--out=a.json", "--out", "b.json"], "evaluate.py",
     "--out is given twice"),
    ("evaluate.py", ["--checkpoint", "A/best.pt", "--amp", "fp16", "--am", "none"], "evaluate.py",
     "--amp is given twice"),  # an abbreviation is the same flag
    ("train.py", ["--print-config", "--config", DEBUG_CONFIG, "--print-config", "--print-config"], "train.py",
     "--print-config is given 3 times"),
    ("scripts/sweep.py", ["configs/sweeps/digits_demo.yaml", "--only", "baseline", "--only", "cd"], "sweep.py",
     "--only is given twice"),
    ("scripts/gap_test.py", ["ROOT", "base", "other", "--seeds", "0", "--seeds", "5"], "gap_test.py",
     "--seeds is given twice"),
    ("scripts/paper_table.py", ["r.json", "--layout", "rows", "--layout", "rows"], "paper_table.py",
     "--layout is given twice"),
])
def test_a_single_value_flag_given_twice_is_refused(path, argv, prog, says, capsys):
    code, out, err = run_entry(path, argv, capsys)
    assert code == 2 and not out
    one_error_line(err, prog, says)


@pytest.mark.parametrize("path, argv", [("scripts/paper_table.py", ["r.json"]),
                                        # (a model that fails fast where the flag would be ignored again)
                                        ("scripts/bench_quant.py", ["--model", "nosuchmodel"]),
                                        ("scripts/bench_aphq_block.py", ["--model", "nosuchmodel"])])
def test_overwrite_without_out_is_refused(path, argv, capsys):
    """--overwrite replaces the --out file: without an --out it was ignored (the table printed, the timings ran)."""
    code, out, err = run_entry(path, [*argv, "--overwrite"], capsys)
    assert code == 2 and not out
    one_error_line(err, os.path.basename(path), "--overwrite replaces the --out file, and no --out is given")


def test_every_spelling_of_a_flag_counts_and_flags_that_collect_take_repeats(capsys):
    """An alias, `--flag=value`, an abbreviation and the --no- form of a BooleanOptionalAction are the flag given
    again; append, extend and count options collect their repeats (that is what they are for), and a subparser
    counts its own flags."""
    import argparse

    import evaluate
    from configs.cli import OneLineParser

    def parser():
        p = OneLineParser(prog="tool.py")
        p.add_argument("-o", "--out")
        p.add_argument("--fast", action=argparse.BooleanOptionalAction)
        p.add_argument("--fp16", dest="amp", action="store_const", const="fp16")
        p.add_argument("--tag", action="append")
        p.add_argument("--item", nargs="+", action="extend")
        p.add_argument("-v", action="count")
        p.add_argument("words", nargs="*")
        return p

    for argv, says in ((["-o", "a", "--out", "b"], "-o/--out is given twice"),
                       (["--out=a", "--ou", "b"], "-o/--out is given twice"),
                       (["--fast", "--no-fast"], "--fast/--no-fast is given twice"),
                       (["--fp16", "x", "--fp16"], "--fp16 is given twice"),
                       (["-o", "a", "-o", "b", "--fast", "--fast"],
                        "-o/--out is given twice; --fast/--no-fast is given twice; give each once")):
        for parse in (parser().parse_args, parser().parse_intermixed_args):
            with pytest.raises(SystemExit) as done:
                parse(argv)
            assert done.value.code == 2
            one_error_line(capsys.readouterr().err, "tool.py", says)
    args = parser().parse_intermixed_args(["--tag", "a", "w", "--tag", "b", "--item", "x", "--item", "y", "-vv",
                                           "-v", "--out", "o", "z"])
    assert (args.tag, args.item, args.v, args.out, args.words) == (["a", "b"], ["x", "y"], 3, "o", ["w", "z"])
    sub = OneLineParser(prog="tool.py")
    sub.add_argument("--k")
    run = sub.add_subparsers(dest="command").add_parser("run")
    run.add_argument("--k")
    assert sub.parse_args(["--k", "1", "run", "--k", "2"]).command == "run"  # one each: two parsers' flags
    with pytest.raises(SystemExit):
        sub.parse_args(["run", "--k", "2", "--k", "3"])
    one_error_line(capsys.readouterr().err, "tool.py run", "--k is given twice")
    # evaluate.py's collecting flags: both config layers, both pipelines
    args = evaluate.parse_args(["--checkpoint", "c.pt", "--config", "a.yaml", "--config", "b.yaml", "--quant",
                                "repq", "--quant", "aphq", "--bits", "w4a4", "--bits", "w8a8"])
    assert (args.config, args.quant, args.bits) == (["a.yaml", "b.yaml"], ["repq", "aphq"], ["w4a4", "w8a8"])


@pytest.mark.parametrize("command, prog", [(["train.py"], "train.py"), (["-m", "cd"], "python -m cd")])
def test_the_whole_process_writes_one_line_and_exits_2(command, prog):
    """The real command, in a process of its own: nothing else reaches stderr (no warning, no usage block; an
    import-time warning of torch, timm or `cd` would show here and in no in-process test)."""
    done = subprocess.run([sys.executable, *command, "--frobnicate"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr == f"error: {prog}: unrecognized arguments: --frobnicate; see {prog} --help\n", done.stderr


def test_an_entry_point_run_in_this_process_leaves_no_log_handler_behind(tmp_path, capsys):
    """conftest.run_entry stands for a process: the handlers that the run's logging setup adds (stdout as captured
    for this test, out_dir/train.log) end with it. Left on the root logger, they wrote the log records of later
    tests into this test's closed capture ('--- Logging error ---' and a traceback on those tests' stderr)."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    (tmp_path / "checkpoint.pt").write_bytes(b"")  # refused once the run's logging is set up
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={tmp_path}"], capsys)
    assert code == 1 and "error: cannot resume from" in err, err[-2000:]
    assert "cannot resume from" in (tmp_path / "train.log").read_text()  # the run had set up its logging
    assert root.handlers == before and root.level == level


@pytest.mark.parametrize("path, prog, required", [
    ("scripts/quant_sensitivity.py", "quant_sensitivity.py", ["--checkpoint", "c.pt", "--out", "o"]),
    ("scripts/crosscheck_aphq.py", "crosscheck_aphq.py",
     ["--checkpoint", "c.pt", "--official", "o", "--out", "o.json"]),
])
def test_a_script_that_runs_evaluate_names_its_options_in_help(path, prog, required, capsys):
    """The key=value overrides these scripts pass on are evaluate.py's: --help says where they are listed and
    which of evaluate.py's flags the script does not take; such a flag is still a usage error."""
    code, out, err = run_entry(path, ["--help"], capsys)
    assert code == 0 and not err
    epilog = " ".join(out.split("evaluate.py's options:")[1].split())  # argparse wraps it
    assert "python evaluate.py --help-config" in epilog, out
    own, _, other = epilog.partition("does not take")
    assert all(f in own for f in ("--checkpoint", "--out", "--bits")), epilog
    assert all(f in other for f in ("--ema", "--amp", "--config", "--quant", "--recompute")), epilog
    assert "--help " not in epilog and "--help," not in epilog, epilog  # --help-config is a flag, --help is not
    code, out, err = run_entry(path, [*required, "--ema"], capsys)
    assert code == 2 and not out
    one_error_line(err, prog, "unrecognized arguments: --ema")



def docstring_uses(path: str) -> list[int]:
    """Lines of `path` that take an attribute or item of the module's `__doc__` (`__doc__.splitlines()[0]`),
    which is None under `python -OO`."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read(), path)
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.value, ast.Name)
                  and node.value.id == "__doc__")


def test_no_entry_point_needs_its_docstring_to_build_its_parser():
    """`python -OO` (PYTHONOPTIMIZE=2, which some containers and launchers set) strips docstrings: a parser
    built from `__doc__.splitlines()[0]` ended its script in an AttributeError before any argument was read
    (twelve entry points did); configs.cli.first_line is the spelling that survives it."""
    used = {path: lines for path in ENTRY_POINTS if (lines := docstring_uses(path))}
    assert not used, f"__doc__ is None under python -OO; use configs.cli.first_line(__doc__): {used}"


def test_the_docstring_check_finds_each_use_and_first_line_survives_OO(tmp_path):
    from configs.cli import first_line

    for code, found in (('"""D."""\nd = __doc__.splitlines()[0]\n', [2]), ("d = __doc__[:10]\n", [1]),
                        ("d = first_line(__doc__)\n", []), ("p = P(description=__doc__)\n", [])):
        (tmp_path / "s.py").write_text(code)
        assert docstring_uses(str(tmp_path / "s.py")) == found, code
    assert first_line(None) == "" and first_line("One.\n\nMore.") == "One."
    assert first_line("One sentence\n    over two lines.\n    \nMore.") == "One sentence over two lines."


def test_each_description_from_first_line_is_a_whole_sentence():
    """make_coco_sample.py's, train_detection.py's and evaluate_detection.py's --help descriptions stopped
    mid-sentence: first_line took the first physical line of a docstring whose first sentence runs on. Each entry
    point that builds its description so gives one line that ends its sentence and starts with that first line."""
    from configs.cli import first_line
    users = [path for path in ENTRY_POINTS if "first_line(__doc__)" in open(os.path.join(ROOT, path)).read()]
    assert {"scripts/make_coco_sample.py", "scripts/train_detection.py", "evaluate_detection.py"} <= set(users)
    for path in users:
        doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, path)).read(), path), clean=False)
        described = first_line(doc)
        assert "\n" not in described and described.endswith("."), (path, described)
        assert described.startswith(doc.strip().splitlines()[0].strip()), (path, described)
