"""Token files (data.dataset=tokens): a memory-mapped file travels to a DataLoader worker started by spawn or
forkserver (macOS's default, Linux's from Python 3.14) as its name, not as a copy of every id, and gives that worker
the batches the main process reads; a file of float16 ids is refused, never trained on as the bits of floats."""
import multiprocessing
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from configs import load_config
from data import DataError
from data.loader import build_token_loaders
from data.text import TokenWindows, token_stream
from tests.conftest import DEBUG_CONFIG

IDS = 200_000  # 400 kB of uint16 ids


def token_config(root):
    return load_config([DEBUG_CONFIG], ["data.dataset=tokens", f"data.root={root}", "data.num_workers=0"]).data


def write_files(root, train, val):
    train.tofile(root / "train.bin")
    val.tofile(root / "val.bin")


def random_files(root):
    rng = np.random.default_rng(0)
    write_files(root, rng.integers(0, 50_000, IDS).astype(np.uint16), rng.integers(0, 50_000, 5_000).astype(np.uint16))


def test_a_token_file_s_windows_pickle_as_its_name_and_read_the_file_again(tmp_path):
    random_files(tmp_path)
    windows = TokenWindows(token_stream(token_config(tmp_path), "train"), 64, train=False)
    sent = pickle.dumps(windows)
    assert len(sent) < (tmp_path / "train.bin").stat().st_size // 100  # not a copy of the 400 kB of ids
    received = pickle.loads(sent)
    expected = np.fromfile(tmp_path / "train.bin", dtype="<u2").astype(np.int64)  # the file, read independently
    assert len(received) == len(windows)
    for i in (0, 7, len(windows) - 1):
        x, y = received[i]
        assert torch.equal(x, torch.from_numpy(expected[i * 64:i * 64 + 64]))
        assert torch.equal(y, torch.from_numpy(expected[i * 64 + 1:i * 64 + 65]))


def test_a_token_file_that_changed_length_before_a_worker_maps_it_is_refused(tmp_path):
    random_files(tmp_path)
    sent = pickle.dumps(TokenWindows(token_stream(token_config(tmp_path), "train"), 64, train=True))
    np.zeros(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match=rf"train.bin changed while it was read: {IDS} ids at the start, 10 now"):
        pickle.loads(sent)


@pytest.mark.slow  # a spawned worker imports torch: 15 s
def test_a_spawned_worker_gives_the_batches_of_the_main_process(tmp_path):
    """The training loader's data set and sampler, read by one worker started by spawn, against num_workers=0."""
    random_files(tmp_path)
    train = build_token_loaders(token_config(tmp_path), context=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8,
                                rank=0, world_size=1, seed=3, vocab_size=50_304).train
    train.sampler.set_epoch(1)
    dataset, sampler = train.loader.dataset, train.loader.sampler

    def batches(**workers):
        loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True, **workers)
        return [batch for batch, _ in zip(loader, range(3))]

    here = batches(num_workers=0)
    there = batches(num_workers=1, multiprocessing_context=multiprocessing.get_context("spawn"))
    assert len(here) == len(there) == 3
    for (x, y), (x2, y2) in zip(here, there):
        assert torch.equal(x, x2) and torch.equal(y, y2)


# -- float16 ids -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [60, 50_257])
def test_a_file_of_float16_ids_is_refused(tmp_path, vocab):
    ids = np.random.default_rng(0).integers(0, vocab, 20_000)
    write_files(tmp_path, ids.astype(np.float16), ids[:3_000].astype(np.float16))
    with pytest.raises(DataError, match=r"train.bin: every uint16 value of its first 20,000 is 0 or, read as "
                                        r"float16, a whole number .* a file of float16 token ids"):
        token_stream(token_config(tmp_path), "train")


def test_float32_ids_are_still_named_float32(tmp_path):
    ids = np.random.default_rng(0).integers(0, 60, 20_000)
    write_files(tmp_path, ids.astype(np.float32), ids[:3_000].astype(np.float32))
    with pytest.raises(DataError, match=r"as in a file of float32 \(or float64\) token ids"):
        token_stream(token_config(tmp_path), "train")


@pytest.mark.parametrize("low, high", [(0, 50_257), (15_360, 31_744), (15_360, 25_600)])
def test_uint16_ids_are_not_taken_for_float16(tmp_path, low, high):
    """Real uint16 ids, even a stream of ids all in float16's band of whole numbers, are read."""
    rng = np.random.default_rng(0)
    write_files(tmp_path, rng.integers(low, high, 20_000).astype(np.uint16),
                rng.integers(low, high, 3_000).astype(np.uint16))
    assert len(token_stream(token_config(tmp_path), "train").ids) == 20_000
