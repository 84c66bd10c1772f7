"""Preemption: SIGTERM / SIGINT to the main process, to the whole process group (DataLoader workers
included), to one torchrun rank, and during validation all stop within one update (or one validation
batch), write checkpoint.pt, exit EXIT_PREEMPTED (75) and resume."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from dist_utils import as_torchrun_rank, free_port, leave_and_exit, spawn_ranks
from engine.preemption import EXIT_PREEMPTED
from tests.conftest import DEBUG_CONFIG, ROOT, run_entry

LONG_RUN = ("sched.epochs=1000", "train.log_every_steps=1", "data.synthetic_train_size=256")


# PYTHONFAULTHANDLER: a SIGABRT makes each Python process print every thread's stack (see `output_of`)
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def launch(cmd):
    """`cmd` in a new session: its own process group (its DataLoader workers included; torchrun gives each
    rank a session of its own)."""
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=RUN_ENV)


def parents() -> dict:
    """{pid: parent pid} of every process on the machine (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    found[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:  # ended meanwhile
                pass
    return found


def descendants(pid: int) -> list:
    """The pids of `pid`'s children, their children, and so on."""
    parent_of, found = parents(), []
    frontier = [pid]
    while frontier:
        children = [child for child, parent in parent_of.items() if parent in frontier]
        found += children
        frontier = children
    return found


def describe(pid: int, launcher_pid: int) -> str:
    """'pid 123 (rank 1)' for a torchrun rank, 'pid 124 (a worker of pid 123)' below one, else 'pid 122'."""
    parent = parents().get(pid)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            rank = [v.split(b"=")[1].decode() for v in f.read().split(b"\0") if v.startswith(b"LOCAL_RANK=")]
    except OSError:
        rank = []
    if parent == launcher_pid and rank:
        return f"pid {pid} (rank {rank[0]})"
    return f"pid {pid}" + (f" (a worker of pid {parent})" if pid != launcher_pid and parent != launcher_pid else "")


def output_of(proc, timeout, out_dir, before=""):
    """All of `proc`'s output once it has exited. If it is still running after `timeout` seconds, each of its
    processes in turn (the launcher last) gets SIGABRT, which (PYTHONFAULTHANDLER) prints the Python stack of
    each of its threads, and the test fails with those stacks (also kept as hang_stacks.txt in `out_dir`): a
    hang says where each rank and worker waits instead of only that it took too long."""
    try:
        return before + proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        pass
    family = [*descendants(proc.pid), proc.pid]  # torchrun starts each rank in a session of its own
    order = [describe(pid, proc.pid) for pid in family]
    for pid in family:  # one at a time: stacks written at once into the one pipe would interleave
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        time.sleep(1.0)
    try:
        output = proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output = proc.communicate()[0]
    output = before + output
    with open(os.path.join(out_dir, "hang_stacks.txt"), "w") as f:
        f.write(output)
    stacks = output.find("Fatal Python error")
    stacks = stacks if stacks >= 0 else len(output)
    # what the processes printed before (a traceback of a DataLoader worker's queue, a warning), less the
    # per-update log lines
    before_stacks = "\n".join(line for line in output[:stacks].splitlines()
                              if not re.search(r" INFO update \d+/", line))
    pytest.fail(f"still running after {timeout} s; its output but the per-update lines:\n{before_stacks[-6000:]}\n"
                f"the stacks of its processes, aborted in this order: {', '.join(order)}:\n"
                f"{output[stacks:][:20000]}")


def start(cmd, out_dir):
    """Start `cmd` (`launch`) and wait until it has logged an update."""
    proc = launch(cmd)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    deadline = time.time() + 180
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"training did not start:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.2)
    return proc


def output_until(proc, marker: str, out_dir) -> str:
    """`proc`'s output up to and including its first line that holds `marker` (read as it comes); the test
    fails with the output if the process ends without one."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            return "".join(lines)
    pytest.fail(f"no line with {marker!r}:\n{output_of(proc, 60, out_dir, before=''.join(lines))[-3000:]}")


# The line an evaluation logs when a stop request ends it (engine/loop.py EvalBatches): a stop at an epoch's end
# (before its validation) or after the validation logs none.
CUT_SHORT = re.compile(r"evaluation stopped by the stop request after (\d+) of (\d+) batches")


def assert_cut_short(output: str, batches: int) -> None:
    """The validation of `batches` batches (this process's) was ended by the stop, before its last batch."""
    cut = CUT_SHORT.findall(output)
    assert len(cut) == 1 and int(cut[0][0]) < int(cut[0][1]) == batches, (cut, output[-3000:])


def saved_step(out_dir) -> int:
    return torch.load(os.path.join(out_dir, "checkpoint.pt"), weights_only=True)["state"]["step"]


def _resume_rank(rank: int, world: int, port: int, args: list) -> None:
    """One rank of `train.py *args`, joined as torchrun would join it."""
    as_torchrun_rank(rank, world, port)
    result = train.main(train.parse_args(args))
    assert result.reason != "preempted", result.reason  # as train.py's exit status 0 says
    leave_and_exit()


def resume_two_more_updates_on_two_ranks(cmd, out_dir, step):
    """`cmd`'s train.py settings plus two more updates, on two ranks started from the test's fork server
    (spawn_ranks): the resume is the engine's, not torchrun's (three processes importing torch again, seconds)."""
    spawn_ranks(_resume_rank, (2, free_port(), [*cmd[cmd.index("train.py") + 1:], f"train.max_steps={step + 2}"]), 2)
    with open(os.path.join(out_dir, "train.log")) as f:
        assert f"resumed from {os.path.join(out_dir, 'checkpoint.pt')} at epoch" in f.read()
    assert saved_step(out_dir) == step + 2


def resume_in_this_process(cmd, *overrides):
    """`cmd`'s train.py settings plus `overrides`, trained by train.main in this process: a resume is no
    process-level behaviour (a process of its own would import torch again, seconds each; the torchrun test
    resumes in processes). The run must end as train.py's exit status 0 says (not preempted again). Its callers
    take the one_thread fixture, as the processes they start have OMP_NUM_THREADS=1: the 20,000-image validation
    took 44 s on two threads of a loaded 2-core machine, 3 s on one."""
    result = train.main(train.parse_args([*cmd[cmd.index("train.py") + 1:], *overrides]))
    assert result.reason != "preempted", result.reason
    return result


def long_run(*overrides):
    """LONG_RUN's items but those of a key that `overrides` set, then `overrides` (train.py refuses a key given
    twice)."""
    given = {item.split("=", 1)[0] for item in overrides}
    return [*[item for item in LONG_RUN if item.split("=", 1)[0] not in given], *overrides]


def train_cmd(out_dir, *overrides):
    return [sys.executable, "train.py", "--config", DEBUG_CONFIG, f"out_dir={out_dir}", *long_run(*overrides)]


@pytest.mark.parametrize("signum, target, workers", [
    (signal.SIGTERM, "main", 0),
    # to the group with loader workers (slow: 12-26 s each): what SLURM, scancel, timeout and
    # `kill -TERM -- -PGID` do, and Ctrl-C in a terminal
    pytest.param(signal.SIGTERM, "group", 2, marks=pytest.mark.slow),
    pytest.param(signal.SIGINT, "group", 2, marks=pytest.mark.slow),
], ids=["sigterm-main", "sigterm-group-workers", "sigint-group-workers"])
def test_signal_saves_a_checkpoint_exits_75_and_resumes(tmp_path, signum, target, workers, caplog, one_thread):
    cmd = train_cmd(tmp_path, f"data.num_workers={workers}")
    proc = start(cmd, tmp_path)
    if target == "group":
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    output = output_of(proc, 120, tmp_path)
    # the documented code (sysexits EX_TEMPFAIL, 75) that job scripts act on, not only the constant's value
    assert proc.returncode == EXIT_PREEMPTED == os.EX_TEMPFAIL == 75, output[-3000:]
    assert "preempted at update" in output and "Traceback" not in output
    # no validation pass after the signal (the run summary may still name the best of an earlier one)
    assert not re.search(r"update \d+\s+val top-1", output.split("preempted at update")[1]), output[-3000:]
    step = saved_step(tmp_path)
    assert 1 <= step < 16000  # 16 updates per epoch x 1000 epochs: stopped early
    with caplog.at_level("INFO"):
        resume_in_this_process(cmd, f"train.max_steps={step + 2}")
    assert f"resumed from {tmp_path / 'checkpoint.pt'} at epoch" in caplog.text
    assert saved_step(tmp_path) == step + 2


def rank_pid(launcher_pid: int, local_rank: int) -> int:
    """The pid of torchrun's worker process with LOCAL_RANK=`local_rank`."""
    for pid, parent in parents().items():
        if parent != launcher_pid:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return pid
    pytest.fail(f"no rank {local_rank} under torchrun {launcher_pid}")


def last_logged_step(out_dir) -> int:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return max(json.loads(line)["step"] for line in f if line.strip())


@pytest.mark.slow
def test_sigterm_to_one_torchrun_rank_stops_every_rank_within_one_update(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port", str(free_port()),
           "train.py", "--config", DEBUG_CONFIG, f"out_dir={tmp_path}", *LONG_RUN,
           "train.batch_size_per_gpu=8", "data.num_workers=0"]
    # no DataLoader workers: they are not what this test is about (the group-signal tests above take them), and a
    # worker that stops delivering would hang both ranks whatever the signal does: multiprocessing.Queue's feeder
    # thread prints and drops a batch it cannot send (an OSError while passing its tensors, e.g. out of file
    # descriptors or shared memory on a loaded machine), and torch's DataLoader then waits for it forever
    proc = start(cmd, tmp_path)
    time.sleep(1.0)
    # the signal lands on rank 1 only, while rank 0 (which writes the checkpoint) knows nothing of it; its pid is
    # found first (a scan of /proc, slow on a loaded machine, while training goes on), so that the last logged
    # update is read right before the signal
    rank1 = rank_pid(proc.pid, 1)
    logged = last_logged_step(tmp_path)
    os.kill(rank1, signal.SIGTERM)
    output = output_of(proc, 180, tmp_path)
    assert "preempted at update" in output, output[-3000:]
    assert 'train.py", line' not in output, output[-3000:]
    # both ranks exit EXIT_PREEMPTED, and torchrun reports it for each: the SIGTERM it sends the rank still exiting
    # once the other has exited is not its end (-15, test_a_sigterm_while_a_stopped_run_exits_leaves_its_exit_code_75)
    assert output.count("exitcode  : 75") == 2, output[-3000:]
    step = saved_step(tmp_path)
    # rank 1 is at most one update ahead of rank 0's last log line; the ranks agree one update later
    assert logged <= step <= logged + 3, (logged, step)
    resume_two_more_updates_on_two_ranks(cmd, tmp_path, step)


# train.py's __main__ in a process (python -c) whose run is stopped by a SIGTERM after update 2 and which gets a
# second SIGTERM while the interpreter tears its modules down, after the run's last line: what torchrun sends a
# rank still exiting once another rank has exited 75 (interpreter shutdown takes seconds). The second signal
# comes from a module-level object's __del__, i.e. in the shutdown's long part, after Python has put SIG_DFL back
# for any signal handler of its own.
CLOSING_SIGNAL_SCRIPT = r"""
import os, runpy, signal, sys, types
import torch.optim.optimizer as optimizer_module

updates = []
def stop_after_update_2(*_):
    updates.append(1)
    if len(updates) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
optimizer_module.register_optimizer_step_post_hook(stop_after_update_2)

class ClosingSignal:
    def __del__(self, kill=os.kill, pid=os.getpid(), write=os.write):
        kill(pid, signal.SIGTERM)
        write(2, b"outlived the closing SIGTERM\n")
holder = types.ModuleType("closing_signal")
holder.signal = ClosingSignal()
sys.modules[holder.__name__] = holder
del holder
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_sigterm_while_a_stopped_run_exits_leaves_its_exit_code_75(tmp_path):
    """Under torchrun the ranks of a stopped run all exit 75, and the first to exit makes the agent SIGTERM the
    others, which were still in interpreter shutdown: one of them ended with -15 (2 runs in 5 with SIGTERM sent to
    rank 1). A SIGTERM once the run is over and its files written leaves the exit code the run's."""
    run = subprocess.run([sys.executable, "-c", CLOSING_SIGNAL_SCRIPT, *train_cmd(tmp_path)[2:]], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180, env=RUN_ENV)
    assert run.returncode == EXIT_PREEMPTED, (run.returncode, run.stdout[-3000:])
    assert "Traceback" not in run.stdout, run.stdout[-3000:]
    last = run.stdout.rstrip().splitlines()[-2:]  # the run summary, then the closing signal, which was outlived
    assert "run summary: stopped by a signal (resumable) at update 2" in last[0], run.stdout[-3000:]
    assert last[1] == "outlived the closing SIGTERM", run.stdout[-3000:]
    assert saved_step(tmp_path) == 2


@pytest.mark.slow
def test_sigterm_to_one_rank_during_validation_ends_it_on_every_rank(tmp_path):
    # 20,001 validation images: the two ranks' shards differ by one image (and one batch of 16)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port", str(free_port()),
           "train.py", "--config", DEBUG_CONFIG, f"out_dir={tmp_path}", *long_run("log.tensorboard=false",
           "data.synthetic_train_size=64", "data.synthetic_val_size=20001", "train.batch_size_per_gpu=8")]
    proc = launch(cmd)
    # rank 0 logs this after the ranks agreed at the epoch's end that no stop was requested: the signal lands
    # in the validation (which takes seconds), not before it, whatever the CPU's speed
    before = output_until(proc, "validation at update 4: 20001 images", tmp_path)
    os.kill(rank_pid(proc.pid, 1), signal.SIGTERM)
    output = output_of(proc, 180, tmp_path, before=before)
    assert "preempted at update 4" in output and "val top-1" not in output, output[-3000:]
    assert_cut_short(output, 626)  # rank 0's 10,001 images in batches of 16 (rank 1 has 625)
    assert output.count("exitcode  : 75") == 2 and 'train.py", line' not in output, output[-3000:]
    ckpt = torch.load(os.path.join(tmp_path, "checkpoint.pt"), weights_only=True)
    assert ckpt["state"]["step"] == 4 and ckpt["state"]["validation_due"]


@pytest.mark.slow  # a train.py process and a 20,000-image validation
def test_a_stop_during_validation_ends_it_writes_the_checkpoint_first_and_resume_validates(tmp_path, caplog,
                                                                                          one_thread):
    # 4 updates per epoch, then a validation of 20,000 images (about 3 s on one thread of a 2-core VM). The line
    # that announces it comes after the epoch-end stop check: the signal lands in the validation, not before it
    # (where the run would stop at the epoch boundary, without validating), whatever the CPU's speed
    cmd = train_cmd(tmp_path, "data.synthetic_train_size=64", "data.synthetic_val_size=20000",
                    "log.tensorboard=false")
    proc = launch(cmd)
    before = output_until(proc, "validation at update 4: 20000 images", tmp_path)
    proc.send_signal(signal.SIGTERM)
    output = output_of(proc, 120, tmp_path, before=before)
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    assert "val top-1" not in output and "preempted at update 4" in output, output[-3000:]
    assert_cut_short(output, 1250)  # the stop ended the validation early (a wall-clock bound failed when busy)
    ckpt = torch.load(os.path.join(tmp_path, "checkpoint.pt"), weights_only=True)
    assert ckpt["state"]["step"] == 4 and ckpt["state"]["validation_due"]
    assert not os.path.exists(os.path.join(tmp_path, "best.pt"))
    # the same command (up to update 4) validates what the stop skipped, then finishes
    with caplog.at_level("INFO"):
        assert resume_in_this_process(cmd, "train.max_steps=4").state.step == 4
    assert "epoch 1/1000  update 4  val top-1" in caplog.text
    ckpt = torch.load(os.path.join(tmp_path, "checkpoint.pt"), weights_only=True)
    assert ckpt["state"]["step"] == 4 and not ckpt["state"]["validation_due"]
    assert os.path.exists(os.path.join(tmp_path, "best.pt"))


def test_a_classifier_validation_stopped_midway_says_after_how_many_batches_and_gives_no_numbers(caplog):
    """A stop request asked before the third of four batches: the evaluation ends there (the model saw two
    batches), returns None, and its one line names 2 of 4 batches (the process tests above read it)."""
    from engine.loop import evaluate

    seen = []

    class Counting(torch.nn.Module):
        def forward(self, x):
            seen.append(len(x))
            return torch.zeros(len(x), 3)

    asked = []

    def stop_at_third_batch():
        asked.append(1)
        return len(asked) == 3

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2), torch.zeros(8).long()),
                                         batch_size=2)
    with caplog.at_level("INFO", logger="engine.loop"):
        assert evaluate(Counting(), loader, torch.device("cpu"), should_stop=stop_at_third_batch) is None
    assert seen == [2, 2] and len(asked) == 3
    assert CUT_SHORT.findall(caplog.text) == [("2", "4")], caplog.text


def test_a_second_interrupt_after_the_grace_window_stops_at_once():
    from engine.preemption import Preemption

    with Preemption(torch.device("cpu"), repeat_window_s=0.0) as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # let the handler run
        assert preemption.requested and preemption.should_stop(step=3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_the_signal_handler_only_records_and_the_next_stop_check_logs_it():
    """The handler runs between any two bytecodes, also inside a logging handler's write to train.log, where
    logging again is a reentrant call on that buffered file (a 'Logging error' traceback in the run's output):
    it must not log. Here a logging handler raises if anything is logged while it is already writing, and the
    signal arrives from inside its emit (was: the handler logged its warning there)."""
    import logging

    from engine.preemption import Preemption

    class Writer(logging.Handler):
        def __init__(self):
            super().__init__()
            self.writing, self.lines = False, []

        def emit(self, record):
            assert not self.writing, f"logged from inside a write: {record.getMessage()}"
            self.writing = True
            try:
                if record.getMessage() == "a line being written":
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.05)  # the handler runs here, inside this write
                self.lines.append(record.getMessage())
            finally:
                self.writing = False

    writer, logger = Writer(), logging.getLogger("engine.preemption")
    logger.addHandler(writer)
    try:
        with Preemption(torch.device("cpu"), saves="stage1.pt") as preemption:
            logger.warning("a line being written")
            assert preemption.requested and writer.lines == ["a line being written"]
            assert preemption.should_stop(step=3)
            assert writer.lines[1:] == ["received SIGTERM: stopping at the next update or evaluation batch boundary "
                                       "and writing stage1.pt"]
            assert preemption.should_stop(step=4) and len(writer.lines) == 2  # logged once
    finally:
        logger.removeHandler(writer)


def test_repeated_signals_in_the_window_are_one_request():
    from engine.preemption import Preemption

    for kwargs in ({"repeat_window_s": 60.0}, {}):  # {}: the default window, the one train.py uses
        with Preemption(torch.device("cpu"), **kwargs) as preemption:
            try:
                for _ in range(3):  # e.g. torchrun forwarding the signal the worker already got
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.05)
            except KeyboardInterrupt:  # a clean failure, not an interrupted test session
                pytest.fail(f"a repeat 0.05 s after the first signal stopped at once ({kwargs or 'default'})")
            assert preemption.requested


def test_ranks_agree_one_call_late_on_updates_and_at_once_at_boundaries(tmp_path):
    """The documented protocol, in a one-process group: a plain call answers with the agreement the previous
    call launched (a stop requested after call 1 is seen at call 3, the same call on every rank), a boundary
    call agrees on the spot."""
    import torch.distributed as dist

    from engine.preemption import Preemption

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with Preemption(torch.device("cpu"), distributed=True) as preemption:
            assert preemption.should_stop(step=1) is False
            preemption.requested = True  # what the signal handler records
            assert preemption.should_stop(step=2) is False  # the agreement launched at call 1: no stop yet
            assert preemption.should_stop(step=3) is True
        with Preemption(torch.device("cpu"), distributed=True) as preemption:
            assert preemption.should_stop(boundary=True) is False
            preemption.requested = True
            assert preemption.should_stop(boundary=True) is True
    finally:
        dist.destroy_process_group()


def test_the_agreed_stop_line_builds_its_tensor_on_the_preemption_device_not_the_default_one(tmp_path, caplog):
    """Once the ranks agree to stop, the all-reduce of the ranks' signals (the one warning line) runs on the
    Preemption's device: under the meta default device (tests/device_utils.py, standing in for a default the
    code does not own) the tensor was made there and copied to the CPU, 'Cannot copy out of meta tensor'."""
    import logging

    import torch.distributed as dist

    from engine.preemption import Preemption

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with Preemption(torch.device("cpu"), distributed=True, saves="stage1.pt") as preemption, \
                caplog.at_level(logging.WARNING, logger="engine.preemption"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler records the request here
            with torch.device("meta"):
                stops = [preemption.should_stop(step=1), preemption.should_stop(step=2)]
        assert stops == [False, True]  # the agreement launched at the first call answers at the second
        assert [r.getMessage() for r in caplog.records if r.name == "engine.preemption"] == [
            "received SIGTERM: stopping at the next update or evaluation batch boundary and writing stage1.pt"]
    finally:
        dist.destroy_process_group()


def test_a_later_sigterm_is_ignored_only_a_later_sigint_stops_at_once():
    """Past the repeat window a second SIGTERM (a scheduler repeating itself) is no 'now': the stop request
    stands and nothing is raised; a SIGINT then is (a second Ctrl-C)."""
    from engine.preemption import Preemption

    with Preemption(torch.device("cpu"), repeat_window_s=0.0) as preemption:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert preemption.requested and preemption.should_stop(step=1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)


def _agreement_worker(rank: int, world: int, port: int, out: str) -> None:
    from dist_utils import init_gloo, leave_and_exit
    from engine.preemption import Preemption

    init_gloo(rank, world, port)
    answers = []
    with Preemption(torch.device("cpu"), distributed=True) as preemption:
        preemption.requested = rank == 0  # only rank 0 got the signal
        answers.append(preemption.should_stop(boundary=True))
    with Preemption(torch.device("cpu"), distributed=True) as preemption:
        preemption.requested = rank == 0
        answers += [preemption.should_stop(step=1), preemption.should_stop(step=2)]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(answers, f)
    leave_and_exit()


def test_a_stop_one_rank_got_is_every_ranks_stop_at_a_boundary_and_one_call_later_on_updates(tmp_path):
    """Two gloo ranks, the signal on rank 0 only: the boundary call says stop on both (agreed on the spot, not
    each rank's own flag), and plain calls say no, then stop, on both (the flags' maximum, one call late)."""
    out = str(tmp_path / "answers")
    spawn_ranks(_agreement_worker, (2, free_port(), out), 2)
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            assert json.load(f) == [True, False, True], rank


def _warning_worker(rank: int, world: int, port: int, out: str) -> None:
    import logging

    from dist_utils import init_gloo, leave_and_exit
    from engine.preemption import Preemption

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    init_gloo(rank, world, port)
    logging.getLogger("engine.preemption").addHandler(Lines())
    logged = {}
    for case, signalled in (("every rank", (0, 1)), ("rank 1 alone", (1,))):
        lines = []
        with Preemption(torch.device("cpu"), distributed=True) as preemption:
            if rank in signalled:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # let the handler run
            answers = [preemption.should_stop(step=1), preemption.should_stop(step=2),
                       preemption.should_stop(boundary=True)]
        logged[case] = {"answers": answers, "lines": lines}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(logged, f)
    leave_and_exit()


def test_the_stop_warning_is_one_line_of_rank_0_naming_the_ranks_that_got_the_signal(tmp_path):
    """Two gloo ranks. A SIGTERM to every rank (a scheduler, torchrun forwarding its own) was warned of once per
    rank, where a line every rank logs alike is rank 0's alone; one to rank 1 alone was warned of by rank 1 only,
    saying it was writing checkpoint.pt, which rank 0 writes. Now rank 0 says it once, when the ranks agree to
    stop, naming the ranks that got it unless all did."""
    out = str(tmp_path / "logged")
    spawn_ranks(_warning_worker, (2, free_port(), out), 2)
    logged = []
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            logged.append(json.load(f))
    tail = ": stopping at the next update or evaluation batch boundary and writing checkpoint.pt"
    for case, line in (("every rank", f"received SIGTERM{tail}"),
                       ("rank 1 alone", f"received SIGTERM on rank 1 of 2{tail}")):
        assert [logged[rank][case]["answers"] for rank in range(2)] == [[False, True, True]] * 2, case
        assert [logged[rank][case]["lines"] for rank in range(2)] == [[line], []], case


RACE_SCRIPT = r"""
import os, signal, sys, time
import torch
from torch.utils.data import DataLoader
from data.loader import StopSafeDataLoader
from engine.preemption import ignore_stop_signals

def slow_init(worker_id):  # a worker that takes a while to start: the window a group signal can hit
    time.sleep(1.0)
    ignore_stop_signals(worker_id)

import subprocess
for name in sys.argv[1:]:  # one loader after the other, each hit by a group signal of its own
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append("TERM"))
    cls = StopSafeDataLoader if name == "safe" else DataLoader
    loader = cls(torch.arange(64).float(), batch_size=8, num_workers=2, worker_init_fn=slow_init)
    batches = iter(loader)
    try:
        # the scheduler (another process) signals the whole group while the workers start; inside the try: a
        # worker's death is raised by torch's SIGCHLD handler wherever the main process is, also while it still
        # waits for kill to end (a slow machine)
        subprocess.run(["kill", "-TERM", "--", f"-{os.getpgid(0)}"])
        print(name, "batches", len(list(batches)), "main got", got, flush=True)
    except RuntimeError as e:
        print(name, "worker died:", e, flush=True)
    del batches, loader
"""


@pytest.mark.slow
def test_a_group_signal_while_workers_start_is_a_stop_request_not_a_crash():
    """StopSafeDataLoader starts its workers with the stop signals blocked; torch's plain DataLoader, the
    reference, loses a worker to the same signal (so the test shows the window it closes). One process, the
    two loaders in turn (a process each would import torch again)."""
    run = subprocess.run([sys.executable, "-c", RACE_SCRIPT, "safe", "plain"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "safe batches 8 main got ['TERM']" in run.stdout, run.stdout + run.stderr[-2000:]
    assert "plain worker died" in run.stdout, run.stdout + run.stderr[-2000:]


@pytest.mark.slow  # train.py processes
def test_a_sigterm_while_train_py_imports_is_a_stop_request_exit_75_not_143(tmp_path, one_thread):
    """A scheduler's SIGTERM in the seconds train.py spends importing (minutes in a multi-node rendezvous) ended
    the process with status 143, which a requeue script reads as a failure: now the run starts, stops at its
    first update boundary with checkpoint.pt, and exits 75, like any stopped run. The signal is sent while the
    process maps libtorch, i.e. inside `import torch`, long before Preemption's own handlers exist."""
    cmd = train_cmd(tmp_path)
    proc = launch(cmd)
    maps, deadline = f"/proc/{proc.pid}/maps", time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        with contextlib.suppress(OSError), open(maps) as f:
            if "libtorch" in f.read():
                break
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    output = output_of(proc, 120, tmp_path)
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, output[-3000:])
    assert "received SIGTERM" in output and "preempted at update" in output and "Traceback" not in output
    assert saved_step(tmp_path) <= 1  # stopped at the first boundary: the request came before training
    result = resume_in_this_process(cmd, "train.max_steps=2")
    assert result.state.step == 2


def test_a_startup_sigterm_becomes_the_request_and_after_the_run_sigterm_has_its_default_action():
    """engine/startup_signals.py's recorder: a SIGTERM it recorded is the next Preemption's request (taken once),
    and the Preemption puts SIGTERM's default action back, not the recorder: a process waiting in its teardown
    (a final barrier) must still end at a plain `kill`, and a test process that ran train.py's __main__ must
    not go on ignoring SIGTERM."""
    from engine import startup_signals
    from engine.preemption import Preemption

    before = signal.getsignal(signal.SIGTERM)
    try:
        startup_signals.record_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # let the handler run
        assert startup_signals.RECEIVED == [signal.SIGTERM]
        with Preemption(torch.device("cpu")) as preemption:
            assert preemption.requested and startup_signals.RECEIVED == []
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with Preemption(torch.device("cpu")) as preemption:  # nothing recorded since: no request
            assert not preemption.requested
    finally:
        signal.signal(signal.SIGTERM, before)
        startup_signals.RECEIVED.clear()


def test_train_py_run_in_this_process_leaves_the_stop_signal_handlers_as_they_were(capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    code, _, err = run_entry("train.py", ["train.batch_size=0"], capsys)  # refused before any Preemption
    assert code == 1 and "train.batch_size" in err
    assert {s: signal.getsignal(s) for s in before} == before


def second_ctrl_c_run(tmp_path, capsys, monkeypatch, first_at: int, *overrides: str,
                      in_write: int = 1) -> tuple[int, str, str]:
    """train.py in this process: a first Ctrl-C after update `first_at` asks for a checkpoint at the next update, a
    second one more than 2 s later (the repeat window) comes inside that checkpoint's write (which it then drops):
    inside the `in_write`-th write from the first Ctrl-C on (2: the stop's, after a write held back at that update)."""
    import torch.optim.optimizer as optimizer_module

    import engine.checkpoint as checkpoint_module

    updates, writes = [0], [0]

    def first_ctrl_c(*_):
        updates[0] += 1
        if updates[0] == first_at:
            os.kill(os.getpid(), signal.SIGINT)

    save = checkpoint_module.torch.save

    def slow_save_with_a_second_ctrl_c(obj, f, *args, **kwargs):
        writes[0] += updates[0] >= first_at
        if updates[0] >= first_at and writes[0] == in_write:  # the stop's write, not an earlier one of the run
            time.sleep(2.2)  # past the 2 s within which a repeated signal is the same request
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", slow_save_with_a_second_ctrl_c)
    handle = optimizer_module.register_optimizer_step_post_hook(first_ctrl_c)
    try:
        return run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'run'}", *overrides], capsys)
    except KeyboardInterrupt as e:  # as the process ends on it: a traceback, no line in train.log
        pytest.fail(f"train.py's __main__ let the second interrupt through: {e!r}")
    finally:
        handle.remove()
        monkeypatch.setattr(checkpoint_module.torch, "save", save)  # the test's own run again writes as usual


def test_a_second_ctrl_c_during_the_checkpoint_write_ends_train_py_with_one_line_and_exit_130(tmp_path, capsys,
                                                                                               monkeypatch,
                                                                                               debug_config):
    """The first Ctrl-C asks for a checkpoint at the next update; a second one more than 2 s later (here inside that
    checkpoint's write) stops at once. That printed a 30-line traceback of wherever the signal landed, and train.log
    had no line saying how the run ended. Now one line, on stderr and in train.log, exit code 130 (128 + SIGINT),
    and no checkpoint.pt half written: its temporary file is removed. No checkpoint.pt was written: the line said
    the same command resumes from the last one, where it starts afresh (as it does: the whole schedule)."""
    code, out, err = second_ctrl_c_run(tmp_path, capsys, monkeypatch, 2)
    tmp_path = tmp_path / "run"
    assert code == 130, err[-3000:]
    assert "Traceback" not in err + out
    line = ("error: stopped at once by a second interrupt (Ctrl-C), without waiting for the checkpoint.pt the first "
            f"asked for; none was written in {tmp_path}, so the same command starts where this one did (afresh, or "
            "from train.resume)")
    assert err.strip().splitlines() == [line]
    assert (tmp_path / "train.log").read_text().rstrip().splitlines()[-1].endswith(line)
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "metrics.jsonl", "tb", "train.log"]
    assert train.main(debug_config()).state.step == 8  # the same command: afresh, to the end
    assert (tmp_path / "archive").is_dir()


@pytest.mark.parametrize("first_at, in_write", [(3, 1), (2, 2)], ids=["after_a_written_one", "inside_the_held_one"])
def test_a_second_ctrl_c_in_the_stops_write_keeps_the_last_whole_checkpoint_and_says_it_resumes_from_it(
        tmp_path, capsys, monkeypatch, debug_config, first_at, in_write):
    """train.ckpt_every_steps=2 wrote checkpoint.pt at update 2 (first_at 3: a first Ctrl-C after update 3, a second
    inside the stop's write at update 4), or held back its write of update 2 (engine/loop.py TrainLoop.checkpoint;
    first_at 2: a first Ctrl-C at update 2 made the stop write update 2 again, and a second inside that write deleted
    the held one, a whole checkpoint: the line said that none was written and the same command started afresh). A
    stop makes the held write checkpoint.pt (docs/operations.md), and the second interrupt does too: in both, the line
    names checkpoint.pt, no partial file is left, and the same command resumes at update 2."""
    code, out, err = second_ctrl_c_run(tmp_path, capsys, monkeypatch, first_at, "train.ckpt_every_steps=2",
                                       in_write=in_write)
    tmp_path = tmp_path / "run"
    assert code == 130, err[-3000:]
    line = ("error: stopped at once by a second interrupt (Ctrl-C), without waiting for the checkpoint.pt the first "
            f"asked for; the same command resumes from {tmp_path / 'checkpoint.pt'}, the last one written")
    assert err.strip().splitlines() == [line]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["state"]["step"] == 2
    assert not [name for name in os.listdir(tmp_path) if ".partial-" in name]
    train.main(debug_config("train.ckpt_every_steps=2"))
    assert f"resumed from {tmp_path / 'checkpoint.pt'} at epoch 0, update 2" in (tmp_path / "train.log").read_text()
