"""data.digits_val_fraction: the schema takes any fraction in (0, 1), but the stratified split of the 1,797 digits
needs at least one image per class (10) in each split. A fraction that leaves fewer is one `error:` line naming the
key and the range that fits, not sklearn's traceback.

The reference is sklearn's rule, written out: val gets ceil(fraction * 1797) images, train the rest."""
import math

import pytest

from configs import ConfigError
from data.digits import DigitsDataset
from tests.conftest import DEMO_CONFIG, run_entry

IMAGES, CLASSES = 1797, 10


def fits(fraction: float) -> bool:
    val = math.ceil(fraction * IMAGES)
    return val >= CLASSES and IMAGES - val >= CLASSES


@pytest.mark.parametrize("fraction", [0.001, 0.005, 0.00501, 0.0051, 0.2, 0.9944, 0.99443, 0.9945, 0.999])
def test_a_fraction_either_splits_with_every_class_in_both_splits_or_is_refused(fraction):
    if fits(fraction):
        val, train = DigitsDataset("val", 8, fraction), DigitsDataset("train", 8, fraction)
        assert len(val) == math.ceil(fraction * IMAGES) and len(train) == IMAGES - len(val)
        assert set(val.targets) == set(train.targets) == set(range(CLASSES))
        return
    with pytest.raises(ConfigError, match=rf"^data\.digits_val_fraction={fraction} .* set data\.digits_val_fraction "
                                          rf"between [0-9.]+ and [0-9.]+$") as refused:
        DigitsDataset("val", 8, fraction)
    assert "\n" not in str(refused.value)


def test_the_range_the_error_names_is_the_range_that_fits():
    """Both ends fit; one step of the last digit further out does not."""
    with pytest.raises(ConfigError) as refused:
        DigitsDataset("val", 8, 0.001)
    low, high = (float(x) for x in str(refused.value).rsplit(" between ", 1)[1].split(" and "))
    step = 10 ** -len(str(low).split(".")[1])
    assert fits(low) and fits(high) and not fits(low - step) and not fits(high + step)


@pytest.mark.parametrize("fraction", [0.001, 0.999])
def test_the_command_line_ends_in_one_error_line(tmp_path, capsys, fraction):
    code, _, err = run_entry("train.py", ["--config", DEMO_CONFIG, f"out_dir={tmp_path / 'r'}",
                                          f"data.digits_val_fraction={fraction}"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: data.digits_val_fraction={fraction} ") and " between " in lines[0]
