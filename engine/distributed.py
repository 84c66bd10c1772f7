"""Process-group setup for `torchrun` (single or multi-node) and plain single-process runs.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT); without them the run is a
single process. Values that are no numbers, or WORLD_SIZE > 1 without the others (a command started without
torchrun), are one error line (`launcher_environment`). NCCL on CUDA, gloo on CPU (so tests can run two CPU
processes); ranks that resolved train.device to different device types (auto on nodes with and without a GPU) are
refused on every rank before the group forms (`same_device_type_on_every_rank`), instead of waiting for each other
until the timeout.

Work that must happen once (a quantization pipeline's sequential reconstruction, a file write) runs on
rank 0 through `run_on_main`; the other ranks wait for its result in a separate gloo group whose timeout
is sized for that work, not NCCL's 10 minutes, and raise `OtherRankError` if it fails.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn, Optional, TypeVar

import torch
import torch.distributed as dist

from configs import ConfigError
from engine.console import console_print
from engine.preemption import Preempted
from engine import startup_signals

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class MainRankWait:
    """How long ranks wait in `run_on_main` for rank 0, and the setting that changes it (for the error)."""

    timeout: datetime.timedelta = datetime.timedelta(hours=24)
    setting: str = ""


_main_rank_wait = MainRankWait()
# how long a rank that failed before the process group formed waits for the others to join it (they learn of its
# failure in their first collective): long enough for nodes that start minutes apart
START_FAILURE_WAIT = datetime.timedelta(minutes=5)
# how long it waits before it says so (`tell_the_others_at_start`): ranks that all failed alike meet within moments
# and print their error once, with no such line
START_FAILURE_QUIET = datetime.timedelta(seconds=10)
# how long a rank that failed in `process_group` waits for rank 0's error (the others) or for the others to read it
# (rank 0), so that an error every rank met is printed once (`said_by_rank_0`)
SAME_ERROR_WAIT = datetime.timedelta(seconds=10)
_wait_group = None  # the gloo group of run_on_main, made on its first use (every rank calls it in step)
_groups_entered = 0  # process_group bodies entered with other ranks: names each one's error keys in the store
# the process_group body is past the work every rank runs alike (`ranks_apart`): an error of one rank is its own
_apart = False


class OtherRankError(RuntimeError):
    """Raised on the ranks that waited in `run_on_main` when rank 0's work failed or never arrived."""


def init_distributed(device: str = "auto", main_rank_wait: Optional[MainRankWait] = None,
                     timeout: Optional[datetime.timedelta] = None) -> DistInfo:
    """Join the process group torchrun describes (if any) and pick this process's device.

    main_rank_wait: how long the other ranks wait for work that `run_on_main` gives rank 0 alone
    (default 24 hours). timeout: the group's, for the rendezvous and each collective (default torch's: 30 minutes
    with gloo, 10 with NCCL)."""
    global _main_rank_wait
    _main_rank_wait = main_rank_wait or MainRankWait()
    if device == "cuda" and not torch.cuda.is_available():
        error = ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
        if launched_world_size() > 1 and not dist.is_initialized():
            # a node without a GPU among nodes with one: the others, which would wait for this rank until their
            # timeout, learn of it in the comparison of devices and stop too (this rank with its own error)
            with contextlib.suppress(Exception):
                rank, world, _ = launcher_environment()
                _meet(rank, world, timeout or START_FAILURE_WAIT, "none", device)  # as a rank failed at start
        raise error
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    rank, world, local_rank = launcher_environment(joining=not dist.is_initialized())
    if use_cuda:
        check_local_rank_device(local_rank, torch.cuda.device_count())
    joining = world > 1 and not dist.is_initialized()
    backend = "nccl" if use_cuda else "gloo"
    store = None
    if joining:
        timeout = timeout or (dist.constants.default_pg_nccl_timeout if use_cuda else dist.constants.default_pg_timeout)
        store = _meet(rank, world, timeout, "cuda" if use_cuda else "cpu", device)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if joining:
        # the store as init_process_group makes it from env:// itself (its keys under the same prefix)
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world,
                                device_id=dev if use_cuda else None, timeout=timeout)
    return DistInfo(rank, world, local_rank, dev)


_joins = 0  # process groups this process joined through init_distributed: names each one's keys in the store


def _meet(rank: int, world: int, timeout: datetime.timedelta, device_type: str, setting: str):
    """torch's own rendezvous (env://, torchrun's agent store included) and its store, made before the process group
    so that the ranks compare the device each resolved before any forms a backend on it
    (`same_device_type_on_every_rank`): a rank on NCCL and one on gloo wait for each other until the timeout
    (train.device=auto on a node without a visible GPU beside nodes with one)."""
    store = next(dist.rendezvous("env://", rank, world, timeout=timeout))[0]
    store.set_timeout(timeout)
    same_device_type_on_every_rank(store, rank, world, device_type, setting)
    return store


def same_device_type_on_every_rank(store, rank: int, world: int, device_type: str, setting: str) -> None:
    """Refuse, on every rank alike (ConfigError, one line), ranks whose devices are of different types (`device_type`,
    "cuda" or "cpu", as each rank resolved train.device=`setting`; "none": train.device=cuda where no GPU is
    visible): their backends (NCCL, gloo) cannot form one group, and each would wait for the others until the
    group's timeout. Compared through the rendezvous `store`
    before the group forms; rank 0 (whose process holds the store outside torchrun) leaves only once the others have
    read what it needs, or SAME_ERROR_WAIT has passed."""
    global _joins
    _joins += 1
    key = f"engine.distributed/join{_joins}/device"
    store.set(f"{key}/{rank}", device_type)
    names = [f"{key}/{other}" for other in range(world)]
    store.wait(names)
    types = [store.get(name).decode("utf-8", "replace") for name in names]
    if len(set(types)) == 1:
        return
    store.set(f"{key}/read/{rank}", "1")
    if rank == 0:
        with contextlib.suppress(Exception):  # a rank gone meanwhile: it read already, or never will
            store.wait([f"{key}/read/{other}" for other in range(1, world)], SAME_ERROR_WAIT)

    def ranks(kind: str) -> str:
        listed = [str(r) for r, t in enumerate(types) if t == kind]
        return f"rank{'s' if len(listed) > 1 else ''} {', '.join(listed[:8])}{', ...' if len(listed) > 8 else ''}"

    named = {"none": "no visible GPU"}  # a rank of train.device=cuda that sees none (init_distributed)
    chosen = "; ".join(f"{named.get(kind, kind)} on {ranks(kind)}" for kind in sorted(set(types)))
    why = (" (auto takes cuda where a GPU is visible: some nodes show none)" if setting == "auto"
           else " (some nodes show no GPU)" if "none" in types
           else " (the nodes' configs or command lines name other devices)")
    raise ConfigError(f"train.device={setting} gives the ranks different devices, {chosen}{why}, and NCCL and gloo "
                      f"cannot form one group: show every node a GPU, or set train.device=cpu (or cuda) on every node")


def check_local_rank_device(local_rank: int, devices: int) -> None:
    """Refuse a LOCAL_RANK that names no CUDA device this process sees (`devices`): torch.cuda.set_device ends in a
    traceback ("invalid device ordinal") there, e.g. under `torchrun --nproc_per_node=2` where CUDA_VISIBLE_DEVICES
    (or the scheduler's binding) shows each node's processes one GPU."""
    if local_rank < devices:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    raise ConfigError(f"LOCAL_RANK={local_rank} names no CUDA device: this process sees {devices}{shown}; start at "
                      f"most {devices} process(es) per node (torchrun --nproc_per_node={devices}), or show every "
                      f"process of the node all its GPUs (CUDA_VISIBLE_DEVICES)")


def launch_fix(*names: str) -> str:
    """The advice of a launcher variable refused: torchrun, or none of WORLD_SIZE (and `names`) at all."""
    return f"start multi-process runs with torchrun (or unset {' and '.join(('WORLD_SIZE',) + names)})"


def whole_number(text: str) -> Optional[int]:
    """`text` as a whole number 0, 1, ... (digits 0-9 only, spaces around them aside), or None."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def launcher_environment(joining: bool = True) -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as torchrun sets them, (0, 1, 0) where unset; refused (ConfigError, one line
    naming the variable) where they are no whole numbers or describe no process group this process can join: a
    rank outside the world (RANK=3 alone would be a single process that is not the main rank, writing nothing), or,
    `joining` a group of several processes, no RANK, MASTER_ADDR and MASTER_PORT of torchrun's rendezvous (torch's
    env:// ends in a ValueError traceback without them; a group already formed needs none), or no LOCAL_RANK, which
    picks each process's GPU on its node (every process took cuda:0 without it)."""
    def number(name: str, default: int, least: int) -> int:
        text = os.environ.get(name)
        if text is None:
            return default
        value = whole_number(text)
        if value is None or value < least:
            what = "a number of processes" if name == "WORLD_SIZE" else "a process's number (0, 1, ...)"
            raise ConfigError(f"{name}={text!r} is not {what}: "
                              f"{launch_fix() if name == 'WORLD_SIZE' else launch_fix(name)}")
        return value

    world = number("WORLD_SIZE", 1, least=1)
    rank, local_rank = number("RANK", 0, least=0), number("LOCAL_RANK", 0, least=0)
    if rank >= world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world}: {launch_fix('RANK')}")
    if world > 1 and joining:
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            names = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
            raise ConfigError(f"WORLD_SIZE={world} but {names} {'is' if len(missing) == 1 else 'are'} not set "
                              f"(torchrun sets {'it' if len(missing) == 1 else 'them'}): {launch_fix()}")
        port = whole_number(os.environ["MASTER_PORT"])
        if port is None or not 0 < port < 65536:
            raise ConfigError(f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number (1..65535): "
                              f"{launch_fix()}")
        if os.environ.get("LOCAL_RANK") is None:
            # LOCAL_RANK picks the process's GPU (init_distributed): without it every process of a node took cuda:0
            # (a job script that exports RANK and WORLD_SIZE only), sharing one GPU and leaving the others idle
            raise ConfigError(f"WORLD_SIZE={world} but LOCAL_RANK is not set (torchrun sets it; it picks each "
                              f"process's GPU on its node, and without it every process would take cuda:0): launch "
                              f"with torchrun, or export LOCAL_RANK (the process's number on its node, e.g. "
                              f"srun's SLURM_LOCALID) with the others")
    return rank, world, local_rank


def check_main_rank_wait_read(named: str) -> None:
    """Refuse a main-rank wait that the user gave (`named` as given: evaluate.py's quant.main_rank_wait_hours=N,
    evaluate_detection.py's --main-rank-wait-hours) to one process: `run_on_main` calls the work directly there and
    no rank waits, so it would change nothing. Under torchrun (WORLD_SIZE > 1) it is taken."""
    if launcher_environment(joining=False)[1] == 1:
        raise ConfigError(f"{named} would be ignored: it is how long the other ranks of an evaluation under torchrun "
                          f"wait for rank 0 (which quantizes alone), and this is one process (WORLD_SIZE unset or "
                          f"1); drop it, or start the evaluation with torchrun")


@contextlib.contextmanager
def process_group(device: str = "auto", main_rank_wait: Optional[MainRankWait] = None,
                  failed_at_start: Optional[BaseException] = None) -> Iterator[DistInfo]:
    """`init_distributed` for the body of an entry point, and `cleanup_distributed` when it ends: after every
    rank is done when it succeeds or stops on an agreed stop request (`Preempted`), at once when it raises
    anything else (another rank may never arrive).

    With several ranks, its first collective asks whether a rank failed before the group formed
    (`failed_at_start`, given by `fail_on_every_rank_at_start`): that rank raises its error, the others an
    OtherRankError, instead of waiting in the next collective for a rank that is gone.

    An error that ends the body on several ranks is compared with rank 0's as they leave the group
    (`said_by_rank_0`), so that the entry points print it once, not once per rank (`say_once`); after `ranks_apart`
    only one raised on every rank in step, a rank's own error being printed at once."""
    global _groups_entered, _apart
    _apart = False
    info = init_distributed(device, main_rank_wait, START_FAILURE_WAIT if failed_at_start is not None else None)
    try:
        if info.distributed:
            _groups_entered += 1
            raise_on_every_rank(failed_at_start, info.device, lambda: OtherRankError(
                f"rank {info.rank}: another rank failed before the ranks met (reading its node's --config files, "
                f"--checkpoint or data, or checking its settings); its output says why"))
        elif failed_at_start is not None:
            raise failed_at_start
        yield info
    except Preempted:  # every rank stopped at the same agreed update: they all arrive, as after a finished run
        cleanup_distributed()
        raise
    except BaseException as e:
        # the group's store outlives the group where it is held: the comparison needs no other rank in the group
        store = _default_store() if info.distributed and isinstance(e, Exception) else None
        cleanup_distributed(wait_for_all=False)
        if store is not None:
            # once the ranks went apart only an error raised on every rank in step waits for rank 0's: one that this
            # rank met alone is its own, and rank 0 may sit in a collective until this process exits
            _compare_with_rank_0(e, store, info.rank, info.world_size, wait=not _apart or getattr(e, "in_step", False))
        raise
    cleanup_distributed()


def ranks_apart() -> None:
    """Mark the end of the work every rank of `process_group`'s body runs alike (train.py: the start-up checks,
    before the first update). An error met after it waits for rank 0's only where every rank raised it in step
    (`raise_on_every_rank`, `run_on_main`); any other (one rank's own failure mid-epoch) is compared with what rank
    0 has left in the store by then, and otherwise printed at once, since rank 0 may sit in a collective until this
    process exits, writing no error."""
    global _apart
    _apart = True


def said_by_rank_0(error: BaseException) -> bool:
    """Whether rank 0 prints `error` for this rank: rank 0 failed with the same error (its type and text), or
    `error` only says that another rank failed (an `OtherRankError` of `raise_where_failed` or `run_on_main`) and
    rank 0 failed too, saying so or saying why. Under torchrun an error that every rank met (a user error in the
    settings all of them read) is then one line, not one per rank, and a rank's own other error still its own."""
    return getattr(error, "said_by_rank_0", False)


def say_once(error: BaseException, say: Callable[[], None]) -> None:
    """`say()` (an entry point's `error:` line of `error`) unless rank 0 says it for this rank (`said_by_rank_0`), in
    step with the ranks that compared `error` with rank 0's when they left the process group: none goes on (to its
    exit) before rank 0 and they have said theirs, each waiting at most SAME_ERROR_WAIT in all. torchrun ends the
    other ranks as soon as one has exited: a rank that left first would otherwise cut the line of a rank still
    about to print it; and outside torchrun rank 0's process holds the store the others read rank 0's error from."""
    if not said_by_rank_0(error):
        say()
    exchange = getattr(error, "_compared_with_rank_0", None)
    if exchange is None:
        return
    store, key, rank, world, waited = exchange
    deadline = time.monotonic() + SAME_ERROR_WAIT.total_seconds()
    with contextlib.suppress(Exception):  # a rank that did not fail (in time), or a store that is gone: exit now
        if rank == 0:
            store.set(f"{key}/said/0", "1")
            read = [f"{key}/read/{other}" for other in range(1, world)]
            # a rank that did not fail reads nothing; where the ranks went apart (`ranks_apart`) the others may
            # sit in a collective until this process exits: only those that read already are waited for below
            with contextlib.suppress(Exception):
                if waited:
                    store.wait(read, datetime.timedelta(seconds=max(0.0, deadline - time.monotonic())))
            readers = [other for other, name in enumerate(read, 1) if store.check([name])]
            store.wait([f"{key}/said/{other}" for other in readers],
                       datetime.timedelta(seconds=max(0.0, deadline - time.monotonic())))
        else:
            store.set(f"{key}/said/{rank}", "1")
            store.wait([f"{key}/said/0"], SAME_ERROR_WAIT)


def _default_store():
    """The process group's key-value store (torchrun's agent's, or rank 0's outside torchrun), or None."""
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - torch's private accessor: without it, every rank prints its own line
        return None


def _compare_with_rank_0(error: Exception, store, rank: int, world: int, wait: bool = True) -> None:
    """`said_by_rank_0`'s record, made through the group's `store` once this rank has left the group, and kept for
    `say_once`: rank 0 leaves its error's text there, another rank waits for it at most SAME_ERROR_WAIT where `wait`
    (an error of the work every rank runs alike, or one raised on every rank in step: `ranks_apart`), else reads
    it only where it is there already. A rank that cannot compare (rank 0 failed later or not at all, or is gone)
    marks nothing: it prints its own line, as every rank did before."""
    key = f"engine.distributed/{_groups_entered}/error"
    text = f"{type(error).__name__}: {error}"
    try:
        if rank == 0:
            store.set(key, text)
        elif wait:
            store.wait([key], SAME_ERROR_WAIT)
        elif not store.check([key]):
            return  # rank 0 has not failed (yet): this rank's line stands, said at once
        if rank != 0:
            said = store.get(key).decode("utf-8", "replace")
            store.set(f"{key}/read/{rank}", "1")
            if said == text or getattr(error, "elsewhere", False):
                error.said_by_rank_0 = True
    except Exception:  # noqa: BLE001 - no comparison (a timeout, a store that is gone): this rank's line stands
        return
    error._compared_with_rank_0 = (store, key, rank, world, wait)


def _elsewhere(error: BaseException) -> BaseException:
    """`error`, marked as the news that another rank failed, which that rank reports itself (`said_by_rank_0`)."""
    error.elsewhere = error.in_step = True  # raised where another rank failed, in step with it
    return error


def launched_world_size(variable: str = "WORLD_SIZE") -> int:
    """The number of processes the launcher started, as `variable` gives it (torchrun's WORLD_SIZE, srun's
    SLURM_NTASKS / SLURM_STEP_NUM_TASKS); 1 where it is unset or not a number (read on error paths and in warnings,
    which must not fail on it)."""
    value = os.environ.get(variable, "1")
    return int(value) if value.isdigit() else 1


def fail_on_every_rank_at_start(error: BaseException, device: str = "auto") -> NoReturn:
    """Raise `error`, met before the process group formed: under torchrun, after joining the group, so that the
    other ranks (in `process_group`'s first collective) stop with this rank instead of waiting at the rendezvous
    or in their first collective until a timeout, the fate of the others when one node lacks a --config file or
    the --checkpoint that every rank reads before the group forms (`tell_the_others_at_start` says how).

    device: the process group's device as the other ranks resolved it (train.device of the config, or of the
    command line where this rank could not read its config files)."""
    def join_and_tell() -> None:  # process_group's first collective raises `error` once the others know
        with process_group(device, failed_at_start=error):
            pass

    tell_the_others_at_start(error, join_and_tell, os.environ.get("RANK", "0"), launched_world_size())


def tell_the_others_at_start(error: BaseException, join_and_tell: Callable[[], None], rank: str,
                             world: int) -> NoReturn:
    """Raise `error`, met before the ranks met, on this rank of `world`; with others, after `join_and_tell()` has
    joined their group and told them in their first collective (engine/distributed.py's process group, or
    MMEngine's in scripts/train_detection.py).

    Ranks that all failed alike meet within moments and print their error once (process_group's
    `said_by_rank_0`). Where the others are slow to come, this rank says that it waits (a line on stderr that gives
    its error) after START_FAILURE_QUIET; a SIGTERM while it waits ends it at once, with that line first where it
    was not said yet (not kept as a stop request by train.py's start-up recorder; torch's wait runs no Python
    handler: `_said_while_waiting`), and one received before skips the wait. It waits for the others to join at
    most START_FAILURE_WAIT (a rank that failed before joining, or a node of another code version, never comes;
    torch's store client may retry once more, up to about twice that); then, or when it cannot join at all, it
    raises its own error, and the others wait for their own timeout."""
    if world > 1:
        if startup_signals.is_recorder(signal.getsignal(signal.SIGTERM)) and startup_signals.RECEIVED:
            raise error  # asked to stop already (the job ends): nobody to wait for
        line = (f"rank {rank} failed before the ranks met; telling the others (waiting at most "
                f"{START_FAILURE_WAIT.total_seconds():g} s for them to join): {error}")
        with _said_while_waiting(line, error):
            # `error` raised there once the others know; suppressed too: this rank's cause, not the rendezvous's
            # complaint where it cannot join
            with contextlib.suppress(Exception):
                join_and_tell()
    raise error


@contextlib.contextmanager
def _said_while_waiting(line: str, error: BaseException) -> Iterator[None]:
    """While the body waits for the other ranks: `line` on stderr once it has waited START_FAILURE_QUIET, and a
    SIGTERM ends the process at once (exit status 143, as the signal's default action reports), `line` first
    unless it was said or rank 0 says `error` (`said_by_rank_0`). torch's waits (the rendezvous, a collective) run no
    Python handler until they return, but let other threads run: a thread watches the pipe that Python's C-level
    handler writes each signal's number to (signal.set_wakeup_fd) while a handler of this function's is set. That
    is done where SIGTERM would end the process (its default action, or train.py's start-up recorder, which would
    keep it as a stop request for a run that never starts), from the main thread (the only one that may set
    handlers); another handler is left as it is."""
    previous = signal.getsignal(signal.SIGTERM)
    watch_sigterm = (threading.current_thread() is threading.main_thread()
                     and (previous == signal.SIG_DFL or startup_signals.is_recorder(previous)))
    lock, said = threading.Lock(), []

    def say() -> None:
        with lock:
            if not said and not said_by_rank_0(error):
                console_print(line, sys.stderr)
            said.append(True)

    def end(signum: int = signal.SIGTERM, frame: object = None) -> NoReturn:
        say()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)

    done_read, done_write = os.pipe()
    signals_read = signals_write = previous_fd = None
    if watch_sigterm:
        signals_read, signals_write = os.pipe()
        os.set_blocking(signals_write, False)  # set_wakeup_fd's requirement: a full pipe must not block a handler
        previous_fd = signal.set_wakeup_fd(signals_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, end)  # runs itself only where the wait returned before the watcher saw it

    def watch() -> None:
        readable = [done_read] + ([signals_read] if watch_sigterm else [])
        quiet_until = time.monotonic() + START_FAILURE_QUIET.total_seconds()
        while True:
            ready = select.select(readable, [], [], None if said else max(0.0, quiet_until - time.monotonic()))[0]
            if done_read in ready:
                return
            if not ready:
                say()
            elif int(signal.SIGTERM) in os.read(signals_read, 64):  # other signals (SIGINT) keep their handlers
                end()

    watcher = threading.Thread(target=watch, name="tell_the_others_at_start", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.write(done_write, b"x")
        watcher.join()
        if watch_sigterm:
            signal.signal(signal.SIGTERM, previous)
            signal.set_wakeup_fd(previous_fd)
        for fd in (done_read, done_write, signals_read, signals_write):
            if fd is not None:
                os.close(fd)


def cleanup_distributed(wait_for_all: bool = True) -> None:
    """Leave the process group. `wait_for_all`: first wait until every rank is done (a rank that tears its
    group down while another still talks to it can abort the process at exit: "terminate called without
    an active exception" with gloo); False on error paths, where another rank may never arrive. The
    group's threads end here unless something still alive holds the group (a DDP wrapper the caller keeps,
    or one in a reference cycle: engine/loop.py's TrainLoop avoids the cycle it made)."""
    global _wait_group
    if dist.is_initialized():
        if wait_for_all:
            barrier()
        dist.destroy_process_group()  # every group, the wait group included
    _wait_group = None


def world_size() -> int:
    """The number of ranks of the process group; 1 without one."""
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce ("sum" or "max") when a process group exists; identity otherwise."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if op not in ops:  # checked in one process too: a "min" or "mean" must not become a MAX on a cluster only
        raise ValueError(f"all_reduce op must be one of {sorted(ops)}, got {op!r}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=ops[op])
    return tensor


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def raise_on_every_rank(error: Optional[BaseException], device: torch.device,
                        elsewhere: Callable[[], BaseException]) -> None:
    """After work that only some ranks did (e.g. rank 0 writing a checkpoint): if it failed anywhere, every
    rank raises (the failing rank its own `error`, the others `elsewhere()`), instead of the others waiting
    at the next collective until it times out. One all-reduce; a no-op without a process group. A rank with its
    own error raises it also when the all-reduce itself fails (another rank's process has ended meanwhile): the
    cause, not the lost connection."""
    try:
        failed = all_reduce(torch.tensor([float(error is not None)], device=device), op="max")
    except Exception:  # noqa: BLE001 - the collective's error stands only where this rank has none of its own
        if error is not None:
            raise error from None
        raise
    raise_where_failed(error, bool(failed.item()), elsewhere)


@contextlib.contextmanager
def failure_on_every_rank(device: torch.device, what: str) -> Iterator[None]:
    """Work every rank does on its own (reading its node's files) before a collective: an exception in it is raised
    on that rank and an OtherRankError ("rank R: another rank failed <what>; its output says why") on the others,
    after one all-reduce, instead of the others entering the next collective without it (gloo: a traceback when
    its process ends; NCCL: a wait until the watchdog or torchrun ends them). Names the body assigns exist after the
    block on the ranks where it succeeded, which are the only ones that go on. In one process the body's error
    passes as it is, with no collective and nothing made on the device (which may be what failed: a CUDA error)."""
    if world_size() == 1:
        yield
        return
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        error = e
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise_on_every_rank(error, device, lambda: OtherRankError(f"rank {rank}: another rank failed {what}; its "
                                                              f"output says why"))


def raise_where_failed(error: Optional[BaseException], failed_anywhere: bool,
                       elsewhere: Callable[[], BaseException]) -> None:
    """The end of `raise_on_every_rank` for a flag carried in a collective the caller makes anyway (a window's
    sums): this rank's `error`, else `elsewhere()` when `failed_anywhere` (the reduced flag), else nothing."""
    if error is not None:
        with contextlib.suppress(AttributeError):  # an exception type without attributes: compared as any other
            error.in_step = True  # every rank raises now: process_group may wait for rank 0's error
        raise error
    if failed_anywhere:
        raise _elsewhere(elsewhere())


def runs_on_main() -> bool:
    """Whether this process runs what `run_on_main` runs: rank 0, or the only process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def run_on_main(fn: Callable[[], T], what: str, device: torch.device) -> T:
    """Run `fn` on rank 0 only and return its result on every rank (just `fn()` without a process group).

    The other ranks wait in a gloo group whose timeout is `MainRankWait.timeout` (default 24 hours, for
    e.g. APHQ's reconstruction), so no NCCL watchdog fires while rank 0 works alone. The result (a
    quantized model, a report, None) travels pickled (torch.save); what rank 0 held on its GPU arrives on
    each rank's `device`, CPU tensors stay on the CPU. If `fn` raises on rank 0, rank 0 raises its own
    error and every other rank raises OtherRankError with its text; so does a rank that gave up waiting,
    lost rank 0, or got the result of other work (the ranks' calls must come in the same order).

    what: the work, for messages ("quantizing aphq w4a4", "writing results.json"); it also labels the
    message, so that a rank waiting for other work than rank 0 did fails instead of taking a wrong result.

    Short main-rank work inside training (a checkpoint write) uses `raise_on_every_rank` instead: one
    all-reduce on the default group, no second (gloo) group for a run that does not need a long wait.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return fn()
    # made now, on every rank (new_group is collective), but looked up where used, never held in a local: a
    # traceback through this frame (an error on the way to process_group's cleanup) or garbage holding it (a
    # cycle in a callee's frames, e.g. pyparsing's under matplotlib, keeps its callers' frames) would keep
    # the gloo group's threads running after destroy_process_group
    _main_rank_group()
    if dist.get_rank() == 0:
        try:
            result = fn()
            message = _serialize(("ok", what, result))
        except BaseException as e:
            # logged first: if the others are gone, the send below can block until the wait limit
            log.error("%s failed on rank 0: %s: %s", what, type(e).__name__, e)
            try:  # the others learn why before this rank's error ends it
                _send(_serialize(("error", what, f"{type(e).__name__}: {e}")), _main_rank_group())
            except Exception as send_error:  # they may be gone already; keep the first error
                log.warning("could not tell the other ranks that %s failed: %s", what, send_error)
            raise
        _send(message, _main_rank_group())
        return result
    rank = dist.get_rank()
    try:
        message, failure = _receive(_main_rank_group()), None
    except RuntimeError as e:
        message, failure = None, str(e)
    # raised here, not in the except clause: the caught error (its __context__ there) would keep the frames of
    # _receive and broadcast, and with them the group, alive through process_group's cleanup
    if failure is not None:
        if "timed out" in failure.lower():
            limit = _main_rank_wait
            change = f"; raise {limit.setting} if rank 0 is still working" if limit.setting else ""
            raise OtherRankError(f"rank {rank} waited {limit.timeout} for rank 0 to finish {what} and gave "
                                 f"up{change}")
        raise OtherRankError(f"rank {rank} lost rank 0 while it was {what} ({failure}); rank 0's output says why")
    try:
        status, sent_for, value = torch.load(io.BytesIO(message), map_location=onto(device), weights_only=False)
    except Exception as e:  # e.g. out of memory on this rank's GPU: not rank 0's fault, say so
        raise OtherRankError(f"rank {rank} could not load rank 0's result of {what}: {type(e).__name__}: {e}"
                             ) from e
    if sent_for != what:  # the ranks took different paths through the program: stop before they deadlock
        raise OtherRankError(f"rank {rank} waited for rank 0 to finish {what}, but rank 0 sent the result of "
                             f"{sent_for}: the ranks disagree on the work (each must take the same steps)")
    if status == "error":
        raise _elsewhere(OtherRankError(f"rank 0 failed {what}: {value}"))
    return value


def onto(device: torch.device) -> Callable[[Any, str], Any]:
    """torch.load's map_location for a result of rank 0: what rank 0 held on a GPU comes to this rank's
    `device`; what it held on the CPU (calibration statistics, a report) stays on the CPU."""
    def place(storage, location: str):
        if location.startswith("cuda"):
            return torch.serialization.default_restore_location(storage, str(device))
        return storage
    return place


def _main_rank_group():
    global _wait_group
    if _wait_group is None:
        _wait_group = dist.new_group(backend="gloo", timeout=_main_rank_wait.timeout)
    return _wait_group


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _send(message: bytes, group) -> None:
    """Rank 0: the length, then the bytes (CPU tensors: the group is gloo whatever the device)."""
    dist.broadcast(torch.tensor([len(message)], dtype=torch.int64, device="cpu"), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), src=0, group=group)


def _receive(group) -> bytes:
    """The other ranks: block (up to the group's timeout) until rank 0 sends, then read its bytes."""
    size = torch.zeros(1, dtype=torch.int64, device="cpu")
    dist.broadcast(size, src=0, group=group)
    message = torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
    dist.broadcast(message, src=0, group=group)
    return message.numpy().tobytes()
