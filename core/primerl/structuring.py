"""Config tables into attrs classes, every error naming the key and where its value came from.

The loader (:mod:`primerl.config`) merges TOML files and command-line flags into one nested
table and remembers, per key path, its origin (``'base.toml'``, ``the command line
(--trainer.lr)``, an env's run defaults). :func:`structure` turns a table into the attrs
class of its section, checking keys (unknown ones get a close match), types
(:func:`convert`) and the fields' validators; each failure is a ConfigError of one line:
the key path, :func:`origin_of` it, and what is allowed. Sections, the plugin-section
resolver and the preflight use the same helpers, so every config error reads the same.
A leaf: imports attrs and :mod:`primerl.errors` only.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import attrs

from primerl.errors import ConfigError

__all__ = ["MOVED_KEYS", "convert", "first_origin_under", "origin_of", "origin_under", "structure"]


_LAST_PART = re.compile(r"(\.[^.\[\]]*|\[\d+\])$")  # ".key" or "[i]" at the end of a key path


def origin_of(sources: Mapping[str, str], path: str) -> str:
    """Where the value at ``path`` came from: its own origin, else that of the nearest table
    or list it sits in (``orchestrator.sources[0].name`` inside a list a file gave), else
    the defaults."""
    while path and path not in sources:
        last = _LAST_PART.search(path)
        path = path[:last.start()] if last else ""
    return f"from {sources[path]}" if path else "from the defaults"


def first_origin_under(sources: Mapping[str, str], prefix: str) -> str | None:
    for k, v in sources.items():
        if k.startswith(prefix + "."):
            return v
    return None


def origin_under(sources: Mapping[str, str], prefix: str) -> str:
    where = sources.get(prefix) or first_origin_under(sources, prefix)
    return f"from {where}" if where else "from the defaults"


# keys that became a component's options: the error names where they went
MOVED_KEYS = {
    "trainer.kl_coef": "the default loss's trainer.loss_options.kl_tau",
    "trainer.mask_threshold": "the default loss's trainer.loss_options.dppo_mask_low and dppo_mask_high",
}


def structure(cls: type, data: Any, path: str, sources: Mapping[str, str]) -> Any:
    where = path or "the top level"
    if not isinstance(data, Mapping):
        raise ConfigError(f"'{where}' must be a table, got {type(data).__name__} ({origin_of(sources, path)})")
    fields = {f.name: f for f in attrs.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            full = f"{path}.{key}" if path else key
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            if full in MOVED_KEYS:
                hint = f" It is now {MOVED_KEYS[full]}."
            origin = sources.get(full) or first_origin_under(sources, full)
            raise ConfigError(
                f"unknown key '{full}' ({'from ' + origin if origin else 'no source'}).{hint} "
                f"Allowed keys in '{where}': {', '.join(fields)}"
            )
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        kwargs[key] = convert(hints[key], value, full, sources)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        bad = _which_field(exc, kwargs, fields)
        full = f"{path}.{bad}" if path and bad else (bad or where)
        reason = str(exc.args[0]) if exc.args else str(exc)
        if bad and reason.startswith(f"{bad}:"):
            reason = reason[len(bad) + 1 :].strip()
        raise ConfigError(f"invalid value for '{full}' ({origin_of(sources, full)}): {reason}") from None




def _which_field(exc: Exception, kwargs: Mapping[str, Any], fields: Mapping[str, Any] = {}) -> str | None:
    """The field a validator rejected: attrs' own validators pass the Attribute in the
    exception's args; ours start their message with "name:" (a default that must be set
    names a field missing from kwargs)."""
    for arg in exc.args:
        if isinstance(arg, attrs.Attribute):
            return arg.name
    text = str(exc.args[0]) if exc.args else ""
    for key in [*kwargs, *fields]:
        if text.startswith(f"{key}:"):
            return key
    return next(iter(kwargs), None) if len(kwargs) == 1 else None


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "nothing (omit the key)"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def convert(tp: Any, value: Any, path: str, sources: Mapping[str, str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def fail(expected: str) -> ConfigError:
        return ConfigError(
            f"'{path}' must be {expected}, got {value!r} ({type(value).__name__}, {origin_of(sources, path)})"
        )

    if attrs.has(tp):
        return structure(tp, value, path, sources)
    if origin in (Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args):
            return None
        errors = []
        for a in non_none:
            try:
                return convert(a, value, path, sources)
            except ConfigError as exc:
                errors.append(exc)
        raise fail(" or ".join(_type_name(a) for a in non_none))
    if origin is Literal:
        if value not in args:
            raise fail("one of " + ", ".join(repr(a) for a in args))
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise fail(f"a list of {_type_name(args[0]) if args else 'values'}")
        item = args[0] if args else Any
        return [convert(item, v, f"{path}[{i}]", sources) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise fail("a table")
        return {k: convert(args[1], v, f"{path}.{k}", sources) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail("an integer")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise fail("a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail("a string")
    return value
