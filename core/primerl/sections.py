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
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import attrs

from primerl.errors import ConfigError, PluginError
from primerl.structuring import origin_of

__all__ = ["config_class", "declared_config", "section_class"]


def config_class(registry: Any, kind: str, name: str, base: type, *, label: str) -> type:
    """The ``Config`` class plugin ``name`` of ``kind`` declares (``base`` or a subclass). ``label`` says where the name was given ("inference.backend = 'vllm' (from
    the command line)"): a plugin that does not load is a ConfigError starting with it."""
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
    section, _, field = key.partition(".")
    table = raw.get(section, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"'{section}' must be a table ({origin_of(sources, section)})")
    name = table.get(field, attrs.fields_dict(base)[field].default)
    if not isinstance(name, str):
        raise ConfigError(f"{key} = {name!r} ({origin_of(sources, key)}) must be a string: the name of an "
                          f"installed {kind} plugin (primerl plugins list)")
    return config_class(registry, kind, name, base, label=f"{key} = {name!r} ({origin_of(sources, key)})")
