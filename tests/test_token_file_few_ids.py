"""A token file of one or two ids whose ids do not fit the model gets the advice of a larger model.num_classes: its
2 or 4 bytes say nothing of whether it is text (GPT-2's end-of-text id 50256 is the bytes 'P' and a UTF-8 lead byte
that the end of the file cuts, valid as far as it goes). From 8 bytes on, a text file is still refused as text."""
import numpy as np
import pytest

from data import DataError
from data.text import TokenStream, VocabularyError, check_vocabulary


@pytest.mark.parametrize("ids", [[50256], [0x4150, 50256]])  # 'P' + cut lead byte; 'PA' 'P' + cut lead byte
def test_one_or_two_ids_get_the_vocabulary_advice(ids):
    stream = TokenStream(np.array(ids, dtype=np.uint16), None, "val.bin")
    with pytest.raises(VocabularyError, match=r"^val.bin holds ids up to 50256, model.num_classes=65 embeds 0..64: "
                                              r"set model.num_classes=50257 or more$"):
        check_vocabulary(stream, 65)


def test_eight_bytes_of_text_are_refused_as_text():
    stream = TokenStream(np.frombuffer(b"Hi there", dtype=np.uint16), None, "val.bin")
    with pytest.raises(DataError, match=r"^val.bin: its first 8 bytes are text") as refused:
        check_vocabulary(stream, 65)
    assert not isinstance(refused.value, VocabularyError)
