"""What each rank reads from its own node must agree, or every rank stops before train.py trains or evaluate.py
scores: the settings (paths aside), the data under data.root (a copy incomplete or of another export: the split is
named), the checkpoint a run resumes from (an out_dir on each node's own disk), the model.pretrained weights a run
starts from and the weights evaluate.py loads;
copies of the same files at other paths go on. Each rank's paths are its own here, as each node's would be."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from dist_utils import as_torchrun_rank, free_port, spawn_within
from tests.conftest import DEBUG_CONFIG
from tests.test_data import make_image_folder

# optim.lr given: lr_base would scale to 3.9e-6 at batch 4, below sched.min_lr (refused as a rising schedule)
FOLDER = ["data.dataset=folder", "model.num_classes=2", "train.batch_size=4", "train.batch_size_per_gpu=2",
          "train.eval_batch_size_per_gpu=2", "log.tensorboard=false", "optim.lr=1e-4"]


def _cases_worker(rank: int, world: int, ports: list, cases: list, work: str) -> None:
    """Each case (name, entry point, argv of rank 0, argv of rank 1) in a group of its own on its own port; the
    rank's outcome ("ok", "") or (error type, message) saved as <name>_rank<r>.pt. Entry point "settings": the
    "argv" is the settings each rank hands engine.rank_agreement.check_same_settings_on_every_rank."""
    import evaluate
    import train
    from configs import load_config
    from engine.distributed import process_group
    from engine.rank_agreement import check_same_settings_on_every_rank

    for port, (name, entry, argvs) in zip(ports, cases):
        as_torchrun_rank(rank, world, port)
        try:
            if entry == "train":
                train.main(load_config([DEBUG_CONFIG], argvs[rank]))
            elif entry == "train_command":  # as train.py's command line: its --config files read first
                train.main(train.parse_args(argvs[rank]))
            elif entry == "train_command_in_group":  # the same in a process group made before (a harness's)
                import torch.distributed as dist
                dist.init_process_group("gloo")
                try:
                    train.main(train.parse_args(argvs[rank]))
                finally:
                    if dist.is_initialized():
                        dist.destroy_process_group()
            elif entry == "settings":
                with process_group("cpu") as group:
                    check_same_settings_on_every_rank(argvs[rank], group.device)
            else:
                evaluate.main(evaluate.parse_args(argvs[rank]))
            outcome = ("ok", "")
        except (evaluate.OtherRankError, *evaluate.USER_ERRORS) as e:
            outcome = (type(e).__name__, str(e))
        torch.save(outcome, os.path.join(work, f"{name}_rank{rank}.pt"))
    os._exit(0)  # a failed case's other rank may have left already: no group teardown together


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """{case: [rank 0's outcome, rank 1's]} with rank 0 on folder a and rank 1 on: b, a copy of a whose val split
    has one image renamed (as many images, other names); c, a plain copy of a at another path. Resume: rank 0's
    out_dir holds a run's checkpoint.pt, rank 1's nothing. Weights: rank 1's copy of best.pt with one weight
    changed, or the same bytes at another path."""
    import train
    from configs import config_to_dict, load_config

    work = tmp_path_factory.mktemp("ranks")
    make_image_folder(work / "a", per_class=4)
    shutil.copytree(work / "a", work / "b")
    os.rename(work / "b" / "val" / "dog" / "3.png", work / "b" / "val" / "dog" / "9.png")
    shutil.copytree(work / "a", work / "c")
    (work / "a_file").write_text("a file where rank 1 would make --out's folder")
    torch.set_num_threads(1)
    train.main(load_config([DEBUG_CONFIG], [*FOLDER, f"data.root={work / 'a'}", f"out_dir={work / 'trained'}",
                                            "train.max_steps=1"]))
    best = str(work / "trained" / "best.pt")
    payload = torch.load(best, weights_only=True)
    os.makedirs(work / "node2")
    shutil.copyfile(best, work / "node2" / "best.pt")
    name = next(k for k, v in payload["model"].items() if v.is_floating_point())
    payload["model"][name] = payload["model"][name] + 0.001  # a copy of another update
    torch.save(payload, work / "node2" / "other.pt")
    payload["config"]["optim"]["lr"] = 0.123  # the best.pt of another run (another lr), at the same place
    torch.save(payload, work / "node2" / "other_run.pt")
    run = lambda name, other: [[*FOLDER, f"data.root={work / root}", f"out_dir={work / name}", "train.max_steps=1"]
                               for root in ("a", other)]
    score = lambda name, other, copy=best: [
        ["--checkpoint", weights, "--quant", "quant.act_max_csv=false", f"data.root={work / root}", "--out",
         str(work / f"{name}.json")] for root, weights in (("a", best), (other, copy))]
    resume = [[*FOLDER, f"data.root={work / 'a'}", f"out_dir={work / out}", "train.max_steps=2"]
              for out in ("trained", "empty")]
    # a fresh start from model.pretrained: rank 1's node copy of best.pt (the same bytes, another update's, none)
    tune = lambda name, copy: [[*argv, *pretrained] for argv, pretrained in zip(
        run(name, "a"), ([f"model.pretrained={best}"], [f"model.pretrained={copy}"] if copy else []))]
    cases = [("train_other", "train", run("train_other", "b")), ("train_copy", "train", run("train_copy", "c")),
             ("tune_copy", "train", tune("tune_copy", work / "node2" / "best.pt")),
             # tune_copy resumed, rank 0 given rank 1's node path to the weights: not the one the checkpoint records
             ("tune_swapped", "train", [[*(o if o != "train.max_steps=1" else "train.max_steps=2" for o in argv[:-1]),
                                         f"model.pretrained={weights}"] for argv, weights in zip(
                 tune("tune_copy", best), (work / "node2" / "best.pt", best))]),
             # ... and as it started: each rank given its own node's path, rank 0 the one the checkpoint records
             ("tune_resumed", "train", [[*(o if o != "train.max_steps=1" else "train.max_steps=2" for o in argv)]
                                        for argv in tune("tune_copy", work / "node2" / "best.pt")]),
             ("tune_other", "train", tune("tune_other", work / "node2" / "other.pt")),
             ("tune_unset", "train", tune("tune_unset", None)),
             ("train_start", "train", resume),
             ("train_settings", "train", [[*[o for o in argv if o != "train.max_steps=1"], f"train.max_steps={n}"]
                                                   for argv, n in zip(run("s", "a"), (1, 2))]),
             ("eval_settings", "evaluate", [[*argv, *amp] for argv, amp in zip(score("e", "a"),
                                                                               ([], ["--amp", "bf16"]))]),
             ("eval_other_run", "evaluate", score("eval_other_run", "a", str(work / "node2" / "other_run.pt"))),
             ("eval_other", "evaluate", score("eval_other", "b")),
             ("eval_weights", "evaluate", score("eval_weights", "a", str(work / "node2" / "other.pt"))),
             ("eval_copy", "evaluate", score("eval_copy", "c", str(work / "node2" / "best.pt"))),
             # rank 1 given its node's own loader workers, batch wait, page-locking and progress bar
             ("node_settings", "settings", [config_to_dict(load_config([DEBUG_CONFIG], own)) for own in (
                 [], ["data.num_workers=6", "data.timeout=60", "data.pin_memory=false", "log.progress=true"])]),
             # rank 1's node lacks a file: its error there, the others told so, where they had waited in a collective
             ("train_no_data", "train", run("train_no_data", "missing")),
             ("eval_no_data", "evaluate", score("eval_no_data", "missing")),
             # rank 1's --out lies under a file (a node where that path is not a folder): its folder cannot be made
             ("eval_no_out", "evaluate", [argv[:-1] + [out] for argv, out in zip(
                 score("eval_no_out", "a"), (str(work / "eval_no_out.json"), str(work / "a_file" / "e.json")))]),
             # rank 1's node lacks a file read before the ranks meet (a --config file, the --checkpoint), or its
             # settings fail a check made then: its error there, the others told so at their first collective
             ("train_no_config", "train_command", [["--config", config, *argv] for config, argv in zip(
                 (DEBUG_CONFIG, str(work / "missing.yaml")), run("train_no_config", "a"))]),
             ("train_bad_plan", "train", [[*argv, *bits] for argv, bits in zip(
                 run("train_bad_plan", "a"), ([], ["quant.bits=[w4a4,w4a4]"]))]),
             ("eval_no_checkpoint", "evaluate", score("eval_no_checkpoint", "a", str(work / "node2" / "none.pt"))),
             ("train_no_config_in_group", "train_command_in_group", [
                 ["--config", config, *argv] for config, argv in zip(
                     (DEBUG_CONFIG, str(work / "missing.yaml")), run("train_no_config_in_group", "a"))]),
             # a --config file that no node has: each rank its own error
             ("train_no_config_anywhere", "train_command", [["--config", str(work / "missing.yaml"),
                                                            *run("nowhere2", "a")[0]]] * 2),
             # no node has it: each rank its own error, none told of another's
             ("train_no_data_anywhere", "train", [[*FOLDER, f"data.root={work / 'missing'}",
                                                   f"out_dir={work / 'nowhere'}", "train.max_steps=1"]] * 2),
             ("resume_missing", "train", [[*argv, f"train.resume={path}"] for argv, path in zip(
                 run("resume_missing", "a"), (work / "trained" / "checkpoint.pt", work / "missing.pt"))]),
             # a mapping with keys of mixed types (json.dumps cannot sort them): the same in another order, and
             # the number 1 on one rank where the other has the text "1"
             ("mixed_keys", "settings", [{"model": {"kwargs": kwargs}} for kwargs in ({1: 2, "a": 3}, {"a": 3, 1: 2})]),
             ("mixed_keys_other", "settings", [{"model": {"kwargs": kwargs}} for kwargs in ({1: 2, "a": 3},
                                                                                           {"1": 2, "a": 3})]),
             # rank 1 on a checkout whose schema has one section more
             ("other_code", "settings", [{"model": {"name": "a"}}, {"model": {"name": "a"}, "new": {"key": 1}}])]
    # a deadline: a rank left waiting for the other (a check that one rank skips) fails here, not after gloo's 30 min
    spawn_within(_cases_worker, (2, [free_port() for _ in cases], cases, str(work)), 2, seconds=300)
    return {name: [torch.load(work / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]
            for name, _, _ in cases} | {"work": work}


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
@pytest.mark.parametrize("case", ["train_other", "eval_other"])
def test_a_rank_on_other_images_under_its_data_root_ends_every_rank_naming_the_split(outcomes, case):
    work = outcomes["work"]
    for rank, (kind, message) in enumerate(outcomes[case]):
        assert kind == "DataError", message
        assert message.startswith(f"the processes read other data under data.root={work / ('a', 'b')[rank]}: val "
                                  f"differs between ranks"), message
        assert f"rank {rank} finds val: images 8, names_sha256 " in message and "train:" not in message
    # nothing was trained or scored: no checkpoint, no result file
    assert not os.path.exists(work / "train_other" / "checkpoint.pt") and not os.path.exists(work / "eval_other.json")


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
@pytest.mark.parametrize("case", ["train_copy", "eval_copy", "tune_copy", "node_settings"])
def test_copies_of_the_same_images_at_other_paths_go_on(outcomes, case):
    """... and so do ranks given their node's own loader workers, batch wait, page-locking and progress bar (no
    result depends on them): a launch script may size them per node."""
    assert outcomes[case] == [("ok", ""), ("ok", "")]


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_ranks_that_would_resume_from_other_points_stop_naming_what_each_found(outcomes):
    """An out_dir on each node's own disk: rank 0 finds the run's checkpoint.pt, rank 1 nothing. Each had gone on
    from its own point (rank 1 afresh: other optimizer state, schedule and sample order) under one set of weights."""
    work = outcomes["work"]
    (kind0, first), (kind1, second) = outcomes["train_start"]
    assert kind0 == kind1 == "CheckpointError", (first, second)
    assert first.startswith(f"the processes would start from other points: rank 0 resumes from "
                            f"{work / 'trained' / 'checkpoint.pt'} at update 1 (weights "), first
    assert second.startswith(f"the processes would start from other points: rank 1 finds no checkpoint.pt in "
                             f"out_dir={work / 'empty'} and would start afresh, another rank otherwise; out_dir must "
                             f"be one folder that every node reads"), second
    assert torch.load(work / "trained" / "checkpoint.pt", weights_only=True)["state"]["step"] == 1  # not trained on


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_a_resume_refused_on_one_rank_alone_stops_every_rank(outcomes):
    """check_resume judges model.pretrained, a node's own path, against the one the checkpoint records (a resumed run
    reads no weights from it): refused on rank 0 alone here, while rank 1 went on into its next collective and ended
    in gloo's "Connection closed by peer" traceback. Now rank 1 says that another rank failed, and nothing trains."""
    (kind0, first), (kind1, second) = outcomes["tune_swapped"]
    assert kind0 == "CheckpointError" and "only a run's start reads model.pretrained" in first, first
    assert (kind1, second) == ("OtherRankError", "rank 1: another rank failed checking the settings the checkpoint is "
                                                 "resumed with; its output says why")
    # nothing trained: tune_resumed, after it, resumes from update 1 (test_a_run_started_from_each_nodes_copy_...)


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_a_run_started_from_each_nodes_copy_of_the_weights_resumes(outcomes):
    """tune_copy started with model.pretrained at another path on rank 1's node (the same bytes: allowed, a path
    setting); its checkpoint records rank 0's path, and rank 1 refused the resume as a new model.pretrained (only a
    run's start reads it), so such a run could not go on. Rank 0 judges the path it recorded; the run trains on."""
    work = outcomes["work"]
    assert outcomes["tune_resumed"] == [("ok", ""), ("ok", "")]
    assert torch.load(work / "tune_copy" / "checkpoint.pt", weights_only=True)["state"]["step"] == 2
    log = (work / "tune_copy" / "train.log").read_text()
    assert log.count(" resumed from ") == 1 and f"resumed from {work / 'tune_copy' / 'checkpoint.pt'} at epoch 0, " \
                                                  f"update 1" in log  # after tune_swapped, which trained nothing


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_ranks_that_loaded_other_weights_stop_before_scoring(outcomes):
    work = outcomes["work"]
    for rank, (kind, message) in enumerate(outcomes["eval_weights"]):
        weights = (work / "trained" / "best.pt", work / "node2" / "other.pt")[rank]
        assert kind == "CheckpointError", message
        assert message.startswith(f"the processes loaded other weights from {weights}: rank {rank} holds "), message
    assert not os.path.exists(work / "eval_weights.json")


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_a_fresh_start_from_other_pretrained_weights_stops_every_rank(outcomes):
    """Each rank loads model.pretrained from its own node: DDP would copy rank 0's weights into the others' models,
    but not into the EMA each made before, and a rank given no model.pretrained (a path, not compared with the
    settings) would start from random weights beside it."""
    work = outcomes["work"]
    for rank, (kind, message) in enumerate(outcomes["tune_other"]):
        weights = (work / "trained" / "best.pt", work / "node2" / "other.pt")[rank]
        assert kind == "CheckpointError", message
        assert message.startswith(f"the processes loaded other weights from model.pretrained={weights}: rank {rank} "
                                  f"holds weights "), message
    (kind0, first), (kind1, second) = outcomes["tune_unset"]
    assert kind0 == kind1 == "CheckpointError", (first, second)
    assert first.startswith(f"the processes loaded other weights from model.pretrained={work / 'trained' / 'best.pt'}"
                            f": rank 0 holds weights "), first
    assert second == ("the processes start from other weights: rank 1 loads none (model.pretrained unset: random "
                      "ones), another rank loads a file; give every node the same model.pretrained"), second
    assert not os.path.exists(work / "tune_other" / "checkpoint.pt")
    assert not os.path.exists(work / "tune_unset" / "checkpoint.pt")


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
@pytest.mark.parametrize("case, section", [("train_settings", "train"), ("eval_settings", "evaluate.py flags")])
def test_ranks_given_other_settings_stop_naming_the_section(outcomes, case, section):
    """A node with another checkout of the configs or another command line (here train.max_steps, evaluate.py's
    --amp): it would stop at another update, or score under another autocast. Paths may differ (the *_copy cases).
    Every rank's error is the same text, which the entry points print once: it named each rank ("rank 1 among
    them"), which nothing tells apart (every rank meets it), and so printed one line per rank."""
    checkpoint = (", and the same --checkpoint file (its config is the base of the settings)"
                  if case == "eval_settings" else "")
    assert outcomes[case] == [("ConfigError", f"the processes resolved other settings in {section}: give every node "
                                              f"the same checkout of the configs and the same command line"
                                              f"{checkpoint}")] * 2


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_ranks_of_other_versions_of_the_code_stop_naming_the_cause(outcomes):
    """Another schema (a section more) gives the compared settings another number of items: a tensor of another
    size in the all-reduce aborted gloo's processes (SIGABRT, no error line) and would leave NCCL's hanging."""
    for rank, (kind, message) in enumerate(outcomes["other_code"]):
        items = ("model", "model, new")[rank]
        assert (kind, message) == ("ConfigError", f"the processes compare other items (rank {rank}: {items}): the "
                                                  "nodes run other versions of the code; give every node the same "
                                                  "checkout")


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_ranks_given_checkpoints_of_other_runs_stop_naming_the_checkpoint(outcomes):
    """evaluate.py's settings are the checkpoint's config and the command line's: a node's copy of another run's
    best.pt resolves other settings, and the advice names the checkpoint beside the configs and command line."""
    assert outcomes["eval_other_run"] == [("ConfigError", "the processes resolved other settings in optim: give every "
                                                          "node the same checkout of the configs and the same command "
                                                          "line, and the same --checkpoint file (its config is the "
                                                          "base of the settings)")] * 2


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
@pytest.mark.parametrize("case, what, error", [
    ("eval_no_out", "making the --out folder", ("RunDirError", "a_file"))])
def test_a_file_one_node_lacks_stops_that_rank_with_its_error_and_the_others_saying_so(outcomes, case, what, error):
    """Rank 1's node cannot make --out's folder: it raised alone, and rank 0 went on into the next collective (gloo:
    a traceback when rank 1's process ended; NCCL: a wait until the watchdog)."""
    (kind0, first), (kind1, second) = outcomes[case]
    assert (kind0, first) == ("OtherRankError", f"rank 0: another rank failed {what}; its output says why")
    assert kind1 == error[0] and error[1] in second, second


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
@pytest.mark.parametrize("case, error", [
    ("train_no_config", ("ConfigError", "missing.yaml")),
    ("train_no_config_in_group", ("ConfigError", "missing.yaml")),
    ("train_no_data", ("DataError", "does not exist or is not a folder")),
    ("eval_no_data", ("DataError", "does not exist or is not a folder")),
    ("train_bad_plan", ("ConfigError", "w4a4")),
    ("eval_no_checkpoint", ("CheckpointError", "none.pt")),
    ("resume_missing", ("CheckpointError", "missing.pt: no such file"))])
def test_a_rank_that_fails_before_the_ranks_meet_stops_the_others_at_their_first_collective(outcomes, case, error):
    """Rank 1's node lacks a --config file, the --checkpoint, a train.resume file into a new out_dir or the
    data.root (read before out_dir or --out's folder is made), or its settings fail a check made before the process
    group forms: it raised there, and rank 0 waited at the rendezvous (and under NCCL in its first collective) until
    the group's timeout. Rank 1 now joins the group to fail, and rank 0 raises at its first collective."""
    (kind0, first), (kind1, second) = outcomes[case]
    assert (kind0, first) == ("OtherRankError", "rank 0: another rank failed before the ranks met (reading its "
                                                 "node's --config files, --checkpoint or data, or checking its "
                                                 "settings); its output says why")
    assert kind1 == error[0] and error[1] in second, second


def test_a_rank_that_fails_before_the_ranks_meet_waits_a_bounded_time_for_a_peer_that_never_comes(monkeypatch, capfd):
    """A rank whose peer never joins (it failed before joining, or runs older code) raised its own error only at
    the group's timeout (30 minutes with gloo), ignoring a SIGTERM meanwhile (train.py's start-up recorder keeps
    it as a stop request). It now gives up after START_FAILURE_WAIT with its own error, and a SIGTERM ends it while
    it waits (tests/test_error_lines_once.py); the error is said once the wait has lasted START_FAILURE_QUIET, and
    a SIGTERM received already skips the wait."""
    import signal
    import time

    import engine.distributed
    import engine.startup_signals
    from engine.distributed import fail_on_every_rank_at_start
    from engine.startup_signals import is_recorder, record_sigterm

    monkeypatch.setattr(engine.distributed, "START_FAILURE_WAIT", __import__("datetime").timedelta(seconds=2))
    monkeypatch.setattr(engine.distributed, "START_FAILURE_QUIET", __import__("datetime").timedelta(seconds=0.5))
    seen = []
    real_init = engine.distributed.init_distributed

    def init(device, main_rank_wait, timeout):  # a mutant without the bound would wait 30 minutes: fail now
        assert timeout == engine.distributed.START_FAILURE_WAIT, timeout
        seen.append(signal.getsignal(signal.SIGTERM))
        return real_init(device, main_rank_wait, timeout)
    monkeypatch.setattr(engine.distributed, "init_distributed", init)
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():  # rank 0, holding the store, never comes
        monkeypatch.setenv(name, value)
    before = signal.getsignal(signal.SIGTERM)
    record_sigterm()
    try:
        started = time.monotonic()
        with pytest.raises(FileNotFoundError, match="^its own$"):
            fail_on_every_rank_at_start(FileNotFoundError("its own"), "cpu")
        waited = time.monotonic() - started
        # while it waited, SIGTERM was not the recorder's (which keeps it as a stop request for a run that never
        # starts) but a handler that ends the process
        assert len(seen) == 1 and callable(seen[0]) and not is_recorder(seen[0]), seen
        assert is_recorder(signal.getsignal(signal.SIGTERM))  # the recorder back for the process's way out
        # a SIGTERM already received (the job is being stopped): no wait at all
        monkeypatch.setattr(engine.startup_signals, "RECEIVED", [signal.SIGTERM])
        with pytest.raises(FileNotFoundError, match="^its own$"):
            fail_on_every_rank_at_start(FileNotFoundError("its own"), "cpu")
        assert len(seen) == 1, seen
    finally:
        signal.signal(signal.SIGTERM, before)
    assert 1.5 < waited < 60, waited
    # said on stderr once the wait lasted: a SIGTERM later would end the process without reaching its error line
    assert capfd.readouterr().err.startswith("rank 1 failed before the ranks met; telling the others (waiting at "
                                             "most 2 s for them to join): its own\n")


def test_one_process_raises_its_error_at_once_telling_no_one(capfd):
    """With no other rank (a launcher's one process) there is nobody to join or tell: the error at once, and no line
    that says the others are being told."""
    from engine.distributed import tell_the_others_at_start

    joined = []
    with pytest.raises(FileNotFoundError, match="^its own$"):
        tell_the_others_at_start(FileNotFoundError("its own"), lambda: joined.append(1), "0", 1)
    assert joined == [] and capfd.readouterr().err == ""


def test_the_device_of_the_command_line_is_read_without_the_config_files():
    """A rank that cannot read its --config files joins the others' group on the backend of train.device as the
    overrides set it; "auto" (the default) where they do not set it or set it to nothing readable."""
    from configs.loader import device_of_overrides

    assert device_of_overrides(["optim.lr=0.1", "train.device=cpu"]) == "cpu"
    assert device_of_overrides(["train={seed: 1, device: cuda}", "model.bogus=1"]) == "cuda"
    assert device_of_overrides(["train.device=cuda", "train.device=cpu"]) == "auto"  # given twice: load_config refuses
    assert device_of_overrides(["optim.lr=0.1"]) == "auto"
    assert device_of_overrides(["train.device=gpu"]) == "auto"


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_a_config_file_no_node_has_stops_every_rank_with_its_own_error(outcomes):
    """Every rank failed before the ranks met: each raises its own error, none is told of another's."""
    for kind, message in outcomes["train_no_config_anywhere"]:
        assert kind == "ConfigError" and "missing.yaml" in message, message


def test_settings_with_keys_of_mixed_types_are_compared():
    """json.dumps cannot sort the keys of a mapping holding text and numbers (a YAML `model.kwargs: {1: 2, a: 3}`):
    the comparison's digest raised TypeError. The digest is of the mapping, whatever the order of its items, and
    tells the number 1 from the text "1"."""
    from engine.rank_agreement import digest

    mixed = {"model": {"kwargs": {1: 2, "a": 3}}}
    assert digest(mixed) == digest({"model": {"kwargs": {"a": 3, 1: 2}}})
    assert digest(mixed) != digest({"model": {"kwargs": {"1": 2, "a": 3}}})


def test_a_model_kwargs_with_a_number_as_key_is_refused_in_one_line(tmp_path, capsys):
    """The setting's own error (timm takes keyword arguments by name), not a TypeError from the ranks' comparison
    of the settings that comes first; refused where the override is read, before any folder is made."""
    from tests.conftest import run_entry

    code, _, err = run_entry("train.py", ["model.kwargs={1: 2, a: 3}", f"out_dir={tmp_path / 'run'}"], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: command line: 'model.kwargs' has an entry named 1 (int); give each entry a name"), err
    assert not os.path.exists(tmp_path / "run")


def test_one_process_compares_nothing_and_passes_the_error_of_its_start_work_as_it_is():
    """Without a process group there is no other rank: the checks make and read back nothing on the device (a
    meta device, from which nothing can be read back, stands for one in a failed state), and an error in
    `failure_on_every_rank`'s body reaches the caller unchanged instead of the error of the flag's read-back."""
    from engine.distributed import failure_on_every_rank
    from engine.rank_agreement import check_same_settings_on_every_rank, differing_between_ranks

    meta = torch.device("meta")
    assert differing_between_ranks({"a": 1, "b": [2]}, meta) == []
    check_same_settings_on_every_rank({"train": {"seed": 0}}, meta)
    with pytest.raises(ValueError, match="^the body's own$"):
        with failure_on_every_rank(meta, "reading"):
            raise ValueError("the body's own")
    with failure_on_every_rank(meta, "reading"):
        done = True
    assert done


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_ranks_whose_mappings_differ_in_the_type_of_a_key_stop(outcomes):
    """The number 1 and the text "1" as keys are other settings (a YAML `{1: x}` and `{'1': x}`); the same mapping
    in another order is the same. json.dumps could not sort such keys: a TypeError on every rank."""
    assert outcomes["mixed_keys"] == [("ok", ""), ("ok", "")]
    assert outcomes["mixed_keys_other"] == [("ConfigError", "the processes resolved other settings in model: give "
                                                            "every node the same checkout of the configs and the "
                                                            "same command line")] * 2


def test_operations_guide_quotes_what_each_rank_failed_as_the_entry_points_say_it():
    """docs/operations.md lists the `another rank failed <what>` texts: each `failure_on_every_rank` block of
    train.py and evaluate.py, in the words the error prints."""
    import re

    from tests.conftest import ROOT

    read = lambda path: open(os.path.join(ROOT, path), encoding="utf-8").read()
    guide = " ".join(read("docs/operations.md").split())
    blocks = [what for path in ("train.py", "evaluate.py")
              for what in re.findall(r'failure_on_every_rank\([^,]+, "([^"]+)"\)', read(path))]
    assert len(blocks) == 8, blocks
    assert [what for what in blocks if f"`{what}`" not in guide and f"failed {what};" not in guide] == []


@pytest.mark.slow  # the outcomes fixture starts ranks in processes (about 30 s in all)
def test_a_file_no_node_has_stops_every_rank_with_its_own_error(outcomes):
    """failure_on_every_rank raises a rank's own error where the body failed, whatever the others did."""
    for kind, message in outcomes["train_no_data_anywhere"]:
        assert kind == "DataError" and "does not exist or is not a folder" in message, message


def test_the_way_out_of_other_start_points_is_one_that_works_with_the_resume_setting(monkeypatch):
    """Where train.resume is given, a node whose own out_dir/checkpoint.pt continued from it resumes from that file
    (resume_source), so 'train.resume=PATH the same checkpoint on every node' cannot end the disagreement: the
    advice then asks for the same files on every node. Without train.resume, that advice stands."""
    import engine.snapshots as snapshots
    monkeypatch.setattr(snapshots, "differing_between_ranks", lambda items, device: True)  # the other rank differs
    cpu, resume = torch.device("cpu"), "/shared/run/snapshots/epoch0004.pt"
    with pytest.raises(snapshots.CheckpointError) as continued:  # this node's checkpoint.pt continued from resume
        snapshots.check_same_start_on_every_rank("/node/out", "/node/out/checkpoint.pt",
                                                 {"state": {"step": 7}, "model": {"w": torch.ones(2)}}, cpu, 1, resume)
    message = str(continued.value)
    assert message.startswith("the processes would start from other points: rank 1 resumes from "
                              "/node/out/checkpoint.pt at update 7 (weights "), message
    assert "the same checkpoint on every node" not in message, message
    assert message.endswith(f"out_dir must be one folder that every node reads (a shared file system), with "
                            f"train.resume={resume} each node resumes from its own out_dir/checkpoint.pt where that "
                            f"file continued from it, else from its own copy of {resume}: give every node the same "
                            f"files"), message
    with pytest.raises(snapshots.CheckpointError) as afresh:  # no train.resume, no checkpoint.pt on this node
        snapshots.check_same_start_on_every_rank("/node/out", None, None, cpu, 1, "")
    assert str(afresh.value) == ("the processes would start from other points: rank 1 finds no checkpoint.pt in "
                                 "out_dir=/node/out and would start afresh, another rank otherwise; out_dir must be "
                                 "one folder that every node reads (a shared file system), or train.resume=PATH the "
                                 "same checkpoint on every node")
