"""nanoGPT's prepare.py sizes a token file before it writes it (np.memmap(mode='w+')) and fills it shard by shard: a
run stopped before its end leaves a file of its full size ending in zeros, which trained as that many of id 0. Such a
file is refused; a file that ends in a few zero ids is read as written."""
import re

import numpy as np
import pytest

from configs.schema import DataConfig
from data import DataError
from data.text import token_stream


def _gpt2_ids(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.minimum(rng.zipf(1.2, n), 50_256)


def test_a_token_file_whose_writing_stopped_before_its_end_is_refused(tmp_path):
    """nanoGPT's prepare.py sizes train.bin first (np.memmap(mode='w+', shape=(arr_len,))) and fills it shard by shard:
    stopped after 60 of 100 shards, the file has its full size and ends in zeros, which trained as 40 % of the text
    (GPT-2's id 0, '!')."""
    ids, path = _gpt2_ids(200_000), tmp_path / "train.bin"
    arr, idx = np.memmap(path, dtype=np.uint16, mode="w+", shape=(len(ids),)), 0
    for shard in np.array_split(ids, 100)[:60]:  # as prepare.py writes, until it is stopped
        arr[idx:idx + len(shard)] = shard
        idx += len(shard)
    arr.flush()
    del arr
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: its last 65,536 of 200,000 ids are all 0, as in "
                                        r"a token file whose writing stopped before its end"):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "train")


def test_a_token_file_that_ends_in_a_few_zero_ids_is_read_as_written(tmp_path):
    ids = np.concatenate([_gpt2_ids(100_000), np.zeros(1_000, dtype=np.int64)])
    (tmp_path / "train.bin").write_bytes(ids.astype(np.uint16).tobytes())
    stream = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "train")
    np.testing.assert_array_equal(np.asarray(stream.ids), ids)
