"""A token file of big-endian uint16 ids, or of uint8 ids, read as little-endian uint16 gives ids past the model's
vocabulary: the vocabulary check advised a model.num_classes to fit them (65460 for GPT-2 ids written with '>u2',
16448 for character ids written as uint8), and following it trained on byte-swapped ids or pairs of bytes. Such a
file is refused as that layout, with the fix (re-export as little-endian uint16), checked here by doing it: the
re-exported file reads back as the ids written. Ids of the right layout that do not fit keep the advice."""
import numpy as np
import pytest

from configs.schema import DataConfig
from data import DataError
from data.text import VocabularyError, check_vocabulary, token_stream

REEXPORT = r"re-export the ids as little-endian uint16 \(np\.asarray\(ids, dtype='<u2'\)\.tofile\(\.\.\.\)\)$"


def _gpt2_ids(n: int, seed: int = 0) -> np.ndarray:
    """Zipf-like ids of GPT-2's vocabulary, its end-of-text id among them, as a tokenized text has."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.2, n), 50_256)
    ids[::97] = 50_256
    return ids


def _char_ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 65, n)


def _stream(tmp_path, ids: np.ndarray, dtype: str):
    (tmp_path / "val.bin").write_bytes(np.asarray(ids).astype(dtype).tobytes())
    return token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")


def _reexported_fits(tmp_path, ids: np.ndarray, vocab: int) -> None:
    """Following the advice: the file rewritten as little-endian uint16 reads back as `ids`, and they fit."""
    stream = _stream(tmp_path, ids, "<u2")
    np.testing.assert_array_equal(np.asarray(stream.ids), ids)
    check_vocabulary(stream, vocab)


@pytest.mark.parametrize("ids, vocab", [(_gpt2_ids(20_000), 50_304), (_char_ids(3_000), 65),
                                        (_char_ids(3_000), 256)])  # ids below 256: all bytes fit uint8 too
def test_big_endian_uint16_ids_are_refused_as_big_endian(tmp_path, ids, vocab):
    stream = _stream(tmp_path, ids, ">u2")
    assert int(np.asarray(stream.ids).max()) >= vocab  # the old check's advice: a larger model.num_classes
    with pytest.raises(DataError, match=r"val\.bin: its ids read as little-endian uint16 reach \d+, past "
                                        rf"model\.num_classes={vocab} .*a file of big-endian uint16 ids; .*"
                                        + REEXPORT) as refused:
        check_vocabulary(stream, vocab)
    assert not isinstance(refused.value, VocabularyError) and "or more" not in str(refused.value)
    _reexported_fits(tmp_path, ids, vocab)


@pytest.mark.parametrize("vocab", [65, 256])
def test_uint8_ids_are_refused_as_uint8(tmp_path, vocab):
    ids = _char_ids(5_000)  # an even number of bytes: an odd one is refused as no uint16 file at all
    stream = _stream(tmp_path, ids, "u1")
    with pytest.raises(DataError, match=rf"past model\.num_classes={vocab} .*its single bytes all fit \(up to 64\): "
                                        r"a file of uint8 ids; .*" + REEXPORT) as refused:
        check_vocabulary(stream, vocab)
    assert not isinstance(refused.value, VocabularyError)
    _reexported_fits(tmp_path, ids, vocab)


@pytest.mark.parametrize("ids, vocab", [(_gpt2_ids(20_000), 50_000), (_gpt2_ids(20_000), 65),
                                        (_char_ids(3_000), 60)])
def test_little_endian_ids_that_do_not_fit_keep_the_advice(tmp_path, ids, vocab):
    """Ids of the right layout past the vocabulary (a model too small for them): no other layout fits them either,
    so the advice of a larger model.num_classes stays, naming the ids' true largest."""
    stream = _stream(tmp_path, ids, "<u2")
    with pytest.raises(VocabularyError, match=rf"set model\.num_classes={int(ids.max()) + 1} or more$"):
        check_vocabulary(stream, vocab)


def test_big_endian_ids_past_the_vocabulary_either_way_keep_the_advice(tmp_path):
    """GPT-2 ids written big-endian, given a character model: they fit in no layout, the advice stays."""
    with pytest.raises(VocabularyError, match=r"or more$"):
        check_vocabulary(_stream(tmp_path, _gpt2_ids(20_000), ">u2"), 65)


def _bible_char_ids(n: int) -> np.ndarray:
    """The first `n` characters of the King James Bible as ids of its 65 sorted characters (nanoGPT's
    shakespeare_char encoding)."""
    from data.text import _kjv_text
    text = _kjv_text()[:n]
    lookup = {c: i for i, c in enumerate(sorted(set(_kjv_text())))}
    return np.array([lookup[c] for c in text])


@pytest.mark.parametrize("ids", [_char_ids(1 << 16), "bible"])
def test_uint8_ids_that_fit_a_wide_vocabulary_read_as_uint16_are_refused_as_uint8(tmp_path, ids):
    """Character ids written as uint8, given a GPT-2-sized model: two ids make a uint16 value up to 64 * 257 = 16448,
    which fits 50304, so the vocabulary check passed and the model trained on pairs of characters. Refused with the
    fix, which reads back as the ids written."""
    ids = _bible_char_ids(1 << 17) if isinstance(ids, str) else ids
    with pytest.raises(DataError, match=r"val\.bin: the low and high bytes of its first [\d,]+ uint16 values are "
                                        r"spread alike .*a file of uint8 ids.*np\.fromfile\(path, dtype=np\.uint8\)"
                                        r"\.astype\(np\.uint16\)\.tofile\(\.\.\.\)"):
        _stream(tmp_path, ids, "u1")
    path = tmp_path / "val.bin"
    np.fromfile(path, dtype=np.uint8).astype(np.uint16).tofile(path)
    stream = token_stream(DataConfig(dataset="tokens", root=str(tmp_path)), "val")
    np.testing.assert_array_equal(np.asarray(stream.ids), ids)
    check_vocabulary(stream, 50_304)


@pytest.mark.parametrize("ids", [_gpt2_ids(1 << 18), np.random.default_rng(2).integers(0, 50_304, 1 << 18),
                                 np.random.default_rng(3).integers(0, 1_000, 1 << 16), _char_ids(1 << 16),
                                 np.random.default_rng(4).integers(0, 1 << 16, 1 << 16)])
def test_uint16_ids_of_any_vocabulary_are_not_taken_for_uint8(tmp_path, ids):
    """GPT-2's Zipf-like ids, uniform ids of its whole vocabulary (the high bytes 0..196 against low bytes 0..255),
    a vocabulary of 1,000, character ids below 256 and uniform ids of all 65,536 (bytes alike in both halves, but of
    every value, as no uint8 text's are), all as uint16: read as written."""
    np.testing.assert_array_equal(np.asarray(_stream(tmp_path, ids, "<u2").ids), ids)
