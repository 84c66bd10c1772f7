"""Preemption: SIGTERM / SIGINT become a stop at an update boundary that every rank agrees on.

Cluster schedulers (SLURM preemption, `scancel`, `timeout`, `kill -TERM -- -PGID`) send SIGTERM to every
process of the job, DataLoader workers and torchrun included; Ctrl-C sends SIGINT to the whole
foreground process group. The rule:

* the main process of each rank only records the request (`Preemption`); the training loop asks
  `should_stop(step)` after every optimizer update, validation after every batch, and train.py at
  epoch ends; then train.py writes checkpoint.pt first (before any validation or best.pt work) and
  exits with code `EXIT_PREEMPTED` (75), and the same command resumes. A checkpoint write in progress
  always completes (the handler only records the request). evaluate.py does the same during GPLQ's stage 1
  (quant/gplq/qat.py): it writes the stage-1 checkpoint and raises `Preempted`, and evaluate.py exits 75;
* under DDP the ranks agree through an all-reduce of the flag after every update: launched without
  waiting (`async_op`) and read one call later, so it costs no host sync, and every rank stops at the
  same update at most one update after the signal, whichever rank got it. Boundary calls (epoch ends)
  agree at once. Once they agree to stop, rank 0 alone logs the warning, naming the ranks that got a signal
  unless all did (the others logged it too, and said they were writing the checkpoint that rank 0 writes);
* the same flag carries a stop the code asks for (`request_stop`): a rank that cannot load a training
  batch raises it, so that every rank leaves the update loop within two updates and raises there
  (engine/loop.py), instead of training on until the next log step or checkpoint;
* DataLoader workers ignore both signals unless their own main process sends them
  (`ignore_stop_signals`, their `worker_init_fn`): a worker killed by the scheduler's SIGTERM would turn
  the request into a crash of the main process. They end with the loader (and exit by themselves if the
  main process dies);
* repeated signals within `repeat_window_s` of the first are the same request (torchrun forwards the
  signal it received to its workers, which then see it twice); a later SIGINT raises `SecondInterrupt` (a
  KeyboardInterrupt) at once (a second Ctrl-C means "now"), a later SIGTERM is ignored. train.py ends on it with
  one line (exit code 130, as a shell's for SIGINT), not a traceback.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from engine import startup_signals

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The exit code of a run that stopped on a signal with its checkpoint written: sysexits.h EX_TEMPFAIL
# ("temporary failure; the user is invited to retry"), so that job scripts and sweeps can tell it from
# success (0) and from errors (1, or a signal's 128 + n).
from engine.exit_codes import EXIT_PREEMPTED  # noqa: E402,F401  (re-exported)


class Preempted(Exception):
    """A stage stopped on a stop request after writing its checkpoint (GPLQ stage 1 under evaluate.py): the entry
    point exits with `EXIT_PREEMPTED`, and the same command resumes. Raised on every rank at the same update (the
    ranks agreed on the stop), so `engine.distributed.process_group` ends the group as after a finished run."""


def preempted_line(step: int, saved: str) -> str:
    """The one line an entry point logs when it stops on a signal with its checkpoint (`saved`) written."""
    return (f"preempted at update {step}; {saved} saved, re-run the same command to resume "
            f"(exit code {EXIT_PREEMPTED})")


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader `worker_init_fn`: workers leave SIGTERM / SIGINT to the main process.

    SIGINT is ignored outright. SIGTERM cannot be: the main process ends its workers with SIGTERM too
    (multiprocessing's exit handler, DataLoader's shutdown), and a worker deaf to it would hang the main
    process at exit. So SIGTERM is blocked and a watcher thread takes it with `sigwaitinfo`, which names
    the sender: from the parent, the worker exits (as torch's own handler does); from anyone else (a
    scheduler signalling the process group), it is ignored. Threads started later inherit the block.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards a SIGINT that came while it was blocked
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    threading.Thread(target=_exit_on_parents_sigterm, args=(os.getppid(),), name="sigterm-watcher",
                     daemon=True).start()


@contextlib.contextmanager
def stop_signals_blocked():
    """Block SIGTERM / SIGINT in the calling (main) thread while DataLoader workers start.

    A worker inherits the signal mask (through fork, and through exec as well), so a scheduler's SIGTERM to
    the process group that lands before the worker's `ignore_stop_signals` has run stays pending instead
    of killing it (which the main process would see as a crashed worker, not a stop request); the worker
    then takes it as from "anyone else" and ignores it. The main process gets its own copy when the block
    ends, and stops as for any stop request."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _exit_on_parents_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)


def ignore_sigterm_until_exit() -> None:
    """An entry point's last step once its run is over (its files written, its log lines out, the process group
    left), right before it exits with the run's code (75 after a stop, 0): from here on SIGTERM is ignored.

    Why: under torchrun the agent sends SIGTERM to the ranks still running as soon as one has exited with a code
    other than 0, and interpreter shutdown takes seconds (torch's teardown, no Python frame left). The rank that
    exited 75 a moment earlier then got the other one killed with -15, not the 75 every rank of a stopped run exits
    with. SIG_IGN, not a recording handler: Python puts SIG_DFL back for a handler of its own before the shutdown's
    long part (the garbage collection and the modules' teardown), but keeps SIG_IGN. Nothing is left to stop by
    then; a process that hung in its shutdown still ends at SIGINT or SIGKILL (torchrun's after its shutdown
    timeout, a scheduler's after its grace period)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class SecondInterrupt(KeyboardInterrupt):
    """A SIGINT (Ctrl-C) more than `Preemption.repeat_window_s` after the first stop request: stop now, not at the
    next update boundary. Its message is the line to end with (train.py's __main__)."""


def file_version(path: str | None) -> tuple | None:
    """Which write of `path` is there (inode, size, mtime), None where there is none."""
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return None
    return None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns)


def second_interrupt_line(saves: str, saves_at: str | None, at_start: tuple | None) -> str:
    """What a second Ctrl-C leaves: the stop's write of `saves` is not waited for (nothing says whether it had
    begun: a write cut is removed, engine/checkpoint.py). Where this run wrote `saves_at` (another file than
    `at_start`, its `file_version` when the run began) the same command resumes from it; otherwise it starts where
    this run did: afresh where there is none (a fresh start's logs are archived, engine/run_dir.py), from out_dir's
    checkpoint.pt, or from train.resume (a roll-back to a snapshot goes back there again)."""
    line = f"stopped at once by a second interrupt (Ctrl-C), without waiting for the {saves} the first asked for"
    if saves_at is None:
        return f"{line}; the same command resumes from the last {saves} written, if any"
    now = file_version(saves_at)
    if now is not None and now != at_start:
        return f"{line}; the same command resumes from {saves_at}, the last one written"
    if now is not None:
        return f"{line}; this run wrote none, so the same command starts where this one did"
    return (f"{line}; none was written in {os.path.dirname(saves_at) or '.'}, so the same command starts where this "
            f"one did (afresh, or from train.resume)")


class Preemption:
    """Records SIGTERM / SIGINT and decides, the same on every rank, when training stops.

    Args:
        device: the device of this rank's collectives (the flag tensor lives there).
        distributed: whether ranks must agree through an all-reduce.
        repeat_window_s: signals this soon after the first count as the same request.
        saves: what the stop writes, for the line logged after the first signal (by the next `should_stop`; under
            DDP by rank 0 alone, once the ranks agreed to stop, for every rank that got one).
        saves_at: its path (train.py's out_dir/checkpoint.pt), for the second interrupt's line: whether the same
            command resumes from it (written by this run) or starts where this run did. None: not told.
    """

    def __init__(self, device: torch.device, distributed: bool = False, repeat_window_s: float = 2.0,
                 saves: str = "checkpoint.pt", saves_at: str | None = None) -> None:
        self.device, self.distributed, self.saves, self.saves_at = device, distributed, saves, saves_at
        self._saves_at_start = file_version(saves_at)  # which file was there: did this run write another since
        self.repeat_window_s = repeat_window_s
        self.requested = False
        self.first_signal_at: float | None = None
        self.signum: int | None = None  # the first signal
        self._unannounced: int | None = None  # the first signal, until `should_stop` logs it (one process)
        self._told = False  # under DDP: the ranks agreed to stop and rank 0 said which got a signal
        self.rank = dist.get_rank() if distributed else 0
        self._pending: _Agreement | None = None
        previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        # a SIGTERM that came while the entry point started (engine/startup_signals.py) is this run's request;
        # its recorder is not put back: after the run, SIGTERM does what it does by default
        self._previous = {s: signal.SIG_DFL if startup_signals.is_recorder(h) else h for s, h in previous.items()}
        if startup_signals.RECEIVED:
            self._handle(startup_signals.RECEIVED[0], None)
            startup_signals.RECEIVED.clear()

    def _handle(self, signum: int, frame: object) -> None:
        # Only records: the handler runs between any two bytecodes of the main thread, also inside a logging
        # handler's write to train.log, where logging again is a reentrant call on the same buffered file
        # ("RuntimeError: reentrant call inside <_io.BufferedWriter>", printed as a logging error). The line
        # is logged by the next `should_stop`, at most one update later (under DDP once the ranks agree to stop).
        now = time.monotonic()
        if self.first_signal_at is None:
            self.first_signal_at = now
            self.requested = True
            self.signum = self._unannounced = signum
        elif signum == signal.SIGINT and now - self.first_signal_at > self.repeat_window_s:
            self.restore()
            raise SecondInterrupt(self.interrupt_line())

    def interrupt_line(self) -> str:
        """The line of a second interrupt (`second_interrupt_line`), of `saves_at` as it is now."""
        return second_interrupt_line(self.saves, self.saves_at, self._saves_at_start)

    def should_stop(self, step: int = 0, boundary: bool = False) -> bool:
        """True once a stop was requested on any rank; the same answer on every rank.

        Under DDP every rank must make the same sequence of calls. A plain call answers with the
        agreement launched by the previous call and launches the next one (no host sync); a `boundary`
        call (an epoch end, where no update follows soon) agrees on the spot.

        Args:
            step: optimizer updates done (for the log; the answer does not depend on it).
            boundary: agree now, waiting for the collective.
        """
        if not self.distributed:
            if self._unannounced is not None:
                log.warning("%s", self._stop_line(signal.Signals(self._unannounced).name))
                self._unannounced = None
            return self.requested
        previous, self._pending = self._pending, None
        stop = previous is not None and previous.result()
        if boundary and not stop:
            stop = _Agreement(self.requested, self.device).result()
        elif not stop:
            self._pending = _Agreement(self.requested, self.device)
        if stop and not self._told:  # the same call on every rank: the stop is agreed
            self._told = True
            self._say_who_got_a_signal()
        return stop

    def _stop_line(self, signals: str, where: str = "") -> str:
        return f"received {signals}{where}: stopping at the next update or evaluation batch boundary and writing " \
               f"{self.saves}"

    def _say_who_got_a_signal(self) -> None:
        """Under DDP, once the ranks agreed to stop: one line, rank 0's, for every rank that got a signal. Each
        rank logging its own said it once per rank when the scheduler signalled them all, and a rank that alone
        got one said it was writing the checkpoint, which rank 0 writes. One collective (the ranks' first
        signals), once per run: every rank makes it at the same `should_stop` call. Nothing is said for a stop
        the code asked for (`request_stop`): its caller says why."""
        world = dist.get_world_size()
        got = torch.zeros(world, device=self.device)  # the collective's device, whatever the default device is
        got[self.rank] = float(self.signum or 0)
        dist.all_reduce(got, op=dist.ReduceOp.SUM)
        signals = got.tolist()
        received = [r for r in range(world) if signals[r]]
        if self.rank != 0 or not received:
            return
        names = "/".join(sorted({signal.Signals(int(signals[r])).name for r in received}))
        where = "" if len(received) == world else f" on {rank_list(received)} of {world}"
        log.warning("%s", self._stop_line(names, where))

    def request_stop(self) -> None:
        """Raise this rank's stop flag from the code rather than from a signal, so that every rank stops at
        the next agreed update boundary (at most two updates on). TrainLoop calls it when this rank cannot
        load a training batch: the stop ends the epoch's loop early, and the loop then raises at its window's
        sums on every rank (this rank its own error, the others OtherRankError) before any caller reads
        the stop as a preemption, so nothing is saved and no preemption is logged. Nothing is logged here:
        the caller says why."""
        self.requested = True

    def restore(self) -> None:
        """Put back the signal handlers that were there before (idempotent)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def rank_list(ranks: list[int], shown: int = 8) -> str:
    """'rank 1', 'ranks 0, 3', or the first `shown` and how many more: 'ranks 0, 1, 2, 3, 4, 5, 6, 7 and 5 more'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return f"ranks {', '.join(map(str, ranks[:shown]))}{more}"


class _Agreement:
    """One all-reduce (max) of a rank's stop flag, started now and read later without stalling the device:
    on CUDA the result is copied to pinned host memory behind an event, so reading it waits only for the
    collective (the update before it), not for work queued since."""

    def __init__(self, requested: bool, device: torch.device) -> None:
        self.flag = torch.full((1,), float(requested), device=device)  # a fill, not a (syncing) host copy
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        self.host = self.event = None
        if device.type == "cuda":
            self.work.wait()  # the current stream waits for the collective; the host does not
            self.host = torch.empty(1, pin_memory=True, device="cpu")
            self.host.copy_(self.flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
            return bool(self.host.item())
        self.work.wait()
        return bool(self.flag.item())
