"""data.auto_augment, section by section: timm's policy parsers skip a '-' section they do not read without a word
(rand-m9-mstd0.5-inc trains the non-increasing set, rand-m9-mstd-inc1 has no magnitude noise, rand-m9-tfoo the
default set), and keep one of a key given twice. Such a policy is one error naming the section; every policy timm
documents still trains.

The reference is what timm builds: a refused section is one whose removal leaves timm's transform unchanged, and
every key the check takes changes it."""
import numpy as np
import pytest
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform

from configs import ConfigError
from data.transforms import check_auto_augment


def built(policy: str):
    """What timm builds from `policy`, as comparable values: the transform's settings and each op's."""
    family = policy.split("-")[0]
    make = {"rand": rand_augment_transform, "augmix": augment_and_mix_transform}.get(family, auto_augment_transform)
    transform = make(policy)
    ops = transform.ops if hasattr(transform, "ops") else [op for sub in transform.policy for op in sub]
    settings = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in vars(transform).items()
                if k not in ("ops", "policy")}
    return repr(settings), [(op.name, op.prob, op.magnitude, op.magnitude_std, op.magnitude_max) for op in ops]


def without(policy: str, section: str) -> str:
    parts = policy.split("-")
    parts.remove(section)
    return "-".join(parts)


@pytest.mark.parametrize("policy", [
    "rand-m9-mstd0.5-inc1", "rand-m9-n3-mstd0.5", "rand-mstd1-tweights", "rand-m9-t3a", "rand-m9-t3aw-inc0",
    "rand-m9-mmax10-p0.5-mstd101", "augmix-m5-w4-d2", "augmix-m3-w3-d1-a1-b1-mstd0.5",
    "original", "originalr", "v0", "v0r", "3a", "original-mstd0.5", "v0-mstd1",
])
def test_every_policy_timm_documents_is_accepted(policy):
    check_auto_augment(policy)


@pytest.mark.parametrize("policy, named, ignored", [
    ("rand-m9-mstd0.5-inc", "inc", "inc"),  # the increasing set dropped
    ("rand-m9-mstd-inc1", "mstd", "mstd"),  # no magnitude noise
    ("rand-m9-zz", "zz", "zz"),
    ("rand-m9-tfoo", "tfoo", "tfoo"),  # timm's default set
    ("rand-m9-tweight-inc1", "tweight", "tweight"),
    ("rand-m9--inc1", "", ""),
    ("rand-m9-mstd0.5-mstd1", "mstd1", "mstd1"),  # timm keeps the first mstd
    ("rand-m9-m5", "m5", "m9"),  # and the last m
    ("augmix-m5-w", "w", "w"),
    ("augmix-m5-w4-d", "d", "d"),
    ("original-mstd", "mstd", "mstd"),
    ("v0-zz", "zz", "zz"),
    ("3a-mstd", "mstd", "mstd"),
])
def test_a_section_timm_ignores_is_refused_by_name(policy, named, ignored):
    assert built(policy) == built(without(policy, ignored))  # the reference: timm drops it without a word
    with pytest.raises(ConfigError, match=rf"^data\.auto_augment='{policy}' is not a policy timm can read: section "
                                          rf"'{named}' ") as refused:
        check_auto_augment(policy)
    assert "\n" not in str(refused.value)


# a value other than timm's default, per key each family's parser reads (timm.data.auto_augment)
READ = {
    "rand": {"m": "3", "n": "3", "p": "0.3", "mstd": "0.5", "mmax": "5", "inc": "1"},
    "augmix": {"m": "5", "w": "4", "d": "2", "a": "0.5", "b": "1", "mstd": "0.5"},
    "v0": {"mstd": "0.5"},
}


@pytest.mark.parametrize("base", sorted(READ))
def test_every_key_the_check_accepts_changes_what_timm_builds(base):
    from data.transforms import POLICY_KEYS, RAND_TRANSFORM_SETS, policy_family

    assert set(POLICY_KEYS[policy_family(base)]) == set(READ[base])
    for key, value in READ[base].items():
        check_auto_augment(f"{base}-{key}{value}")
        assert built(f"{base}-{key}{value}") != built(base), key
    if base == "rand":
        for name in RAND_TRANSFORM_SETS:
            check_auto_augment(f"rand-t{name}")
            assert built(f"rand-t{name}") != built("rand"), name


@pytest.mark.parametrize("base", sorted(READ))
def test_a_one_letter_key_timm_does_not_read_is_refused(base):
    """No key is missing from the check: timm fails on every other letter with a number (rand's t<name> aside)."""
    for letter in "abcdefghijklmnopqrsuvwxyz" + ("t" if base != "rand" else ""):
        if letter in READ[base]:
            continue
        with pytest.raises(AssertionError):
            built(f"{base}-{letter}1")
        with pytest.raises(ConfigError, match=rf"section '{letter}1'"):
            check_auto_augment(f"{base}-{letter}1")
