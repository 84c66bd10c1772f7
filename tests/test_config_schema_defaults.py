"""Every default of the schema is a value the loader keeps as it is: a config written with the defaults (a run's
config.yaml, --print-config) reads back with the same type and value in every field, so re-running from it writes
the same bytes. sched.warmup_epochs, a float field, defaulted to the int 5, which the loader reads back as 5.0."""
import dataclasses

from configs import Config, load_config
from configs.cli import print_config


def leaves(node, prefix=""):
    """(dotted key, value) of every field below the dataclass `node` that is not itself a section."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value


def same(a, b) -> bool:
    """Equal with the same types all the way down (5 == 5.0 and (1,) == [1] are not the same value here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b or (a != a and b != b)  # nan is itself


def printed(cfg: Config, capsys) -> str:
    """`cfg` as --print-config writes it (as a run's config.yaml is written)."""
    print_config(cfg)
    return capsys.readouterr().out


def test_every_default_reads_back_with_its_type_and_value(tmp_path, capsys):
    written = tmp_path / "defaults.yaml"
    written.write_text(printed(Config(), capsys))
    loaded = dict(leaves(load_config([str(written)])))
    changed = {key: (value, loaded[key]) for key, value in leaves(Config()) if not same(value, loaded[key])}
    assert not changed, changed


def test_a_config_of_the_defaults_is_written_again_byte_for_byte(tmp_path, capsys):
    text = printed(Config(), capsys)
    written = tmp_path / "config.yaml"
    written.write_text(text)
    assert printed(load_config([str(written)]), capsys) == text
