"""Which class checks each config section: the selected plugin's ``Config``.

Every plugin of a kind with a config section declares ``Config`` on what it registers (the
kind's Protocol or base class says so): the section class its contract owns, or a subclass
of it with the plugin's own options: a model's of :class:`primerl.models.ModelConfig`
(``[model]``), an environment's of :class:`primerl.envs.EnvConfig` (``[env]`` and every
source's ``env`` table), an inference backend's of :class:`primerl.inference.InferenceConfig`
(``[inference]``), a launcher's of :class:`primerl.launchers.LauncherConfig` (``[launcher]``),
a monitor's of :class:`primerl.monitors.MonitorConfig` (``[monitors.<name>]``).
:func:`declared_config` is the one place that reads it, for every kind (a plugin that
lacks it is a ConfigError naming the plugin and the line to add); the loader
(:mod:`primerl.config`) then structures the section's table with the class it returns, so a
third-party plugin gets the same checks and error messages as the core's sections.

A section's table is fitted to that class first (:func:`fit_section`): an env's run defaults
are suggestions, so a key of theirs the selected plugin's ``Config`` lacks (the embedded
engine's ``kv_slots`` under the vllm backend) is dropped, while the same key from a file or
a flag is an error that names the installed plugin whose section has it.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import attrs

from primerl.errors import ConfigError, PluginError
from primerl.structuring import origin_of

__all__ = ["chosen_plugin", "config_class", "declared_config", "fit_section", "section_class"]


def config_class(registry: Any, kind: str, name: str, base: type, *, label: str) -> type:
    """The ``Config`` class plugin ``name`` of ``kind`` declares (``base`` or a subclass).
    ``label`` says where the name was given ("inference.backend = 'vllm' (from the command
    line)"): a plugin that does not load is a ConfigError starting with it."""
    try:
        target = registry.load(kind, name)
    except PluginError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    return declared_config(target, kind, name, base)


def declared_config(target: Any, kind: str, name: str, base: type) -> type:
    """The ``Config`` class the loaded component ``target`` (plugin ``name`` of ``kind``)
    declares: ``base`` or a subclass of it. One that declares none, or something else, is a
    ConfigError saying what to set."""
    try:
        cls = target.Config
    except AttributeError:
        what = (f"{target.__module__}:{target.__qualname__}" if isinstance(target, (type, types.FunctionType))
                else repr(target))
        raise ConfigError(f"{kind} plugin '{name}' ({what}) declares no Config: set Config = "
                          f"{base.__module__}.{base.__qualname__} on it (or a subclass with the plugin's own keys); "
                          f"fix the plugin") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{kind} plugin '{name}' declares Config={cls!r}, which is not a subclass of "
                          f"primerl's {base.__name__}; fix the plugin")
    return cls


def section_class(raw: Mapping[str, Any], sources: Mapping[str, str], registry: Any, key: str, kind: str,
                  base: type) -> type:
    """The class that checks the section of ``key`` (``section.field`` naming a plugin of
    ``kind``, e.g. ``inference.backend``) in the merged table ``raw``: the named plugin's
    ``Config`` (``base``'s default names the plugin when the key is not set)."""
    name = chosen_plugin(raw, sources, key, kind, base)
    return config_class(registry, kind, name, base, label=f"{key} = {name!r} ({origin_of(sources, key)})")


def chosen_plugin(raw: Mapping[str, Any], sources: Mapping[str, str], key: str, kind: str, base: type) -> str:
    """The name of the ``kind`` plugin ``key`` (``section.field``) selects in ``raw``: its
    value, else ``base``'s default for it."""
    section, _, field = key.partition(".")
    table = raw.get(section, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"'{section}' must be a table ({origin_of(sources, section)})")
    name = table.get(field, attrs.fields_dict(base)[field].default)
    if not isinstance(name, str):
        raise ConfigError(f"{key} = {name!r} ({origin_of(sources, key)}) must be a string: the name of an "
                          f"installed {kind} plugin (primerl plugins list)")
    return name


def fit_section(raw: dict[str, Any], sources: dict[str, str], suggested: set[str], registry: Any, key: str,
                kind: str, base: type, cls: type) -> None:
    """Fit the section of ``key`` in ``raw`` to ``cls``, the selected plugin's ``Config``.

    A key ``cls`` lacks that only suggestions set (``suggested``: key paths an env's run
    defaults gave and no file or flag did) is dropped with its origin: the env suggested it
    for another plugin (the embedded engine's ``kv_slots`` under the vllm backend). One the
    user gave that another installed plugin of ``kind`` has is one line naming that plugin;
    any other stays, for :func:`primerl.structuring.structure` to refuse as unknown."""
    section = key.partition(".")[0]
    table = raw.get(section)
    if not isinstance(table, dict):
        return
    fields, name = attrs.fields_dict(cls), chosen_plugin(raw, sources, key, kind, base)
    for field in [f for f in table if f not in fields]:
        path = f"{section}.{field}"
        given = [p for p in sources if p == path or p.startswith(path + ".")]
        if given and all(p in suggested for p in given):
            del table[field]
            for p in given:
                del sources[p]
            continue
        owners = _owners(registry, kind, base, field, name)
        if owners:
            raise ConfigError(f"unknown key '{path}' ({origin_of(sources, path)}): {key} {name!r} "
                              f"({origin_of(sources, key)}) has no such key; it belongs to the section of {kind} "
                              f"{' and '.join(repr(o) for o in owners)} (drop it, or set {key} = {owners[0]!r})")


def _owners(registry: Any, kind: str, base: type, field: str, chosen: str) -> list[str]:
    """The installed ``kind`` plugins other than ``chosen`` whose ``Config`` has ``field``
    (read only to name them in an error: one that does not load is left out)."""
    out = []
    for c in registry.of_kind(kind):
        if c.error is not None or c.name == chosen:
            continue
        try:
            cls = declared_config(c.load(), kind, c.name, base)
        except (ConfigError, PluginError):
            continue
        if field in attrs.fields_dict(cls):
            out.append(c.name)
    return out
