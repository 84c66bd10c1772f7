"""A newcomer's path: the README's own-loop example runs in the environment its install line describes; long
work (APHQ) says how long it will take and shows progress; a stop or a typo ends in one line; no lock file
is left behind; the number of DataLoader workers fits the machine."""
import ast
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib

import pytest

import evaluate
from tests.conftest import ROOT


def readme_section(title: str) -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index(title)
    return text[start:text.index("\n## ", start)]


def test_the_own_loop_example_needs_only_what_its_install_line_installs():
    section = readme_section("### Add CD to your own training loop")
    install = re.search(r"```bash\n(pip install [^\n]*)", section).group(1)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = re.findall(r"\[([\w,]+)\]", install)
    assert extras, install
    installed = {"cd"} | {re.split(r"[<>=! ]", d)[0] for d in project["dependencies"]}
    for extra in extras[0].split(","):
        installed |= {re.split(r"[<>=! ]", d)[0] for d in project["optional-dependencies"][extra]}
    imported = {name.split(".")[0] for node in ast.walk(ast.parse(code))
                for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module] if isinstance(node, ast.ImportFrom) else [])}
    assert imported - sys.stdlib_module_names <= installed, (imported, installed)


def test_the_own_loop_example_runs_as_written_on_a_smaller_model(monkeypatch, capsys, one_thread):
    """The README's code, as it stands, with timm building a two-block model (the example's deit_tiny
    takes half a minute on a 2-core CPU; the wheel test runs the installed package the same way)."""
    import timm

    create = timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda name, **kw: create(name, depth=2, **kw))
    code = re.search(r"```python\n(.*?)```", readme_section("### Add CD to your own training loop"), re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert "'cd/updates': 10.0" in capsys.readouterr().out


def test_a_misspelled_model_name_is_one_line_with_close_names(capsys):
    """python -m cd's main in this process (a process would import torch and timm again, seconds)."""
    from cd.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--model", "vit_bse_patch16_224"])
    assert done.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: unknown timm model 'vit_bse_patch16_224'; did you mean vit_base_patch16_224, "
        "vit_base_patch16_xp_224, samvit_base_patch16_224?"]


@pytest.mark.parametrize("argv", [["--model", "vit_tiny_patch16_224", "--model", "deit_tiny_patch16_224"],
                                  ["--model=vit_tiny_patch16_224", "--mod", "deit_tiny_patch16_224"]])
def test_a_model_given_twice_is_one_line(capsys, argv):
    """`--model a --model b` had listed b's pairs alone, without a word."""
    from cd.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: python -m cd: --model is given twice; give it once; see python -m cd --help"]


@pytest.mark.parametrize("name,how,start", [
    ("xcit_nano_12_p16_224", "cd/families.py's tiny xcit config", "block 'blocks.0' (XCABlock)"),
    ("davit_tiny", "depths=(1, 1, 1, 1)", "block 'stages.0.blocks.0.1' (ChannelBlock)"),
])
def test_a_model_the_checks_on_real_numbers_refuse_is_refused_by_the_cli(capsys, name, how, start):
    """The meta model has no values for the V-row and channel-order checks (its table was printed, status 0): a
    small CPU copy runs them, and the refusal is one `error:` line with status 2, as find_pairs' on the model."""
    from cd.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--model", name])
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith(f"error: {name}: {start} is not supported by CD: ") and \
        err.endswith(f"(found by the checks on real numbers, run on a copy built on the CPU with {how})\n"), err


def test_a_norm_on_vs_way_to_proj_is_refused_by_the_cli_on_the_meta_model(capsys):
    """MViTv2's LayerNorm on V (attn.norm_v) was refused only by the checks on real numbers, run on a small CPU copy;
    the meta forward now names the norm (cd/verify.py): one `error:` line, status 2, nothing on stdout."""
    from cd.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--model", "mvitv2_tiny"])
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("error: mvitv2_tiny: MultiScaleVit is not supported by CD: block 'stages.0.blocks.0' "
                          "(MultiScaleBlock): the proj pair: the norm stages.0.blocks.0.attn.norm_v (LayerNorm) "
                          "stands on V's way from stages.0.blocks.0.attn.qkv to stages.0.blocks.0.attn.proj"), err


def test_a_model_without_a_small_copy_says_the_checks_on_real_numbers_were_not_run(capsys, monkeypatch):
    import cd.__main__

    monkeypatch.setattr(cd.__main__, "_SMALL", ())  # vit_small is in no family's tiny config: no copy to try
    cd.__main__.main(["--model", "vit_small_patch16_224"])
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "48 pairs: qkv 12, proj 12, fc1 12, fc2 12"
    assert err.splitlines() == ["note: vit_small_patch16_224: the checks on real numbers (V rows, channel order) "
                                "were not run: no small copy of it could be built and run on the CPU; "
                                "find_pairs(model) on the real model runs them"]


def test_missing_inputs_are_named_with_their_fix(tmp_path):
    """The README's ImageNet / fine-tuning / evaluation commands on a machine without the data, weights or run:
    each error names the input and what to give instead (they said only "does not exist" / "not found")."""
    from torch import nn

    from data.folder import DataError, find_split
    from engine.checkpoint import CheckpointError, load_checkpoint
    from models.pretrained import ModelError, load_pretrained

    missing = str(tmp_path / "imagenet")
    with pytest.raises(DataError) as e:
        find_split(missing, "val")
    assert f"data.root '{missing}' does not exist" in str(e.value)
    assert "set data.root to the folder that holds the val/ class folders" in str(e.value)
    with pytest.raises(ModelError) as e:
        load_pretrained(nn.Linear(2, 2), str(tmp_path / "deit_base.pth"))
    assert f"model.pretrained={tmp_path / 'deit_base.pth'} is no such file" in str(e.value)
    assert "give the path of a local .pth, .pt or .safetensors weights file" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tmp_path / "best.pt"))
    assert str(e.value).startswith(f"checkpoint not found: {tmp_path / 'best.pt'}; ")
    assert "best.pt or checkpoint.pt that train.py wrote" in str(e.value)


@pytest.mark.slow  # an evaluate.py process stopped by a signal
def test_ctrl_c_in_evaluate_is_one_line_and_keeps_what_was_written(checkpoint, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "evaluate.py", "--checkpoint", checkpoint, "--out", str(out),
                             "--quant", "repq", "--bits", "w4a4", "w6a6", "w8a8", "w3a3", "w5a5"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    plot = tmp_path / "r_act_max.png"  # written after the JSON names it; then the pipelines run
    while not (out.exists() and plot.exists()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)  # the FP result and the maxima files are written: the pipelines run now
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted; the results finished so far are in")
    assert not list(tmp_path.glob("*.lock"))


def test_no_lock_file_is_left_after_evaluation_or_training(checkpoint, tmp_path, debug_config):
    out = tmp_path / "r.json"
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", str(out)]))
    assert out.exists() and not list(tmp_path.glob("*.lock"))
    import train

    cfg = debug_config("train.max_steps=1", name="t")
    train.main(cfg)
    assert ".run.lock" not in os.listdir(cfg.out_dir)


def test_a_removed_lock_file_is_locked_afresh_by_the_process_that_waited(tmp_path):
    """The holder removes the file on release; a waiter that had opened the old file must not take it for
    the lock (a third process could then lock a new file at the same path)."""
    from engine.run_dir import LockBusy, exclusive_lock

    path = str(tmp_path / "r.json.lock")
    inside, order = threading.Event(), []

    def second():
        with exclusive_lock(path, wait=True):  # blocks on the first holder's file
            order.append("second")
            inside.set()
            time.sleep(0.3)

    with exclusive_lock(path, wait=True):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)  # the second is waiting on this file now
        order.append("first")
    inside.wait(5)
    with pytest.raises(LockBusy):  # the second holds the file now at the path
        with exclusive_lock(path, wait=False):
            pass
    thread.join()
    assert order == ["first", "second"] and not os.path.exists(path)


def test_a_file_of_the_lock_s_name_that_is_not_ours_is_left_as_it_is(tmp_path):
    from engine.run_dir import exclusive_lock

    path = tmp_path / "notes.lock"
    path.write_text("my notes")
    with exclusive_lock(str(path), wait=True):
        pass
    assert path.read_text() == "my notes"


@pytest.mark.parametrize("cpus, processes, setting, expected", [(2, "1", None, 1), (2, "2", None, 0),
                                                               (64, "1", None, 8), (64, "8", None, 7),
                                                               (2, "1", 8, 8)])
def test_the_number_of_workers_fits_the_machine_unless_set(monkeypatch, cpus, processes, setting, expected):
    from data.loader import worker_count

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", processes)
    assert worker_count(setting) == expected


def test_aphq_says_how_long_it_will_take_and_shows_progress(checkpoint, tmp_path, caplog):
    # the least work that still logs each message (12 iterations: the estimate comes after the first 10)
    fast = ["quant.aphq.iters=12", "quant.aphq.recon_images=4", "quant.aphq.calib_images=4",
            "quant.aphq.batch_size=4", "quant.aphq.matmul_steps=2", "quant.aphq.search_rounds=1",
            "quant.aphq.eq_n=32", "quant.aphq.search_max_rows=8", "quant.aphq.log_every=0"]
    with caplog.at_level("INFO"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "aphq", "--out",
                                           str(tmp_path / "r.json"), *fast]))
    text = caplog.text
    assert re.search(r"APHQ calibration: unit 1/\d+ \S+ searched \[[\d.]+s\]; about \d+:\d\d:\d\d left", text)
    assert "APHQ reconstruction: " in text and "a time estimate follows" in text
    assert re.search(r": 10 iterations in [\d.]+s; about \d+:\d\d:\d\d for its 12 iterations", text)
    assert re.search(r"APHQ reconstruction: about \d+:\d\d:\d\d left for the other \d+ units", text)
