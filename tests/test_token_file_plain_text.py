"""data.dataset=tokens reads uint16 token ids: a plain text file given as <root>/<split>.bin (read as uint16, two
characters an id, ids up to 32382) is refused with the fix, tokenize it; real uint16 streams, character ids below
256 and byte-level BPE ids, are read as written (np.fromfile as the reference)."""
import re

import numpy as np
import pytest

import train
from configs import load_config
from configs.schema import DataConfig
from data import DataError
from data.text import _kjv, _kjv_text, token_stream

NANO = "configs/lm/kjv_nano.yaml"
REFUSED = r"its first [\d,]+ bytes are text \(UTF-8 without control bytes\), as in a plain text file, " \
          r"not uint16 token ids; tokenize the text into a file of uint16 ids \(as nanoGPT's prepare.py does"


def _even(data: bytes) -> bytes:
    return data[:len(data) // 2 * 2]


@pytest.mark.parametrize("text", ["bible", "crlf_tabs"])
def test_a_plain_text_file_as_token_ids_is_refused_naming_the_file_and_the_fix(tmp_path, text):
    """The King James Bible's bytes (and a text of CRLF line ends and tabs) as val.bin: refused, not read as ids
    that model.num_classes=32768 would embed."""
    data = _kjv_text().encode()[:1 << 16] if text == "bible" else b"a\tb c\r\nd e\r\n" * 64
    assert all(b in (9, 10, 13) or 32 <= b <= 126 for b in data)  # plain ASCII text, byte by byte
    (tmp_path / "val.bin").write_bytes(_even(data))
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / 'val.bin'))}: {REFUSED}"):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


def test_train_py_refuses_a_text_train_file_instead_of_advising_a_wider_vocabulary(tmp_path):
    """The reviewer's case: the Bible's text as train.bin and val.bin; model.num_classes=32768 (the advice the
    vocabulary check gave) trained on byte pairs. Now refused whatever model.num_classes says."""
    data = _kjv_text().encode()[:1 << 18]
    (tmp_path / "train.bin").write_bytes(_even(data[:1 << 17]))
    (tmp_path / "val.bin").write_bytes(_even(data[1 << 17:]))
    for width in (65, 32768):
        cfg = load_config([NANO], [f"out_dir={tmp_path / str(width)}", "data.dataset=tokens",
                                   f"data.root={tmp_path}", f"model.num_classes={width}"])
        with pytest.raises(DataError, match=REFUSED):
            train.main(cfg)
        assert not (tmp_path / str(width) / "checkpoint.pt").exists()


def _byte_level_bpe_ids(text: str) -> np.ndarray:
    """The ids of `text` under a byte-level BPE (GPT-2's scheme: 256 byte ids, then merges by frequency) trained
    on the Bible, as GPT-2's tokenizer cannot be downloaded here."""
    tokenizers = pytest.importorskip("tokenizers")
    bible = _kjv_text()
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([bible[i:i + 100_000] for i in range(0, 1_000_000, 100_000)], vocab_size=8000,
                            show_progress=False)
    return np.array(bpe.encode(text).ids)


def _zipf_ids(vocab: int, count: int) -> np.ndarray:
    """`count` ids of a `vocab`-id vocabulary drawn by Zipf's law over frequency ranks (as BPE ids are ranked)."""
    weights = 1.0 / np.arange(1, vocab + 1)
    return np.random.default_rng(0).choice(vocab, count, p=weights / weights.sum())


@pytest.mark.parametrize("stream", ["bible_characters", "bytes_as_ids", "byte_level_bpe", "gpt2_vocabulary"])
def test_real_uint16_streams_are_read_as_written(tmp_path, stream):
    """Character ids (the Bible's 65, or each byte of the text as its own id below 256) and BPE ids (a byte-level
    BPE of the Bible, ids drawn over GPT-2's 50,257 by rank) are never read as text: each is read as written."""
    text = _kjv_text()[:1 << 18]
    ids = {"bible_characters": lambda: _kjv("train", 0.1).ids[:1 << 18],
           "bytes_as_ids": lambda: np.frombuffer(text.encode(), dtype=np.uint8),
           "byte_level_bpe": lambda: _byte_level_bpe_ids(text),
           "gpt2_vocabulary": lambda: _zipf_ids(50_257, 1 << 18)}[stream]()
    ids.astype(np.uint16).tofile(tmp_path / "val.bin")
    read = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    assert read.ids.tolist() == np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist() == ids.tolist()
