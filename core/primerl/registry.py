"""Plugin discovery and the component registry.

Plugins are modules named by entry points in the ``primerl`` group. Discovery imports
each plugin module (which must be light) and calls its ``register_*`` hooks one
implementation at a time, so that a plugin that fails to import, has a wrong hook
signature or raises inside a hook is *recorded* with its error instead of breaking
discovery: ``primerl plugins list`` always works, and a run fails only if it selects
a broken component.

Components are registered by kind and name with a target that is either the object
itself or a lazy ``"module:attr"`` string, resolved only by :meth:`Component.load`.

Environment variables, as pytest and llm offer:

* ``PRIMERL_PLUGINS``: comma-separated allow-list of plugins (entry-point or
  distribution names); when set, only those load. Set it empty to load none.
* ``PRIMERL_DISABLE_PLUGINS``: comma-separated deny-list, applied after the allow-list.

When two plugins register the same kind and name, selecting the bare name is an error
naming both distributions; pick one with ``PLUGIN:NAME`` (e.g. ``--model acme:glm5``)
or disable the other with ``PRIMERL_DISABLE_PLUGINS``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import importlib.util
import inspect
import os
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import pluggy

from primerl import hookspecs
from primerl._markers import PROJECT
from primerl.errors import PluginError

__all__ = ["KINDS", "Component", "PluginSource", "Registry", "get_registry", "is_target", "load_target"]

ENTRY_POINT_GROUP = "primerl"

# hook name -> kind (the singular used in listings, config and errors)
HOOK_KINDS: dict[str, str] = {
    "register_models": "model",
    "register_checkpoints": "checkpoint",
    "register_envs": "env",
    "register_routers": "router",
    "register_kv_stores": "kv_store",
    "register_parallelisms": "parallelism",
    "register_inference_backends": "inference_backend",
    "register_launchers": "launcher",
    "register_losses": "loss",
    "register_corrections": "correction",
    "register_advantages": "advantage",
    "register_monitors": "monitor",
}
KINDS: tuple[str, ...] = tuple(HOOK_KINDS.values())


def _normalize(name: str) -> str:
    """PEP 503 normalisation, so 'Primerl_GLM5' and 'primerl-glm5' match."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {_normalize(p) for p in raw.split(",") if p.strip()}


@attrs.frozen
class Component:
    """One registered component (or a broken plugin's placeholder row)."""

    kind: str | None
    name: str
    target: Any
    plugin: str
    distribution: str | None = None
    version: str | None = None
    description: str = ""
    error: str | None = None
    duplicate: bool = False  # error is only "another plugin has this name": a qualified pick works
    capabilities: Any = None  # the kind's capabilities record as registered (None: the record's defaults)

    @property
    def status(self) -> str:
        return "ok" if self.error is None else "error"

    @property
    def qualified_name(self) -> str:
        return f"{self.plugin}:{self.name}"

    def load(self) -> Any:
        """Resolve the target, importing its module if it was registered lazily."""
        if self.error is not None:
            raise PluginError(
                f"{self.kind} '{self.name}' from plugin '{self.plugin}'"
                f"{_dist_suffix(self)} is broken: {self.error}"
            )
        if not isinstance(self.target, str):
            return self.target
        try:
            return load_target(self.target)
        except Exception as exc:
            raise PluginError(
                f"{self.kind} '{self.name}' from plugin '{self.plugin}'{_dist_suffix(self)} "
                f"could not load its target '{self.target}': {type(exc).__name__}: {exc}. "
                f"Reinstall the plugin or its dependencies, or disable it with "
                f"PRIMERL_DISABLE_PLUGINS={self.plugin}."
            ) from exc

    def as_row(self) -> dict[str, Any]:
        """The JSON shape of ``primerl plugins list --json``."""
        return {
            "kind": self.kind,
            "name": self.name,
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "description": self.description,
            "error": self.error,
        }


def is_target(text: str) -> bool:
    """Whether ``text`` names an object as ``"module:attr"`` (``"wordle"`` and
    ``"plugin:name"`` picks are told apart by the caller: see :func:`load_target`)."""
    module, sep, attr = text.partition(":")
    return bool(sep and module and attr)


def load_target(target: str) -> Any:
    """The object a lazy ``"module:attr"`` target names (``attr`` may be dotted).

    The one resolver for such strings: registered components, losses, advantages and model
    classes all go through it. Import errors propagate; callers wrap them with context.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{target!r} is not a 'module:attr' target")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _dist_suffix(c: Component) -> str:
    return f" (distribution {c.distribution} {c.version})" if c.distribution else ""


@attrs.frozen
class PluginSource:
    """A plugin to load: an entry point from an installed distribution, or an object."""

    name: str
    distribution: str | None
    version: str | None
    entry_point: md.EntryPoint | None = None
    obj: Any = None


def installed_sources() -> list[PluginSource]:
    sources = []
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        sources.append(
            PluginSource(
                name=ep.name,
                distribution=dist.name if dist else None,
                version=dist.version if dist else None,
                entry_point=ep,
            )
        )
    return sources


def _kinds_by_source(module_name: str) -> list[str]:
    """Which hooks a module implements, read from its source without importing it.

    Used only for plugins whose import failed, so their error row has a real kind.
    """
    try:
        spec = importlib.util.find_spec(module_name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return []
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except Exception:  # noqa: BLE001 - best effort
        return []
    found = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return [HOOK_KINDS[h] for h in HOOK_KINDS if h in found]


class Registry:
    """All components by kind and name, plus the errors met while discovering them."""

    def __init__(self, components: Iterable[Component] = ()):
        self.components: list[Component] = list(components)

    # ---- discovery -------------------------------------------------------------
    @classmethod
    def discover(cls, extra: Iterable[Any] = (), *, installed: bool = True) -> Registry:
        """Load installed plugins (and ``extra`` in-process plugin objects)."""
        sources = installed_sources() if installed else []
        for obj in extra:
            name = getattr(obj, "__name__", type(obj).__name__)
            sources.append(PluginSource(name=name, distribution=None, version=None, obj=obj))

        allow, deny = _env_list("PRIMERL_PLUGINS"), _env_list("PRIMERL_DISABLE_PLUGINS")

        def selected(s: PluginSource) -> bool:
            keys = {_normalize(s.name)} | ({_normalize(s.distribution)} if s.distribution else set())
            if allow is not None and not keys & allow:
                return False
            return not (deny and keys & deny)

        reg = cls()
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(hookspecs)
        for source in sources:
            if selected(source):
                reg._load_source(pm, source)
        reg._mark_duplicates()
        return reg

    def _broken(self, source: PluginSource, kinds: list[str], error: str) -> None:
        # kind is None only when the module cannot even be located: nothing to read.
        for kind in kinds or [None]:
            self.components.append(
                Component(kind=kind, name=source.name, target=None, plugin=source.name,
                          distribution=source.distribution, version=source.version, error=error)
            )

    def _load_source(self, pm: pluggy.PluginManager, source: PluginSource) -> None:
        module_name = source.entry_point.value.split(":")[0] if source.entry_point else ""
        try:
            plugin = source.entry_point.load() if source.entry_point else source.obj
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            kinds = _kinds_by_source(module_name)
            self._broken(source, kinds, f"import failed: {type(exc).__name__}: {exc}")
            return
        try:
            pm.register(plugin, name=f"{source.name}#{id(plugin)}")
        except Exception as exc:  # noqa: BLE001 - PluginValidationError and friends
            kinds = _hook_kinds(plugin)
            self._broken(source, kinds, f"invalid hook implementation: {exc}")
            return
        unknown = [
            name for name in _hookimpl_names(plugin) if name not in HOOK_KINDS
        ]
        if unknown:
            pm.unregister(plugin)
            known = ", ".join(HOOK_KINDS)
            kinds = _hook_kinds(plugin)
            self._broken(source, kinds, f"implements unknown hook(s) {', '.join(unknown)}; known hooks: {known}")
            return
        for hook_name, kind in HOOK_KINDS.items():
            for impl in vars(pm.hook)[hook_name].get_hookimpls():
                if impl.plugin is plugin:
                    self._call_hook(source, kind, impl)

    def _call_hook(self, source: PluginSource, kind: str, impl: Any) -> None:
        def register(name: str, target: Any, *, description: str = "", capabilities: Any = None) -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"register() needs a non-empty name string, got {name!r}")
            if isinstance(target, str) and ":" not in target:
                raise TypeError(f"lazy target for '{name}' must look like 'module:attr', got {target!r}")
            record = capabilities_record(kind)
            if capabilities is not None and (record is None or not isinstance(capabilities, record)):
                want = f"a {record.__module__}.{record.__qualname__}" if record else "none (this kind declares no record)"
                raise TypeError(f"capabilities of {kind} '{name}' must be {want}, got {type(capabilities).__name__}")
            self.components.append(
                Component(kind=kind, name=name, target=target, plugin=source.name,
                          distribution=source.distribution, version=source.version,
                          description=description or _first_doc_line(target), capabilities=capabilities)
            )

        try:
            impl.function(**{arg: register for arg in impl.argnames})
        except Exception as exc:  # noqa: BLE001
            self._broken(source, [kind], f"{impl.function.__name__} raised {type(exc).__name__}: {exc}")

    def _mark_duplicates(self) -> None:
        by_key: dict[tuple[str, str], list[int]] = {}
        for i, c in enumerate(self.components):
            if c.error is None:
                by_key.setdefault((c.kind, c.name), []).append(i)
        for (kind, name), idx in by_key.items():
            if len(idx) < 2:
                continue
            owners = [self.components[i] for i in idx]
            who = " and ".join(f"plugin '{c.plugin}'{_dist_suffix(c)}" for c in owners)
            msg = (f"{kind} '{name}' is registered by {who}; pick one with "
                   f"'{owners[0].plugin}:{name}' or disable the other with PRIMERL_DISABLE_PLUGINS")
            for i in idx:
                self.components[i] = attrs.evolve(self.components[i], error=msg, duplicate=True)

    # ---- lookup ----------------------------------------------------------------
    def of_kind(self, kind: str) -> list[Component]:
        return [c for c in self.components if c.kind == kind]

    def find(self, kind: str, name: str) -> Component:
        """Select one component by ``NAME`` or ``PLUGIN:NAME`` (plugin or distribution)."""
        if kind not in KINDS:
            raise PluginError(f"unknown component kind '{kind}'; kinds are {', '.join(KINDS)}")
        plugin, _, bare = name.rpartition(":")
        candidates = [c for c in self.of_kind(kind) if c.name == bare]
        if plugin:
            key = _normalize(plugin)
            candidates = [
                c for c in candidates
                if key in {_normalize(c.plugin), _normalize(c.distribution or "")}
            ]
            candidates = [attrs.evolve(c, error=None, duplicate=False) if c.duplicate else c
                          for c in candidates]
        if not candidates:
            available = sorted({c.name for c in self.of_kind(kind) if c.error is None})
            hint = ", ".join(available) if available else "none installed"
            raise PluginError(
                f"no {kind} named {name!r}. Available: {hint}. "
                f"Run 'primerl plugins list' to see every plugin and its status."
            )
        if len(candidates) > 1:
            raise PluginError(candidates[0].error or f"{kind} {name!r} is ambiguous")
        chosen = candidates[0]
        if chosen.error:
            raise PluginError(
                f"{kind} '{name}' from plugin '{chosen.plugin}'{_dist_suffix(chosen)} "
                f"is unavailable: {chosen.error}"
            )
        return chosen

    def load(self, kind: str, name: str) -> Any:
        return self.find(kind, name).load()

    def capabilities(self, kind: str, name: str) -> Any:
        """What the ``kind`` component ``name`` declared at registration, as the kind's
        capabilities record (its defaults when it declared nothing); imports nothing of it."""
        declared = self.find(kind, name).capabilities
        if declared is not None:
            return declared
        record = capabilities_record(kind)
        return record() if record is not None else None


def capabilities_record(kind: str) -> type | None:
    """The typed record a component of ``kind`` may declare its capabilities with."""
    if kind == "kv_store":
        from primerl.kv_stores import KVStoreCapabilities

        return KVStoreCapabilities
    if kind == "launcher":
        from primerl.launchers import LauncherCapabilities

        return LauncherCapabilities
    if kind == "inference_backend":
        from primerl.inference import InferenceBackendCapabilities

        return InferenceBackendCapabilities
    if kind == "parallelism":
        from primerl.parallel import ParallelismCapabilities

        return ParallelismCapabilities
    if kind == "monitor":
        from primerl.monitors import MonitorCapabilities

        return MonitorCapabilities
    return None


def _hook_kinds(plugin: Any) -> list[str]:
    """The kinds whose hook ``plugin`` defines a name for (a broken plugin's rows)."""
    names = set(dir(plugin))
    return [k for h, k in HOOK_KINDS.items() if h in names]


def target_text(target: Any) -> str:
    """A component's target as ``module:attr`` (a lazy target: as registered)."""
    if isinstance(target, str):
        return target
    if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return f"{target.__module__}:{target.__qualname__}"
    return f"{type(target).__module__}:{target!r}"


def _hookimpl_names(plugin: Any) -> list[str]:
    names = []
    for attr in dir(plugin):
        try:
            value = getattr(plugin, attr)
        except Exception:  # noqa: BLE001
            continue
        if inspect.isroutine(value) and hasattr(value, f"{PROJECT}_impl"):
            names.append(attr)
    return names


def _first_doc_line(target: Any) -> str:
    if isinstance(target, str):
        return ""
    doc = inspect.getdoc(target) or ""
    return doc.splitlines()[0] if doc else ""


_REGISTRY: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry of installed plugins, discovered once."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        _REGISTRY = Registry.discover()
    return _REGISTRY


def options_problem(kind: str, name: str, options: Mapping[str, Any]) -> str | None:
    """Why ``options`` do not fit the constructor of plugin ``name`` of ``kind`` (None: they
    do), without building it: unknown or missing keywords are config errors, found before a
    run starts (``inference.router_options``, ``inference.kv_store_options``)."""
    target = get_registry().load(kind, name)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # nothing to read (a builtin): the plugin checks its own options
        return None
    try:
        signature.bind(**dict(options))
    except TypeError as exc:
        params = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        return f"{exc} ({kind} {name!r} takes: {', '.join(params) or 'no options'})"
    return None


def resolve_component(kind: str, name: str, config_key: str) -> Callable:
    """The component of ``kind`` registered as ``name`` (or ``PLUGIN:NAME``), else the
    function a ``"module:attr"`` string names. Errors list what is registered."""
    try:
        return get_registry().load(kind, name)
    except PluginError as exc:
        if not is_target(name):
            raise PluginError(f"{config_key}: {exc} Or give a function as 'module:attr'.") from None
        not_registered = exc
    try:
        obj = load_target(name)
    except (ImportError, AttributeError) as exc:
        raise PluginError(
            f"{config_key} {name!r} could not be loaded as 'module:attr' ({type(exc).__name__}: {exc}), "
            f"nor is it a registered {kind}: {not_registered}"
        ) from None
    if not callable(obj):
        raise PluginError(f"{config_key} {name!r} is not callable")
    return obj
