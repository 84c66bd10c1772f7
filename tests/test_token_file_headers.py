"""Token files with a header before their ids. llm.c's (and modded-nanogpt's fineweb10B shards, written by the same
code) begin with 256 int32 values (magic 20240520, version 1 for uint16 ids or 2 for uint32 ids, the token count).
Read as uint16 ids, that header trained as 512 ids (56920, 308, ...), whose 56920 made the vocabulary check advise
model.num_classes=56921; version 2's uint32 ids trained as their halves. A NumPy .npy file (np.save into val.bin)
trained its header as ids, and int64 ids as their parts. Such a file is refused naming its header, and the fix given
reads back as the ids written."""
import re

import numpy as np
import pytest

from configs.schema import DataConfig
from data import DataError
from data.text import token_stream


def _llmc_file(path, ids: np.ndarray, version: int) -> None:
    """What llm.c's dev/data/data_common.py write_datafile writes: the header, then the ids as uint16 (version 1,
    GPT-2) or uint32 (version 2, Llama 3)."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, version, len(ids)
    path.write_bytes(header.tobytes() + ids.astype(np.uint16 if version == 1 else np.uint32).tobytes())


def _gpt2_ids(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.minimum(rng.zipf(1.2, n), 50_256)


def test_an_llmc_gpt2_file_is_refused_naming_its_header_and_the_fix_reads_back_its_ids(tmp_path):
    ids = _gpt2_ids(5_000)
    path = tmp_path / "val.bin"
    _llmc_file(path, ids, 1)
    cfg = DataConfig(dataset="tokens", root=str(tmp_path))
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: it begins with llm\.c's header \(256 int32: "
                                        r"magic 20240520, version 1, 5,000 uint16 ids\).*np\.fromfile\(path, "
                                        r"dtype=np\.uint16, offset=1024\)\.tofile\(\.\.\.\)"):
        token_stream(cfg, "val")
    # the fix: the ids after the header, as a headerless file of uint16 ids
    np.fromfile(path, dtype=np.uint16, offset=1024).tofile(path)
    np.testing.assert_array_equal(np.asarray(token_stream(cfg, "val").ids), ids)


def test_an_llmc_file_of_uint32_ids_is_refused_as_ids_no_uint16_file_holds(tmp_path):
    """Version 2: Llama 3's ids (128,256 of them) are uint32; read as uint16 its halves were ids."""
    ids = np.random.default_rng(1).integers(0, 128_256, 5_000)
    _llmc_file(tmp_path / "val.bin", ids, 2)
    with pytest.raises(DataError, match=r"version 2, 5,000 uint32 ids\).*do not fit uint16 token files"):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


def test_uint16_ids_that_begin_as_no_header_are_read_as_written(tmp_path):
    """The magic's halves as the first two ids of a headerless file, but no version after them: ids, not a header."""
    ids = np.concatenate([[20240520 & 0xFFFF, 20240520 >> 16, 7, 0], _gpt2_ids(5_000)])
    (tmp_path / "val.bin").write_bytes(ids.astype(np.uint16).tobytes())
    stream = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    np.testing.assert_array_equal(np.asarray(stream.ids), ids)


@pytest.mark.parametrize("dtype", ["<u2", "<i8"])
def test_a_numpy_npy_file_is_refused_naming_its_header_and_the_fix_reads_back_its_ids(tmp_path, dtype):
    """np.save into a file named val.bin: a .npy header (magic \\x93NUMPY, the dtype and shape), then the ids; read
    as uint16 ids from its first byte, the header trained as 64 ids."""
    ids = _gpt2_ids(5_000)
    path = tmp_path / "val.bin"
    with open(path, "wb") as f:
        np.save(f, ids.astype(dtype))
    cfg = DataConfig(dataset="tokens", root=str(tmp_path))
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: it is a NumPy \.npy file \(np\.save: a header, "
                                        rf"then {np.dtype(dtype)} ids of shape \(5000,\)\).*np\.load\(path\)\.astype"
                                        r"\(np\.uint16\)\.tofile\(\.\.\.\)"):
        token_stream(cfg, "val")
    np.load(path).astype(np.uint16).tofile(path)
    np.testing.assert_array_equal(np.asarray(token_stream(cfg, "val").ids), ids)
