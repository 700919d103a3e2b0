"""One strict, typed loader for every config: proposer configs, eval configs, training recipes.

A config is a mapping (a dict, or a YAML file holding one) whose keys are the parameters
of a *schema*: a dataclass (nested dataclasses are sections), or a constructor with
annotated parameters (proposers take plain values, so their config is their signature,
never a copy of it). ``build`` checks every key against the schema: an unknown key fails
with the list of valid ones, a missing required key fails, and a value of the wrong type
fails, each in one line that names the key. ``key=value`` / ``section.key=value``
overrides apply on top of a file (values parsed as YAML).

It lives in the shared runtime so that the proposers, ``verify`` and ``training`` all use it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import ConfigError
from .files import read_text


def resolve_type(values: Mapping[str, Any], registry: Mapping[str, str | type], what: str):
    """The class that ``values["type"]`` names in ``registry`` (``"module:Class"`` strings are imported)."""
    kind = values.get("type")
    if kind not in registry:
        raise ConfigError(f"unknown {what} type {kind!r}; available: {sorted(registry)}")
    entry = registry[kind]
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = getattr(importlib.import_module(module), name)
    return entry


# --- reading -----------------------------------------------------------------------


def read_yaml(path: str | Path, what: str = "config") -> dict[str, Any]:
    """The mapping in a YAML file; a missing file, a syntax error or a non-mapping is one line naming the file."""
    path = Path(path)
    text = read_text(path, what)
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{what} {path} is not valid YAML{at}: {problem}") from None
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of keys, got {type(values).__name__}")
    return values


def read_config(config: Mapping[str, Any] | str | Path, what: str = "config") -> dict[str, Any]:
    """The config mapping, read from YAML when given a path."""
    if isinstance(config, (str, Path)):
        return read_yaml(config, what)
    if not isinstance(config, Mapping):
        raise ConfigError(f"{what} must be a mapping or a YAML path, got {type(config).__name__}")
    return dict(config)


def apply_overrides(values: Mapping[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """``values`` with ``key=value`` / ``section.key=value`` strings applied (values parsed as YAML)."""
    values = dict(values)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: the value is not valid YAML") from None
        parts = key.strip().split(".")
        if not all(part.strip() for part in parts):
            raise ConfigError(f"override {item!r}: {key.strip()!r} is not a key (key=value, or section.key=value)")
        *sections, last = (part.strip() for part in parts)
        node = values
        for section in sections:
            child = node.get(section)
            node[section] = child = dict(child) if isinstance(child, Mapping) else {}
            node = child
        node[last] = value
    return values


def load(schema, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), what: str = "config"):
    """Read a YAML file (None: no file, the defaults), apply overrides, build ``schema`` from it."""
    values = read_yaml(path, what) if path is not None else {}
    where = f"{what} {path}" if path is not None else what
    values = apply_overrides(values, overrides)
    valid = list(schema_parameters(schema))
    for item in overrides:  # name the override itself, not only the key it made (``a.b=1`` makes ``a``)
        first = item.partition("=")[0].split(".")[0].strip()
        if first not in valid:
            raise ConfigError(f"{where}: override {item!r} sets unknown key {first!r}; valid keys: {valid}")
    return build(schema, values, where)


# --- building ----------------------------------------------------------------------


def build(schema, values: Mapping[str, Any], where: str = "config", inject: Mapping[str, Any] | None = None, prefix: str = ""):
    """Call ``schema`` (a dataclass or an annotated callable) with ``values`` checked against its parameters.

    Args:
        schema: a dataclass, or a class / function whose parameters are annotated.
        values: key -> value, as read from YAML.
        where: what the values come from, for messages ("proposer type 'ngram'", a file).
        inject: arguments supplied by the caller, not by the config (e.g. ``target``):
            passed when the schema takes them, and never accepted as config keys.
        prefix: dotted path of this section, for messages.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the config'} must be a mapping of keys, got {values!r}")
    params = schema_parameters(schema)
    injected = {k: v for k, v in (inject or {}).items() if k in params}
    settable = [name for name in params if name not in (inject or {})]
    unknown = sorted(str(k) for k in set(values) - set(settable))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {[prefix + k for k in unknown]}; valid keys: {[prefix + k for k in settable]}")
    missing = [prefix + k for k in settable if params[k][1] is REQUIRED and k not in values]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}")
    checked = {key: check_value(value, params[key][0], prefix + key, where) for key, value in values.items()}
    try:
        return schema(**checked, **injected)
    except ConfigError:
        raise
    except ValueError as err:  # a constructor's own range checks name the argument (a TypeError there is a bug)
        raise ConfigError(f"{where}: {err}") from None


REQUIRED = inspect.Parameter.empty


def schema_parameters(schema) -> dict[str, tuple[Any, Any]]:
    """name -> (type hint, default or ``REQUIRED``) of a dataclass's fields or a callable's parameters."""
    if dataclasses.is_dataclass(schema):
        hints = typing.get_type_hints(schema)
        out = {}
        for f in dataclasses.fields(schema):
            if not f.init:
                continue
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            out[f.name] = (hints[f.name], None if has_default else REQUIRED)
        return out
    init = schema.__init__ if inspect.isclass(schema) else schema
    hints = typing.get_type_hints(init)
    out = {}
    for name, param in inspect.signature(schema).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        out[name] = (hints.get(name, Any), param.default)
    return out


def check_value(value, hint, name: str, where: str = "config"):
    """``value`` checked against the type ``hint`` (converted where YAML is loose: 1 for 1.0, "1e-3"); else ConfigError."""
    try:
        return _check(value, hint, name, where)
    except _Mismatch:
        raise ConfigError(f"{where}: key {name!r}: expected {describe(hint)}, got {value!r}") from None


class _Mismatch(Exception):
    pass


def _check(value, hint, name: str, where: str):
    if hint is Any or hint is object:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        for option in sorted(args, key=lambda a: a is str):  # str last: "1e-3" should read as a float first
            try:
                return _check(value, option, name, where)
            except _Mismatch:
                continue
        raise _Mismatch
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ConfigError(f"{where}: key {name!r}: {value!r} is not one of {list(args)}")
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise _Mismatch
        return build(hint, value, where, prefix=name + ".")
    if origin in (list, tuple):
        if isinstance(value, str) and args and args[0] is str:
            value = [value]  # a single path is a list of one
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        item = args[0] if args else Any
        items = [_check(v, item, f"{name}[{i}]", where) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _Mismatch
        key_hint, value_hint = args if args else (Any, Any)
        return {_check(k, key_hint, name, where): _check(v, value_hint, f"{name}.{k}", where) for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if hint is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise _Mismatch
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    return value  # an unusual annotation (a TypeVar, a string that did not resolve): not checked


def describe(hint) -> str:
    """A type hint in words for messages: ``int``, ``float or None``, ``list of str``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(describe(a) for a in args)
    if hint is type(None):
        return "None"
    if origin is Literal:
        return f"one of {list(args)}"
    if origin in (list, tuple):
        return f"a list of {describe(args[0])}" if args else "a list"
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return "a mapping"
    if dataclasses.is_dataclass(hint):
        return f"a mapping of {hint.__name__} keys"
    return getattr(hint, "__name__", str(hint))
