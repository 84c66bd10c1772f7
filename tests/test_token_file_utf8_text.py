"""data.dataset=tokens refuses a UTF-8 text file given as <root>/<split>.bin, not only a plain ASCII one: its
bytes read as uint16 give ids up to 65535, which the vocabulary check advised a model.num_classes to fit (then
the run trained on byte pairs), or, with a few non-ASCII characters, ids that fit GPT-2's vocabulary (then it
trained without a word). Judged against a naive reference (Python's own UTF-8 decoder, byte by byte), and real
uint16 id streams of such text are still read as written. A UTF-16 text file (with its byte-order mark) is refused as
text too."""
import re

import numpy as np
import pytest

import train
from configs import load_config
from configs.schema import DataConfig
from data import DataError
from data.text import ID_CHECK_SAMPLE, TokenStream, _kjv_text, check_vocabulary, is_plain_text, token_stream

NANO = "configs/lm/kjv_nano.yaml"
REFUSED = r"its first [\d,]+ bytes are text \(UTF-8 without control bytes\), as in a plain text file, not uint16 " \
          r"token ids; tokenize the text into a file of uint16 ids"
CONTROL = set(range(32)) - {9, 10, 13}


def _even(data: bytes) -> bytes:
    return data + b"\n" * (len(data) % 2)


def _curly_bible(chars: int) -> bytes:
    """The Bible's text with typographic apostrophes (U+2019, three UTF-8 bytes): the reviewer's file."""
    return _even(_kjv_text()[:chars].replace("'", "\u2019").encode("utf-8"))


def _naive_is_text(data: bytes) -> bool:
    """The reference: no control byte, and UTF-8 once the last 0..3 bytes (a sequence the cut may split) are
    dropped, by Python's strict decoder."""
    if any(b in CONTROL for b in data):
        return False
    for cut in range(4):
        try:
            data[:len(data) - cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            pass
    return False


def test_a_utf8_text_file_is_refused_as_text(tmp_path):
    """The reviewer's repro: the Bible with ’ for ' as train.bin and val.bin. Its bytes are not all ASCII (the
    old check's whole notion of text), yet it is text; refused naming the file and the fix."""
    data = _curly_bible(300_000)
    assert max(data) >= 0x80 and data.decode("utf-8")  # UTF-8 text, not ASCII
    (tmp_path / "val.bin").write_bytes(data[:60_000])
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / 'val.bin'))}: {REFUSED}"):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


@pytest.mark.parametrize("offset", [1001, 1000])
def test_ascii_text_with_one_accented_letter_is_refused(tmp_path, offset):
    """ASCII text with one é (two bytes) at an odd or even offset: read as uint16, its ids fit GPT-2's 50,304,
    so nothing else would stop a run from training on byte pairs."""
    text = _kjv_text()[:100_000].encode()
    data = _even(text[:offset] + "é".encode() + text[offset:])
    ids = np.frombuffer(data, dtype=np.uint16)
    assert int(ids.max()) < 50_304  # the vocabulary check had nothing to say
    (tmp_path / "val.bin").write_bytes(data)
    with pytest.raises(DataError, match=REFUSED):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


def test_a_character_cut_by_the_end_of_the_head_still_reads_as_text(tmp_path):
    """Only the head (ID_CHECK_SAMPLE values) is judged: a ’ whose three bytes the head's end splits is the cut's
    doing, not a sign of ids."""
    head_bytes = 2 * ID_CHECK_SAMPLE
    data = _even(b"a" * (head_bytes - 1) + "\u2019".encode() + b" and more text\n" * 100)
    assert data[head_bytes - 1] == 0xE2  # the head ends after the first byte of ’
    assert _naive_is_text(data[:head_bytes])
    (tmp_path / "val.bin").write_bytes(data)
    with pytest.raises(DataError, match=REFUSED):
        token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


def test_train_py_refuses_utf8_text_whatever_model_num_classes_says(tmp_path):
    """train.py gave 'holds ids up to 57977 ... set model.num_classes=57978 or more', and with that width trained
    on pairs of characters; both widths now end in the text refusal, which advises no other vocabulary."""
    data = _curly_bible(300_000)
    (tmp_path / "train.bin").write_bytes(data)
    (tmp_path / "val.bin").write_bytes(data[:60_000])
    assert int(np.frombuffer(data, dtype=np.uint16).max()) > 50_303  # the width the old advice asked for
    for width in (50_304, 65_536):
        cfg = load_config([NANO], [f"out_dir={tmp_path / str(width)}", "data.dataset=tokens",
                                   f"data.root={tmp_path}", f"model.num_classes={width}"])
        with pytest.raises(DataError, match=REFUSED) as refused:
            train.main(cfg)
        assert "model.num_classes" not in str(refused.value)
        assert not (tmp_path / str(width) / "checkpoint.pt").exists()


def test_a_short_text_file_whose_ids_do_not_fit_is_refused_as_text_not_advised_a_wider_vocabulary(tmp_path):
    """A file of fewer values than check_not_wider_ids judges (64) is judged by the vocabulary check when its ids
    do not fit: text gets the text refusal, ids the advice of a larger model.num_classes."""
    (tmp_path / "val.bin").write_bytes(_even("A’s ‘own’ café.\n".encode()))  # E2 at odd offsets: ids > 57855
    stream = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    assert len(stream.ids) < 64 and int(stream.ids.max()) >= 50_304
    with pytest.raises(DataError, match=REFUSED) as refused:
        check_vocabulary(stream, 50_304)
    assert "model.num_classes" not in str(refused.value)
    ids = TokenStream(np.array([5, 60_000, 7], dtype=np.uint16), None, "f")  # ids: the advice stays
    with pytest.raises(DataError, match=r"^f holds ids up to 60000, .*: set model.num_classes=60001 or more$"):
        check_vocabulary(ids, 50_304)


@pytest.mark.parametrize("seed", range(6))
def test_is_plain_text_agrees_with_the_naive_reference(seed):
    """Heads of text, text with one control byte, text with one byte changed at random, and random bytes: the
    judgment is the reference's (no control byte, strict UTF-8 but a cut last sequence)."""
    rng = np.random.default_rng(seed)
    text = bytearray(_even(("Abel’s ‘first’ day, a naïve café.\n" + _kjv_text()[:4_000 + seed]).encode()))
    cases = [bytes(text), bytes(rng.integers(0, 256, 512, dtype=np.uint8))]
    for _ in range(20):
        changed = bytearray(text)
        changed[int(rng.integers(len(changed)))] = int(rng.integers(256))
        cases.append(bytes(changed))
    at = text.index("\u2019".encode())
    for inside in (1, 2):  # heads ending inside a character of three bytes (an even length: a pad before it)
        head = bytes(text[:at + inside])
        cases.append(head if len(head) % 2 == 0 else b"a" + head)
    for data in cases:
        data = data[:len(data) // 2 * 2]
        assert is_plain_text(np.frombuffer(data, dtype=np.uint16)) == _naive_is_text(data), data[:80]


def _byte_level_bpe_ids(text: str) -> np.ndarray:
    """The ids of `text` under a byte-level BPE (GPT-2's scheme) trained on the same text, as GPT-2's tokenizer
    cannot be downloaded here."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([text[i:i + 100_000] for i in range(0, len(text), 100_000)], vocab_size=8000,
                            show_progress=False)
    return np.array(bpe.encode(text).ids)


@pytest.mark.parametrize("stream", ["utf8_bytes_as_ids", "byte_level_bpe"])
def test_uint16_ids_of_utf8_text_are_read_as_written(tmp_path, stream):
    """The same curly-quoted Bible tokenized (each UTF-8 byte its own id, or byte-level BPE ids) is a real uint16
    stream: read as written (np.fromfile as the reference), never refused as text."""
    text = _kjv_text()[:1 << 18].replace("'", "\u2019")
    ids = (np.frombuffer(text.encode("utf-8"), dtype=np.uint8) if stream == "utf8_bytes_as_ids"
           else _byte_level_bpe_ids(text))
    ids.astype(np.uint16).tofile(tmp_path / "val.bin")
    read = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    assert read.ids.tolist() == np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist() == ids.tolist()


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be"])
@pytest.mark.parametrize("chars", [30_000, 20])
def test_a_utf16_text_file_is_refused_as_text_not_advised_a_wider_vocabulary(tmp_path, codec, chars):
    """A UTF-16 text file with its byte-order mark (PowerShell 5's `>` writes one, as Python's "utf-16" does): read
    as uint16 its characters are ids that fit any vocabulary, its mark an id of 65279 (little-endian) or 65534, so
    the run was advised model.num_classes=65280 or more, to train on characters as token ids. The file is text by
    construction (Python's encoder); long or short (no layout judged), it is refused as text, naming the encoding."""
    data = "\ufeff".encode(codec) + _kjv_text()[:chars].replace("'", "\u2019").encode(codec)
    (tmp_path / "val.bin").write_bytes(data)
    stream = DataConfig(dataset="tokens", root=str(tmp_path))
    encoding = {"utf-16-le": "UTF-16LE", "utf-16-be": "UTF-16BE"}[codec]
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / 'val.bin'))}: its first [\d,]+ bytes are text "
                                        rf"\({encoding} after its byte-order mark\), as in a plain text file, "
                                        r"not uint16 token ids; tokenize") as refused:
        check_vocabulary(token_stream(stream, "val"), 50_304)
    assert "model.num_classes" not in str(refused.value)
