"""The launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) that are no numbers or
describe no process group are one `error:` line naming the variable and the fix, exit status 1 as a config
error, before anything is made: `WORLD_SIZE=abc python train.py ...` ended in a ValueError traceback (int()),
and `WORLD_SIZE=2 python train.py ...` without torchrun in torch's MASTER_ADDR traceback. evaluate.py joins
through the same engine.distributed.init_distributed."""
import re

import pytest
import torch

import train
from configs import ConfigError
from tests.conftest import DEBUG_CONFIG, run_entry

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
FIX = "start multi-process runs with torchrun (or unset WORLD_SIZE"
FIX_RE = re.escape(FIX)


@pytest.fixture
def launched(monkeypatch):
    """Set the launcher's variables to exactly `values` (the others unset), as the test's command would run."""
    def set_to(**values: str) -> None:
        for name in LAUNCHER:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_to


REFUSED = [
    (dict(WORLD_SIZE="abc"), rf"WORLD_SIZE='abc' is not a number of processes: {FIX_RE}\)"),
    (dict(WORLD_SIZE="0"), rf"WORLD_SIZE='0' is not a number of processes: {FIX_RE}\)"),
    (dict(WORLD_SIZE="2"), rf"WORLD_SIZE=2 but RANK, MASTER_ADDR and MASTER_PORT are not set \(torchrun sets them\): "
                           rf"{FIX_RE}\)"),
    (dict(WORLD_SIZE="2", RANK="0", MASTER_PORT="29500"), rf"WORLD_SIZE=2 but MASTER_ADDR is not set "
                                                          rf"\(torchrun sets it\): {FIX_RE}\)"),
    (dict(WORLD_SIZE="2", RANK="1", MASTER_ADDR="h", MASTER_PORT="port"),
     rf"MASTER_PORT='port' is not a port number \(1..65535\): {FIX_RE}\)"),
    (dict(RANK="x"), rf"RANK='x' is not a process's number \(0, 1, ...\): {FIX_RE} and RANK\)"),
    (dict(RANK="3"), rf"RANK=3 is not below WORLD_SIZE=1: {FIX_RE} and RANK\)"),
    (dict(WORLD_SIZE="2", RANK="2", MASTER_ADDR="h", MASTER_PORT="1"), rf"RANK=2 is not below WORLD_SIZE=2: {FIX_RE} "
                                                                       rf"and RANK\)"),
    (dict(LOCAL_RANK="-1"), rf"LOCAL_RANK='-1' is not a process's number \(0, 1, ...\): {FIX_RE} and LOCAL_RANK\)"),
    (dict(WORLD_SIZE="2", RANK="1", MASTER_ADDR="h", MASTER_PORT="1"),
     r"WORLD_SIZE=2 but LOCAL_RANK is not set .*launch with torchrun, or export LOCAL_RANK .*"),
]


@pytest.mark.parametrize("env, message", REFUSED, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e, _ in REFUSED])
def test_init_distributed_refuses_what_no_process_group_can_be_made_of(launched, monkeypatch, env, message):
    """Refused before torch is asked to form a group (which would wait for a rendezvous that never comes)."""
    import torch.distributed as dist

    from engine.distributed import init_distributed

    def join(*args, **kwargs):
        raise AssertionError(f"asked torch to form a group: {kwargs}")

    monkeypatch.setattr(dist, "init_process_group", join)
    launched(**env)
    with pytest.raises(ConfigError, match=rf"^{message}$"):
        init_distributed("cpu")


def test_what_torchrun_sets_and_a_plain_process_pass(launched, monkeypatch):
    """Nothing set: one process, rank 0. torchrun's five variables: the group torch is asked to form (by hand,
    its init_process_group recorded), with RANK and WORLD_SIZE as given."""
    import torch.distributed as dist

    from engine.distributed import DistInfo, init_distributed

    launched()
    assert init_distributed("cpu") == DistInfo(0, 1, 0, torch.device("cpu"))
    from engine import distributed

    joined = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append((kw["rank"], kw["world_size"])))
    monkeypatch.setattr(distributed, "_meet", lambda *args: dist.HashStore())  # node0 is no host here
    launched(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="node0", MASTER_PORT="29500")
    assert init_distributed("cpu") == DistInfo(3, 4, 1, torch.device("cpu"))
    assert joined == [(3, 4)]


@pytest.mark.parametrize("env, line", [
    (dict(WORLD_SIZE="abc"), f"error: WORLD_SIZE='abc' is not a number of processes: {FIX})"),
    (dict(WORLD_SIZE="2"), f"error: WORLD_SIZE=2 but RANK, MASTER_ADDR and MASTER_PORT are not set (torchrun sets "
                           f"them): {FIX})")], ids=["not_a_number", "without_torchrun"])
def test_train_py_says_it_in_one_line_and_makes_nothing(tmp_path, capsys, launched, env, line):
    """The reviewer's commands: `WORLD_SIZE=abc python train.py --config configs/debug/tiny.yaml out_dir=...` and
    `WORLD_SIZE=2 python train.py ...` without torchrun."""
    launched(**env)
    out = tmp_path / "o"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out}"], capsys)
    assert (code, err.splitlines()) == (1, [line])
    assert not out.exists()


def test_evaluate_py_says_it_in_one_line(tmp_path, capsys, launched, debug_config):
    launched()
    cfg = debug_config("log.tensorboard=false")
    train.main(cfg)
    launched(WORLD_SIZE="abc")
    code, _, err = run_entry("evaluate.py", ["--checkpoint", f"{cfg.out_dir}/best.pt", "--out",
                                             str(tmp_path / "e" / "eval.json")], capsys)
    assert (code, err.splitlines()) == (1, [f"error: WORLD_SIZE='abc' is not a number of processes: {FIX})"])
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("visible", [None, "3"], ids=["all_shown", "one_shown"])
def test_a_local_rank_past_the_visible_gpus_is_one_line(tmp_path, capsys, launched, monkeypatch, visible):
    """`CUDA_VISIBLE_DEVICES=3 torchrun --nproc_per_node=2 train.py ...` (or a scheduler that binds one GPU to each
    task): rank 1's LOCAL_RANK=1 names no device its process sees, and torch.cuda.set_device(1) ended train.py in a
    RuntimeError traceback ("invalid device ordinal"). One error line naming LOCAL_RANK, before anything is made or
    any CUDA call (the machine here has no GPU: one visible device is what torch is told it sees)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"set_device({device}) was called"))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    launched(LOCAL_RANK="1")  # alone: one process, which would run on cuda:1
    out = tmp_path / "o"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out}"], capsys)
    shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES='{visible}')"
    assert (code, err.splitlines()) == (1, [
        f"error: LOCAL_RANK=1 names no CUDA device: this process sees 1{shown}; start at most 1 process(es) per node "
        f"(torchrun --nproc_per_node=1), or show every process of the node all its GPUs (CUDA_VISIBLE_DEVICES)"])
    assert not out.exists()
    launched(LOCAL_RANK="0")  # the device it names is there: taken
    from engine.distributed import init_distributed
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert init_distributed("auto").device == torch.device("cuda", 0)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_several_processes_without_local_rank_are_refused_on_every_rank(tmp_path, capsys, launched, monkeypatch,
                                                                        rank):
    """A job script that exports RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT but not LOCAL_RANK (srun or mpirun
    without torchrun) put every process of a node on cuda:0, LOCAL_RANK's default: one GPU shared, the others idle.
    Every rank refuses in one error line naming LOCAL_RANK and the fix, before any CUDA call or rendezvous (the
    machine here has no GPU: two visible devices are what torch is told it sees)."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"set_device({device}) was called"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("asked torch to form a group"))
    launched(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    out = tmp_path / "o"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out}"], capsys)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("error: WORLD_SIZE=2 but LOCAL_RANK is not set") and "export LOCAL_RANK" in err
    assert "launch with torchrun" in err
    assert not out.exists()


def _rank_on_its_node_device(rank: int, world: int, port: int, work: str, gpu_ranks: tuple,
                             device: str = "auto") -> None:
    """A rank of a two-node run under train.device=`device`: the ranks in `gpu_ranks` see two GPUs (torch is told so:
    the machine here has none; set_device is a no-op there), the others none. Its outcome: ("ok", device) or
    (exception type, text)."""
    import datetime
    import os

    from engine.distributed import init_distributed
    from tests.dist_utils import as_torchrun_rank

    as_torchrun_rank(rank, world, port)
    if rank in gpu_ranks:
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 2
        torch.cuda.set_device = lambda device: None
    try:
        outcome = ("ok", str(init_distributed(device, timeout=datetime.timedelta(seconds=20)).device))
    except BaseException as e:  # noqa: BLE001 - recorded for the test
        outcome = (type(e).__name__, str(e))
    torch.save(outcome, os.path.join(work, f"rank{rank}.pt"))
    os._exit(0)


@pytest.mark.slow
def test_ranks_that_resolve_auto_to_different_devices_are_refused_on_every_rank(tmp_path):
    """train.device=auto on a node without a visible GPU beside one with GPUs: one rank formed the group on gloo, the
    other on NCCL, and each waited for the other until the group's timeout (or NCCL's init failed on one). Both now
    refuse at once with the same error line naming train.device and the fix, before either forms a group."""
    from tests.dist_utils import free_port, spawn_within

    spawn_within(_rank_on_its_node_device, (2, free_port(), str(tmp_path), (1,)), 2, seconds=90)
    outcomes = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert outcomes[0] == outcomes[1], outcomes
    kind, text = outcomes[0]
    assert kind == "ConfigError", outcomes
    assert text.startswith("train.device=auto gives the ranks different devices, cpu on rank 0; cuda on rank 1 ")
    assert "set train.device=cpu (or cuda) on every node" in text


@pytest.mark.slow
def test_a_rank_of_train_device_cuda_without_a_gpu_stops_the_others_too(tmp_path):
    """train.device=cuda on a node that shows no GPU: that rank refused at once, and the ranks of the other nodes
    waited for it at the rendezvous until the group's timeout (30 minutes). It now stops them in the comparison of
    devices: it says its own error, they say which ranks see no GPU."""
    from tests.dist_utils import free_port, spawn_within

    spawn_within(_rank_on_its_node_device, (2, free_port(), str(tmp_path), (1,), "cuda"), 2, seconds=90)
    outcomes = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert outcomes[0] == ("ConfigError", "train.device=cuda but no CUDA device is visible; use train.device=cpu or "
                                          "auto"), outcomes
    kind, text = outcomes[1]
    assert kind == "ConfigError", outcomes
    assert text.startswith("train.device=cuda gives the ranks different devices, cuda on rank 1; no visible GPU on "
                           "rank 0 (some nodes show no GPU)")
