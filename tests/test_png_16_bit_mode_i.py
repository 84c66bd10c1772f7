"""A 16-bit grayscale PNG under every Pillow requirements.txt admits: Pillow before 10.3 opens it as mode I (32-bit
integer pixels), 10.3 and later as I;16. Both read as the 8-bit image of the same values (65535 -> 255), not as an
unreadable file; mode I pixels from a format that holds 32 bits (a TIFF, whatever its file is called) stay refused."""
import numpy as np
from PIL import Image, PngImagePlugin

from data.folder import build_folder_dataset, unreadable_target
from tests.conftest import make_folder

WIDE = np.linspace(0, 65535, 16 * 16).reshape(16, 16).astype(np.uint16)  # every 16-bit level from 0 to 65535


def read(tmp_path, name: str):
    """(image, target) of class a's file `name` in a val split of classes a and b."""
    dataset = build_folder_dataset(str(tmp_path), "val")
    index = next(i for i in range(len(dataset)) if dataset.filename(i) == f"a/{name}")
    return dataset[index], index


def test_a_16_bit_png_opened_as_mode_i_reads_as_its_8_bit_values(tmp_path, monkeypatch):
    # Pillow 9.x-10.2's PNG reader: 16-bit grayscale (bit depth 16, colour type 0) opens as mode I
    monkeypatch.setitem(PngImagePlugin._MODES, (16, 0), ("I", "I;16B"))
    make_folder(tmp_path, {"val": {"a": 0, "b": 1}})
    Image.fromarray(WIDE).save(tmp_path / "val" / "a" / "0.png")
    with Image.open(tmp_path / "val" / "a" / "0.png") as opened:
        assert opened.mode == "I"  # the old Pillow's reading is what this test reads
    (gray, target), _ = read(tmp_path, "0.png")
    assert target == 0 and gray.mode == "RGB"
    expected = np.rint(WIDE.astype(np.float64) * 255 / 65535).astype(np.uint8)  # the closest 8-bit level
    assert all(np.array_equal(np.asarray(gray)[..., c], expected) for c in range(3))


def test_a_32_bit_integer_tiff_is_still_marked_unreadable(tmp_path):
    # named .png (timm's reader takes .png, .jpg and .jpeg only), but PIL reads what the bytes are: a TIFF
    make_folder(tmp_path, {"val": {"a": 0, "b": 1}})
    Image.fromarray(WIDE.astype(np.int32) * 1000).save(tmp_path / "val" / "a" / "0.png", format="TIFF")
    with Image.open(tmp_path / "val" / "a" / "0.png") as opened:
        assert (opened.mode, opened.format) == ("I", "TIFF")
    (_, target), index = read(tmp_path, "0.png")
    assert target == unreadable_target(index)
