"""Config values from YAML, the command line and Tune: a dataclass from a dict, dotted overrides.

    cfg = apply_overrides(Config(), ["objective.name=vanilla", "optim.lr=3e-4"])
    cfg = apply_overrides(cfg, {"optim.lr": 3e-4})
    spec = build(SweepSpec, {"values": [8, 16]}, prefix="sweep.")   # any dataclass from a dict
    dict(flatten({"optim": {"lr": 3e-4}}))                          # {"optim.lr": 3e-4}

Values are coerced to the annotated field types (a YAML string "3e-4" to a float, "[8, 16]" to a
tuple); an unknown field or a value of the wrong type raises `HLMError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import fields
from functools import cache
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from hlm_ray.errors import HLMError

C = TypeVar("C")  # a Config (the schema imports this module, not the other way round)


def to_plain(value: Any) -> Any:
    """Tuples to lists, recursively: what YAML and Ray carry."""
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [to_plain(v) for v in value]
    return value


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """A dataclass from a nested dict, coercing values to the annotated types; an unknown key
    or a value of the wrong type raises `HLMError` naming `prefix` + the field."""
    if not isinstance(data, dict):
        raise HLMError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HLMError(
            f"unknown config field {prefix}{unknown[0]}; allowed: {', '.join(sorted(known))}"
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, hint):
            kwargs[name] = value  # already built (a sweep's axis record)
        elif dataclasses.is_dataclass(hint):
            kwargs[name] = build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


@cache
def _type_hints(cls: type) -> dict[str, Any]:
    """The class's field types, evaluated once: `get_type_hints` compiles every string
    annotation on each call, and a sweep's plan builds thousands of configs."""
    return get_type_hints(cls)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Turn YAML / command-line values into the field's type, or fail naming the field."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except HLMError as err:
                errors.append(str(err))
        raise HLMError(errors[0] if errors else f"{name}={value!r} is not allowed")
    if origin is Literal:
        if value not in args:
            allowed = " | ".join(map(str, args))
            raise HLMError(f"{name}={value!r} is not allowed; choose one of: {allowed}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("()[]").split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise HLMError(f"{name}={value!r} is not allowed; expected a list")
        item_types = args if args and args[-1] is not Ellipsis else (args[0],) * len(value)
        if len(item_types) != len(value):
            raise HLMError(f"{name}={value!r} is not allowed; expected {len(item_types)} values")
        return tuple(_coerce(v, t, name) for v, t in zip(value, item_types, strict=True))
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool | int):
                raise ValueError
            return bool(value)
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            number = float(value) if isinstance(value, str) and "e" in value.lower() else value
            if isinstance(number, float) and not math.isfinite(number):
                raise HLMError(f"{name}={value!r} is not allowed; expected a finite int")
            return int(number)
        if hint is float:
            number = float(value)
            if not math.isfinite(number):  # inf passes every `> 0` check, nan fails them all
                raise HLMError(f"{name}={value!r} is not allowed; expected a finite float")
            return number
        if hint is str:
            if not isinstance(value, str | int | float):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise HLMError(f"{name}={value!r} is not allowed; expected {hint.__name__}") from None
    return value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    value without a word: `lr: 0.001` then `lr: 0.5` trains at 0.5)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise HLMError(
                    f"{self.name}: key {key!r} is given twice (lines {seen[key]} and {line}); "
                    "keep one"
                )
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path, text: str) -> Any:
    """The YAML document `text` (read from `path`, named in errors): a key given twice, or text
    that is not YAML, raises `HLMError` naming the line and column (a tab in the indentation
    says so)."""
    loader = _UniqueKeyLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = err.problem or err.context or "not YAML"
        hint = "; indent with spaces, not tabs" if "'\\t'" in what else ""
        raise HLMError(f"config file {path} is not valid YAML{where}: {what}{hint}") from None
    except yaml.YAMLError as err:
        raise HLMError(f"config file {path} is not valid YAML: {err}".splitlines()[0]) from None
    finally:
        loader.dispose()


def apply_overrides(cfg: C, overrides: list[str] | dict[str, Any]) -> C:
    """Apply dotted overrides (``optim.lr=3e-4`` strings or a ``{"optim.lr": 3e-4}`` dict) to a
    `Config`; the result is parsed and checked again (`Config.from_dict`)."""
    items = overrides.items() if isinstance(overrides, dict) else map(_split_override, overrides)
    data = cfg.to_dict()
    for key, value in items:
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise HLMError(f"unknown config field {key}; sections: {', '.join(data)}")
            node = node[part]
        if leaf not in node:
            raise HLMError(f"unknown config field {key}; allowed: {', '.join(sorted(node))}")
        node[leaf] = yaml.safe_load(value) if isinstance(value, str) else value
    return type(cfg).from_dict(data)


def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise HLMError(f"override {text!r} must look like section.field=value, e.g. optim.lr=3e-4")
    return key.strip(), value.strip()


def flatten(data: dict[str, Any], prefix: str = ""):
    """Nested dict -> (dotted key, value) pairs."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
