"""What the command lines of train.py and evaluate.py tell a user: --help lists every config section,
--help-config every key with its default, type, allowed values and help text, --print-config the resolved
config without running anything, and the timm / DeiT flags get our spelling of them."""
import dataclasses
import os
import shutil
import sys
import typing

import pytest
import yaml

import evaluate
import train
from configs import Config, ConfigError, config_from_dict, config_to_dict, load_config
from configs.cli import field_help
from configs.loader import get_key, schema_keys
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG

LEAVES = [k for k in schema_keys() if not dataclasses.is_dataclass(get_key(Config(), k))]
SECTIONS = [k for k in schema_keys() if dataclasses.is_dataclass(get_key(Config(), k))]


def keys_in(listing: str) -> list[str]:
    """The keys of a --help-config listing (each entry's first line: `  key = default  (type)`)."""
    return [line.split(" = ")[0].strip() for line in listing.splitlines()
            if line.startswith("  ") and not line.startswith("      ") and " = " in line]


def run(entry, argv, capsys) -> tuple[int, str]:
    """(exit code, stdout) of `entry.parse_args(argv)` for options that print and exit."""
    with pytest.raises(SystemExit) as done:
        entry.parse_args(argv)
    return done.value.code or 0, capsys.readouterr().out


@pytest.mark.parametrize("entry", [train, evaluate], ids=["train", "evaluate"])
def test_help_lists_every_section_and_points_to_help_config(entry, capsys):
    code, out = run(entry, ["--help"], capsys)
    assert code == 0 and "--help-config [SECTION]" in out and "--print-config" in out
    listing = out[out.index("config sections"):]
    for f in dataclasses.fields(Config):
        value = getattr(Config(), f.name)
        summary = (typing.cast(str, type(value).__doc__).splitlines()[0] if dataclasses.is_dataclass(value)
                   else field_help(Config, f.name))
        assert f"  {f.name:<9} {summary}" in listing, f.name


def test_every_key_has_help_text():
    """The schema's comments are the help: a key without one is a key nobody can look up."""
    def owner(key: str) -> type:
        section = key.rpartition(".")[0]
        return type(get_key(Config(), section) if section else Config())

    assert len(LEAVES) > 150
    assert [k for k in LEAVES if not field_help(owner(k), k.rpartition(".")[2])] == []
    # dataclasses without a docstring get their signature as __doc__
    sections = [type(get_key(Config(), s)) for s in SECTIONS]
    assert [c.__name__ for c in sections if c.__doc__.startswith(c.__name__ + "(")] == []


def test_help_config_lists_every_key_with_default_type_range_and_help(capsys):
    code, out = run(train, ["--help-config"], capsys)
    assert code == 0
    assert keys_in(out) == LEAVES  # every key once, in schema order
    assert "  sched.epochs = 300  (int, >= 1)\n      total training epochs, warmup included\n" in out
    assert "  train.amp = fp16  (one of none | fp16 | bf16)\n" in out  # choices
    assert ("  optim.lr = null  (float or null, > 0 and below float32's largest number, 3.40282e+38)\n      absolute "
            "peak lr") in out  # optional with a range
    assert ("  data.mean = [0.485, 0.456, 0.406]  (tuple, 3 finite numbers, each >= 0 and <= 1 (the model's input "
            "tensors are on the 0..1 scale: divide values on the 0..255 scale by 255))\n") in out
    # a continued comment is one help text; a comment above a field is its help when it has none after it
    assert "None: RepQ set for percentile_mse, (0.9999,) for percentile" in out
    assert ("  quant.percentile.weight_range = percentile_mse  (one of percentile_mse | percentile | "
            "minmax)\n      weight range rule\n") in out
    assert "  quant.gplq.qwt_target = float  (one of float | w32a4 | teacher)\n      reference block: " in out


def test_help_config_of_one_section_or_key(capsys):
    code, out = run(train, ["--help-config", "quant.aphq"], capsys)
    assert code == 0 and out.startswith("quant.aphq: APHQ options")
    assert keys_in(out) == [k for k in LEAVES if k.startswith("quant.aphq.")]
    code, out = run(evaluate, ["--help-config", "data.root"], capsys)
    assert code == 0 and out.startswith("  data.root = ''  (str, a path (~ is the home folder))\n      data set folder")


def test_help_config_of_log_act_max_names_every_key_it_logs_and_the_kurtosis_definition(capsys):
    """log.act_max logs four keys (train.py's validation: `ActMaxResult.metrics` of a probe with moments); its help
    names them all, and what the kurtosis is, not the maxima alone."""
    from engine.act_max import ActMaxResult

    record = {"kind": "module", "kurtosis": 3.0, "max": 1.0}  # as the probe records an output
    keys = ActMaxResult(1.0, 1.0, [record, {**record, "kind": "block"}]).metrics()
    code, out = run(train, ["--help-config", "log.act_max"], capsys)
    text = " ".join(out.split())
    assert code == 0 and len(keys) == 4 and all(key in text for key in keys), (keys, text)
    assert "Pearson, 3 for a Gaussian" in text and "softmax probabilities left out" in text


def test_help_config_names_a_wrong_section(capsys):
    with pytest.raises(SystemExit) as done:
        train.parse_args(["--help-config", "shed"])
    assert done.value.code == 2
    assert capsys.readouterr().err == ("error: unknown config section 'shed'; did you mean 'sched'? "
                                       "(--help-config alone lists every section)\n")  # one line, no usage


def test_print_config_prints_the_resolved_config_and_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["--config", DEBUG_CONFIG, "optim.lr=1e-3", "sched.epochs=7"]
    code, out = run(train, [*argv, "--print-config"], capsys)
    assert code == 0 and os.listdir(tmp_path) == []  # no run folder, no log
    printed = config_from_dict(yaml.safe_load(out))
    expected = load_config([DEBUG_CONFIG], ["optim.lr=1e-3", "sched.epochs=7", "out_dir=runs/tiny"])
    assert printed == expected
    # the printed YAML is itself a config file that gives the same run
    (tmp_path / "resolved.yaml").write_text(out)
    assert train.parse_args(["--config", str(tmp_path / "resolved.yaml")]) == expected


@pytest.mark.parametrize("overrides", [["quant.bits=[w4a4,w4a4]"], ["optim.name=ADAMW"], ["optim.name=nosuchopt"],
                                       ["sched.min_lr=1"], ["cd.enabled=true", "cd.lam_per_role={nosuch: 0.1}"]],
                         ids=["quant_bits_twice", "optim_upper_case", "optim_unknown", "min_lr_above_peak", "cd_role"])
def test_print_config_refuses_what_a_run_refuses_before_it_starts(tmp_path, monkeypatch, capsys, overrides):
    """--print-config printed these and exited 0, while train.py refuses them before training (README: it checks a
    config). The reference is the run itself: the same error line, and exit 1, with and without the flag; nothing
    written either way."""
    from tests.conftest import run_entry

    monkeypatch.chdir(tmp_path)
    argv = ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'run'}", *overrides]
    started = run_entry("train.py", argv, capsys)
    printed = run_entry("train.py", [*argv, "--print-config"], capsys)
    assert started[0] == printed[0] == 1, (started, printed)
    assert printed[1] == "" and printed[2].startswith("error: ")
    assert printed[2].splitlines()[-1] == started[2].splitlines()[-1]
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """out_dir of the debug config stopped at update 2 of 8 (train.max_steps): a checkpoint.pt the same command
    continues."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "train.max_steps=2", "log.tensorboard=false"]))
    return out


@pytest.mark.parametrize("resume", ["out_dir", "train.resume"])
@pytest.mark.parametrize("overrides", [["optim.lr=1e-3"], ["optim.lr_base=2e-4", "train.allow_changed_config=true"]],
                         ids=["changed_setting", "min_lr_above_the_new_peak"])
def test_print_config_refuses_a_resume_the_run_refuses(stopped_run, tmp_path, monkeypatch, capsys, overrides, resume):
    """--print-config of a run that would continue a checkpoint (out_dir's checkpoint.pt, or train.resume) printed
    and exited 0 where the run refuses the checkpoint's settings (a changed optim.lr) or, its settings allowed to
    change, a schedule whose sched.min_lr lies above the new peak: it skipped the resume checks. The reference is the
    run itself: the same error line, and exit 1, with and without the flag; --print-config writes nothing."""
    from tests.conftest import run_entry

    monkeypatch.chdir(tmp_path)
    shutil.copytree(stopped_run, tmp_path / "run")
    where = ([f"out_dir={tmp_path / 'run'}"] if resume == "out_dir"
             else [f"out_dir={tmp_path / 'new'}", f"train.resume={tmp_path / 'run' / 'checkpoint.pt'}"])
    argv = ["--config", DEBUG_CONFIG, *where, *overrides]
    before = sorted(os.listdir(tmp_path / "run"))
    printed = run_entry("train.py", [*argv, "--print-config"], capsys)
    assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(tmp_path / "run")) == before
    started = run_entry("train.py", argv, capsys)
    assert started[0] == printed[0] == 1, (started, printed)
    assert printed[1] == "" and printed[2].startswith("error: ")
    assert printed[2].splitlines()[-1] == started[2].splitlines()[-1]
    # a resume the run accepts is printed: its settings unchanged, or the run made longer
    for accepted in ([], ["train.max_steps=4"]):
        code, out, _ = run_entry("train.py", ["--config", DEBUG_CONFIG, *where, *accepted, "--print-config"], capsys)
        assert code == 0 and config_from_dict(yaml.safe_load(out)).out_dir == where[0].partition("=")[2]


def folder_state(folder) -> list:
    """Every path under `folder` with its size and modification time: what --print-config must leave as it was."""
    return sorted((os.path.relpath(os.path.join(root, name), folder), os.stat(os.path.join(root, name)).st_size,
                   os.stat(os.path.join(root, name)).st_mtime_ns)
                  for root, dirs, files in os.walk(folder) for name in dirs + files)


def first_error(err: str):
    return next((line for line in err.splitlines() if line.startswith("error: ")), None)


def _no_checkpoint(run):
    os.remove(run / "checkpoint.pt")


def _killed_writing_its_first_checkpoint(run):
    from engine.run_dir import partial_path

    host = os.path.basename(partial_path(str(run / "checkpoint.pt"))).split("-")[1]  # this machine's
    os.rename(run / "checkpoint.pt", run / f"checkpoint.pt.partial-{host}-4194999-0a1b2c3d")  # a pid none holds


# out_dir states: (what is done to a copy of the stopped run, or None: no out_dir; a folder at checkpoint.pt: "dir"),
# the command's overrides
FOLDER_STATES = {
    "folder_at_checkpoint_pt": ("dir", []),
    "max_steps_below_the_checkpoint": (lambda run: None, ["train.max_steps=1"]),
    "earlier_files_without_checkpoint_pt": (_no_checkpoint, []),
    "earlier_files_archived": (_no_checkpoint, ["train.archive_existing=true", "train.max_steps=1"]),
    "killed_writing_its_first_checkpoint": (_killed_writing_its_first_checkpoint, ["train.max_steps=1"]),
    "changed_lr": (lambda run: None, ["optim.lr=1e-3"]),
    "compatible_resume": (lambda run: None, ["train.max_steps=3"]),
    "fresh_start": (None, ["train.max_steps=1"]),
}


@pytest.mark.parametrize("state", FOLDER_STATES)
def test_print_config_and_the_run_refuse_the_same_out_dir_states(stopped_run, tmp_path, monkeypatch, capsys, state):
    """--print-config exited 0 where the run refuses out_dir as it finds it: a folder at checkpoint.pt (the printout
    looked for a checkpoint file only), a train.max_steps below the checkpoint's update (checked once the run's length
    was built) and an earlier run's files without checkpoint.pt (checked only when the run claims the folder). The
    reference is the run itself, on the same folder after the printout: the same first error line, or both go on
    (an archived start, the restart of a run killed writing its first checkpoint, a resume, a fresh start); the
    printout changes nothing in the folder (a partial write it would remove, files it would archive)."""
    from tests.conftest import run_entry

    monkeypatch.chdir(tmp_path)
    prepare, overrides = FOLDER_STATES[state]
    run = tmp_path / "run"
    if prepare == "dir":
        os.makedirs(run / "checkpoint.pt")
    elif prepare is not None:
        shutil.copytree(stopped_run, run)
        prepare(run)
    argv = ["--config", DEBUG_CONFIG, f"out_dir={run}", "log.tensorboard=false", *overrides]
    before = folder_state(tmp_path)
    printed = run_entry("train.py", [*argv, "--print-config"], capsys)
    assert folder_state(tmp_path) == before
    started = run_entry("train.py", argv, capsys)
    assert (printed[0] == 0) == (started[0] == 0), (printed, started)
    assert first_error(printed[2]) == first_error(started[2]), (printed, started)
    refused = state in ("folder_at_checkpoint_pt", "max_steps_below_the_checkpoint",
                        "earlier_files_without_checkpoint_pt", "changed_lr")
    assert (first_error(started[2]) is not None) == refused, started


def test_evaluate_print_config_resolves_config_files_and_overrides(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out = run(evaluate, ["--config", DEBUG_CONFIG, "model.pretrained=/weights/x.pth", "--quant", "repq",
                               "--bits", "w6a6", "quant.calib_images=8", "--print-config"], capsys)
    assert code == 0 and os.listdir(tmp_path) == []
    printed = yaml.safe_load(out)
    assert printed["model"]["pretrained"] == "/weights/x.pth" and printed["quant"]["calib_images"] == 8
    assert printed["quant"]["pipelines"] == ["repq"] and printed["quant"]["bits"] == ["w6a6"]
    assert printed == config_to_dict(evaluate.resolve_config(evaluate.parse_args(
        ["--config", DEBUG_CONFIG, "model.pretrained=/weights/x.pth", "--quant", "repq", "--bits", "w6a6",
         "quant.calib_images=8"]))[0])


@pytest.mark.parametrize("argv, ours", [
    (["--resume", "runs/x/checkpoint.pt"], "train.resume=runs/x/checkpoint.pt"),
    (["--output_dir", "runs/x"], "out_dir=runs/x"),
    (["--output-dir=runs/x"], "out_dir=runs/x"),
    (["--epochs", "3"], "sched.epochs=3"),
    (["--model", "deit_tiny_patch16_224"], "model.name=deit_tiny_patch16_224"),
    (["--data-path", "/datasets/imagenet"], "data.root=/datasets/imagenet"),
    (["--data_path", "/d"], "data.root=/d"),
    (["--data-dir", "/d"], "data.root=/d"),
    (["--lr", "5e-4"], "optim.lr=5e-4 (the peak lr; DeiT's --lr, scaled by batch / 512, is optim.lr_base"),
    (["--batch-size", "64"], "train.batch_size_per_gpu=64 (per process"),
    (["--weight-decay", "0.05"], "optim.weight_decay=0.05"),
    (["--seed", "1"], "train.seed=1"),
    (["--warmup-epochs", "5"], "sched.warmup_epochs=5"),  # found in the schema under its own name
    (["--drop-path", "0.1"], "model.drop_path=0.1"),
    (["--optim.lr=1e-3"], "optim.lr=1e-3"),  # one of our keys written as a flag
    (["--model-ema"], "train.ema=true"),
    (["--eval"], "python evaluate.py --checkpoint PATH"),
    (["--steps", "100"], "sched.steps=100"),  # a training key before quant.gplq.steps of the same name
    (["--epochs", "optim.lr=1e-3"], "sched.epochs=VALUE;"),  # an override after the flag is not its value
])
def test_timm_and_deit_flags_name_our_equivalent(argv, ours):
    with pytest.raises(ConfigError, match=r"^--[\w.-]+ is not an option of train.py; use ") as refused:
        train.parse_args(["--config", DEBUG_CONFIG, *argv, "out_dir=runs/x"])
    assert f"; use {ours}" in str(refused.value)


KEY_NOTE = "; settings are key=value arguments, python {} --help-config lists them"


@pytest.mark.parametrize("entry, argv, message", [
    # the word after a flag is its value only if it is neither an option nor an override
    (train, ["--epochs", "--seed", "1"], "--epochs is not an option of train.py; use sched.epochs=VALUE" + KEY_NOTE),
    # a repeated flag: the first one is named, with the value given after it
    (train, ["--epochs", "3", "--epochs", "5"], "--epochs is not an option of train.py; use sched.epochs=3" + KEY_NOTE),
    # a command or a flag of ours is no setting: no word about key=value arguments
    (train, ["--eval"], "--eval is not an option of train.py; use python evaluate.py --checkpoint PATH"),
    # evaluate.py's flag given to train.py twice: the first value is named (it was read as an override and dropped
    # from the message: 'unrecognized arguments: --checkpoint --checkpoint B')
    (train, ["--checkpoint", "A", "--checkpoint", "B"], "--checkpoint is not an option of train.py; use "
     "train.resume=A to continue that run (model.pretrained=A to fine-tune from its weights)" + KEY_NOTE),
    (evaluate, ["--resume", "runs/x/best.pt"],
     "--resume is not an option of evaluate.py; use --checkpoint runs/x/best.pt"),
])
def test_a_foreign_flag_message_in_full(entry, argv, message):
    common = ["--config", DEBUG_CONFIG] if entry is train else ["--checkpoint", "runs/x/best.pt"]
    with pytest.raises(ConfigError) as refused:
        entry.parse_args([*common, *argv])
    assert str(refused.value) == message.format(entry.__name__ + ".py")


@pytest.mark.parametrize("entry, argv, word", [
    (train, [DEBUG_CONFIG, "out_dir=runs/x"], DEBUG_CONFIG),  # --config left out
    (train, ["--config", DEBUG_CONFIG, "configs/method/cd.yaml"], "configs/method/cd.yaml"),  # a second layer
    (evaluate, ["--checkpoint", "runs/x/best.pt", "configs/method/cd.yml"], "configs/method/cd.yml"),
])
def test_a_yaml_file_among_the_overrides_is_refused_naming_config(entry, argv, word):
    """It was refused as 'not of the form key=value', naming neither what it is nor the flag it needs."""
    with pytest.raises(ConfigError) as refused:
        entry.parse_args(argv)
    assert str(refused.value) == (f"override {word!r} is not of the form key=value; a config file is given with "
                                  f"--config: --config {word}")


@pytest.mark.parametrize("argv, ours", [
    (["-b", "64"], "train.batch_size_per_gpu=64 (per process"),
    (["-j", "4"], "data.num_workers=4"),
])
def test_single_dash_timm_flags_name_our_equivalent(argv, ours):
    with pytest.raises(ConfigError, match=r"^-\w is not an option of train.py; use ") as refused:
        train.parse_args(["--config", DEBUG_CONFIG, *argv, "out_dir=runs/x"])
    assert f"; use {ours}" in str(refused.value)


@pytest.mark.parametrize("argv, ours", [
    (["--resume", "runs/x/best.pt"], "use --checkpoint runs/x/best.pt"),
    (["--output_dir", "results"], "use --out results"),
    (["--batch-size", "256"], "use train.eval_batch_size_per_gpu=256"),
    (["--data-path", "/d"], "use data.root=/d"),
    (["--eval"], "drop it"),
])
def test_evaluate_names_its_own_equivalents(argv, ours):
    with pytest.raises(ConfigError, match=r"is not an option of evaluate.py; " + ours.replace(".", r"\.")):
        evaluate.parse_args(["--checkpoint", "runs/x/best.pt", *argv])


def test_other_unknown_flags_stay_argparse_errors(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # argparse names the program after it
    with pytest.raises(SystemExit) as done:
        train.parse_args(["--frobnicate"])
    assert done.value.code == 2  # one error line, argparse's usage block left out
    assert capsys.readouterr().err == "error: train.py: unrecognized arguments: --frobnicate; see train.py --help\n"


def test_train_without_config_runs_the_demo_from_any_working_folder(tmp_path, monkeypatch, capsys):
    """`python /path/to/train.py` outside the checkout runs the digits demo, not 'config file not found:
    configs/demo/vit_digits.yaml' (a file the user never named); its run folder is in the working folder."""
    monkeypatch.chdir(tmp_path)
    code, out = run(train, ["--print-config"], capsys)
    assert code == 0 and os.listdir(tmp_path) == []
    assert config_from_dict(yaml.safe_load(out)) == load_config([DEMO_CONFIG], ["out_dir=runs/vit_digits"])



def test_the_default_out_dir_joins_every_config_name_and_an_evaluation_lands_beside_its_checkpoint():
    """README: out_dir defaults to runs/<config names joined by +> (runs/vit_b+cd), so a CD run and its baseline
    never share a folder; evaluate.py writes eval_<checkpoint name>.json next to the checkpoint (--out aside)."""
    cd = os.path.join(os.path.dirname(DEBUG_CONFIG), "..", "method", "cd.yaml")
    assert train.parse_args(["--config", DEBUG_CONFIG, "--config", cd]).out_dir == os.path.join("runs", "tiny+cd")
    assert train.parse_args(["--config", DEBUG_CONFIG]).out_dir == os.path.join("runs", "tiny")
    assert train.parse_args(["--config", DEBUG_CONFIG, "out_dir=/x/y"]).out_dir == "/x/y"
    assert evaluate.default_out_path("runs/a/best.pt", "vit_nano") == os.path.abspath("runs/a/eval_best.json")
    assert evaluate.default_out_path("runs/a/snapshots/epoch0003.pt", "vit_nano") == \
        os.path.abspath("runs/a/snapshots/eval_epoch0003.json")


def test_a_repeated_quant_or_bits_flag_adds_to_the_list():
    """`--bits w4a4 --bits w8a8` ran w8a8 alone (argparse keeps the last list): every pipeline and bit-width named
    runs; a flag with no word of its own still means none (or each pipeline's default bits)."""
    args = evaluate.parse_args(["--checkpoint", "x.pt", "--quant", "repq", "data.root=/d", "--bits", "w4a4",
                                "--quant", "percentile", "--bits", "w8a8"])
    assert (args.quant, args.bits, args.overrides) == (["repq", "percentile"], ["w4a4", "w8a8"], ["data.root=/d"])
    args = evaluate.parse_args(["--checkpoint", "x.pt", "--quant", "--bits"])
    assert (args.quant, args.bits) == ([], [])
    args = evaluate.parse_args(["--checkpoint", "x.pt"])
    assert (args.quant, args.bits) == (None, None)


def test_a_repeated_flag_of_the_detection_evaluation_adds_to_its_list():
    """evaluate_detection.py kept the last of a repeated --quant, --bits or --quant-options without a word
    (`--quant repq --quant aphq` ran APHQ alone): every pipeline, bit-width and option named counts, as in
    evaluate.py; a bare --quant still means none. Its argument parsing needs no MMDetection."""
    import evaluate_detection
    common = ["--config", "c.py", "--checkpoint", "k.pth"]
    args = evaluate_detection.parse_args(common + ["--quant", "repq", "--bits", "w4a4", "model.x=1", "--quant",
                                                   "aphq", "--bits", "w6a6", "--quant-options", "aphq.iters=5",
                                                   "--quant-options", "aphq.recon_images=3"])
    assert (args.quant, args.bits, args.quant_options, args.overrides) == (
        ["repq", "aphq"], ["w4a4", "w6a6"], ["aphq.iters=5", "aphq.recon_images=3"], ["model.x=1"])
    args = evaluate_detection.parse_args(common + ["--quant"])
    assert (args.quant, args.bits, args.quant_options) == ([], None, [])
    assert evaluate_detection.parse_args(common).quant is None  # every detection pipeline


@pytest.mark.parametrize("bits", [["--bits"], ["--bits", "val_dataloader.batch_size=1"], ["--bits", "--quant", "repq"]])
def test_the_detection_evaluation_refuses_a_bits_naming_no_bit_width(bits, capsys):
    """`--bits $EMPTY k=v` (an unset shell variable) left --bits with no bit-width, which evaluate_detection.py took
    for --bits not given and ran the default w4a4 without a word (evaluate.py refuses it): one `error:` line, exit 2,
    before any MMDetection import, naming the fix and the default (w4a4, the paper's and --help's)."""
    import evaluate_detection
    loaded = "mmdet" in sys.modules
    with pytest.raises(SystemExit) as refused:
        evaluate_detection.parse_args(["--config", "c.py", "--checkpoint", "k.pth", *bits])
    assert ("mmdet" in sys.modules) == loaded  # refused by the parser, before main imports MMDetection
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "--bits names no bit-width: name them" in err and "drop --bits for the default (w4a4)" in err


def test_train_without_config_says_that_the_default_is_the_digits_demo():
    with pytest.raises(ConfigError, match=r"data.root=/datasets/x would be ignored.*the default config is "
                                          r"configs/demo/vit_digits.yaml \(digits\); pass --config configs/"):
        train.parse_args(["data.root=/datasets/x", "model.name=deit_tiny_patch16_224"])
    with pytest.raises(ConfigError, match=r"would be ignored: data.root is read only when") as refused:
        train.parse_args(["--config", DEMO_CONFIG, "data.root=/x"])
    assert "default config" not in str(refused.value)  # a --config was given: no word about the default


def test_evaluate_refuses_a_data_override_its_checkpoint_would_ignore(tmp_path, capsys):
    import torch

    ckpt = tmp_path / "best.pt"
    torch.save({"model": {}, "config": config_to_dict(load_config([DEMO_CONFIG]))}, ckpt)  # a digits run
    with pytest.raises(ConfigError, match=r"data.root=/datasets/imagenet would be ignored: .* data.dataset is "
                                          r"folder or tokens, and it is digits"):
        evaluate.parse_args(["--checkpoint", str(ckpt), "data.root=/datasets/imagenet", "--print-config"])
    code, out = run(evaluate, ["--checkpoint", str(ckpt), "quant.calib_images=8", "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["data"]["dataset"] == "digits"
    assert sorted(os.listdir(tmp_path)) == ["best.pt"]  # nothing written next to the checkpoint


def test_at_least_refuses_counts_below_the_bound_and_nan(capsys):
    import argparse

    from configs.cli import OneLineParser, at_least
    assert at_least(1)("3") == 3 and at_least(0)("0") == 0 and at_least(1, float)("2.5") == 2.5
    for parse, text in ((at_least(1), "0"), (at_least(0), "-1"), (at_least(1, float), "nan")):
        with pytest.raises(argparse.ArgumentTypeError, match="must be at least"):
            parse(text)
    parser = OneLineParser(prog="bench.py")
    parser.add_argument("--repeats", type=at_least(1))
    for text, says in (("x", "invalid int value: 'x'"), ("0", "0: must be at least 1")):
        with pytest.raises(SystemExit):  # one error line naming the flag
            parser.parse_args(["--repeats", text])
        assert capsys.readouterr().err == f"error: bench.py: argument --repeats: {says}; see bench.py --help\n"


def test_a_device_the_machine_lacks_is_named(monkeypatch):
    """cuda:N exists for N < the visible count (cuda is cuda:0); other kinds than cpu and cuda hold no data."""
    import torch

    from configs.cli import device_problem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [device_problem(d) for d in ("cpu", "cuda", "cuda:0", "cuda:1")] == [None] * 4
    assert device_problem("cuda:2") == "2 CUDA device(s) are visible (cuda:0 .. cuda:1)"
    assert device_problem("meta") == "give cpu, cuda or cuda:N"
    assert device_problem("gpu").startswith("not a torch device")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert device_problem("cuda") == "no CUDA device is visible; give cpu"


def test_named_twice_names_each_repeated_item_once_and_passes_distinct_ones():
    from configs.cli import named_twice

    assert named_twice("--bits", ["w4a4", "w3a3", "w4a4", "w3a3", "w4a4"]) == \
        "--bits names w3a3, w4a4 twice: give each once"
    assert named_twice("--pipelines", ["repq", "aphq"]) is None and named_twice("--bits", []) is None


def test_refuse_repeats_names_the_first_flag_that_repeats_a_value_in_one_error_line(capsys):
    """The benchmark scripts' check of their list flags: each repeated value named once, sorted; a flag not
    given (None) or without repeats passes; the first flag that repeats is the one refused."""
    from configs.cli import OneLineParser, refuse_repeats

    parser = OneLineParser(prog="bench.py")
    refuse_repeats(parser, ("--widths", [64, 128]), ("--batches", None), ("--models", []))
    with pytest.raises(SystemExit) as refused:
        refuse_repeats(parser, ("--methods", ["cd"]), ("--widths", [128, 64, 128, 64, 64]), ("--batches", [4, 4]))
    assert refused.value.code == 2
    assert capsys.readouterr().err == ("error: bench.py: argument --widths: 64, 128 given twice; give each value "
                                       "once; see bench.py --help\n")


def test_a_device_flag_refuses_a_device_the_machine_lacks_in_one_line(monkeypatch, capsys):
    """torch_device, the --device type of the benchmark scripts: a torch.device for cpu, one `error:` line naming
    the flag for a device the machine lacks (cuda without a GPU) or no device at all (gpu)."""
    import torch

    from configs.cli import OneLineParser, torch_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = OneLineParser(prog="bench.py")
    parser.add_argument("--device", type=torch_device)
    assert parser.parse_args(["--device", "cpu"]).device == torch.device("cpu")
    for text, says in (("cuda", "cuda: no CUDA device is visible; give cpu"),
                       ("gpu", "gpu: not a torch device; give cpu, cuda or cuda:N")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--device", text])
        assert capsys.readouterr().err == f"error: bench.py: argument --device: {says}; see bench.py --help\n"


def test_a_flag_named_like_several_keys_is_left_to_argparse_not_matched_to_one(capsys, monkeypatch):
    """`--name x` is the last part of model.name, optim.name and sched.name: naming one of them would be a guess,
    so it is argparse's unrecognized argument, not 'use model.name=x'."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert [k for k in LEAVES if k.rpartition(".")[2] == "name"] == ["model.name", "optim.name", "sched.name"]
    with pytest.raises(SystemExit) as done:
        train.parse_args(["--config", DEBUG_CONFIG, "--name", "x"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "error: train.py: unrecognized arguments: --name; see train.py --help\n"


@dataclasses.dataclass
class _ContinuedThenAbove:
    """A trailing comment continued on an indented line, followed by fields documented from above."""

    size: int = 3  # images per batch, counted
    #   over every process
    # the seed of the shuffle
    seed: int = 0
    steps: int = 1  # optimizer steps
    #   per epoch
    rate: float = 0.1


def test_the_continuation_of_a_field_comment_is_not_the_help_of_the_field_below():
    """The `#   ` line continues `size`'s comment: it is size's help, not part of the comment above `seed`, and
    `rate` (nothing above it but that continuation) has no help text."""
    assert {f.name: field_help(_ContinuedThenAbove, f.name) for f in dataclasses.fields(_ContinuedThenAbove)} == {
        "size": "images per batch, counted over every process", "seed": "the seed of the shuffle",
        "steps": "optimizer steps per epoch", "rate": ""}
