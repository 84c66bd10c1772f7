"""Strict config loading: dataclass defaults < YAML files (in order) < `key=value` overrides.

    cfg = load_config(["configs/pretrain/vit_b.yaml"], ["optim.lr=1e-3", "out_dir=runs/x"])

Values are parsed as YAML (so `1e-3`, `true`, `null`, `[1, 2]` work) and checked
against the field's annotation. An unknown key is an error that names the key and its closest matches;
so is a value of the wrong type or outside a `Literal` choice. `dict` fields (e.g. `model.kwargs`,
`cd.lam_per_role`) accept any keys, also as dotted overrides (`cd.lam_per_role.fc2=0.02`).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Annotated, Any, Iterable, Literal, Sequence, Union

import yaml

from .schema import Config


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` and `5E4` as floats (YAML 1.1 wants `1.0e-3`)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    """Parse YAML text (a file or one override value) the way every config value is parsed."""
    return yaml.load(text, Loader=_YamlLoader)


def load_config(paths: Sequence[str] | str | None = None, overrides: Iterable[str] = ()) -> Config:
    """Build a Config from defaults, then each YAML file in `paths`, then `overrides`."""
    if isinstance(paths, str):
        paths = [paths]
    cfg = Config()
    for path in paths or ():
        merge_file(cfg, path)
    return apply_overrides(cfg, overrides)


def merge_file(cfg: Config, path: str) -> Config:
    """Apply the YAML file at `path` to `cfg` in place (and return it)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        text = f.read()
    try:
        data = parse_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    _merge(cfg, data, path="", source=path)
    return cfg


def apply_overrides(cfg: Config, overrides: Iterable[str]) -> Config:
    """Apply `key=value` overrides to `cfg` in place (and return it), checked like everything else."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            value = parse_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML: {_yaml_problem(e)}") from None
        _assign(cfg, key.strip().split("."), value, path="", source="command line")
    return cfg


def _yaml_problem(e: yaml.YAMLError) -> str:
    """'<problem> (line L, column C)' from a PyYAML error, without its multi-line context dump."""
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or e}{where}"


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from `config_to_dict` output (e.g. stored in a checkpoint), strictly."""
    cfg = Config()
    _merge(cfg, data, path="", source="saved config")
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) for YAML/JSON and checkpoints."""

    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)


def _merge(node: Any, data: dict, path: str, source: str) -> None:
    for key, value in data.items():
        _assign(node, str(key).split("."), value, path, source)


def _assign(node: Any, parts: list, value: Any, path: str, source: str) -> None:
    """Set the (dotted) key `parts` below dataclass `node` to `value`, checked against the schema."""
    name, rest = parts[0], parts[1:]
    hints = typing.get_type_hints(type(node), include_extras=True)
    key = path + name
    if name not in hints:
        raise ConfigError(_unknown_key_message(key, hints, source))
    current = getattr(node, name)
    if dataclasses.is_dataclass(current):
        if rest:
            return _assign(current, rest, value, key + ".", source)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{key}' is a section; give its keys, not {value!r}")
        return _merge(current, value, key + ".", source)
    annotation = hints[name]
    if not rest:
        return setattr(node, name, _coerce(value, annotation, key, source))
    if annotation is dict or _origin(annotation) is dict:
        # a dotted key into a free-form dict field: cd.lam_per_role.fc2=0.02
        setattr(node, name, {**current, ".".join(rest): value})
        return
    raise ConfigError(f"{source}: '{key}' is {_type_name(annotation)}; it has no sub-key '{rest[0]}'")


def _unknown_key_message(key: str, hints: dict, source: str) -> str:
    section, _, name = key.rpartition(".")
    matches = difflib.get_close_matches(name, list(hints), n=3, cutoff=0.5)
    where = f"section '{section}'" if section else "the top level"
    hint = f"; did you mean {', '.join(repr((section + '.' if section else '') + m) for m in matches)}?" \
        if matches else f"; valid keys in {where}: {', '.join(sorted(hints))}"
    return f"{source}: unknown config key '{key}'{hint}"


def _origin(annotation: Any) -> Any:
    return typing.get_origin(annotation)


def _type_name(annotation: Any) -> str:
    if _origin(annotation) is Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if _origin(annotation) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Check `value` against `annotation`; return it in the field's canonical type."""

    def fail(reason: str = ""):
        raise ConfigError(f"{source}: '{key}' expects {_type_name(annotation)}, got {value!r}"
                          f" ({type(value).__name__}){reason}")

    origin = _origin(annotation)
    if origin is Annotated:  # a value range (constraints.py) on top of the type
        base, *ranges = typing.get_args(annotation)
        value = _coerce(value, base, key, source)
        for allowed in ranges:
            problem = allowed.violation(value)
            if problem:
                raise ConfigError(f"{source}: '{key}' must be {problem}; got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None:
            if type(None) in args:
                return None
            fail()
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                pass
        fail()
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{source}: '{key}' must be one of {', '.join(map(repr, choices))}; "
                              f"got {value!r}")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        fail()
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        fail()
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        fail()
    if annotation is str:
        if isinstance(value, str):
            return value
        fail()
    if annotation in (tuple, list) or origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            fail()
        return tuple(value) if (annotation is tuple or origin is tuple) else list(value)
    if annotation is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            fail()
        return dict(value)
    raise ConfigError(f"{source}: '{key}' has an unsupported annotation {annotation!r}")
