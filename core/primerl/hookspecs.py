"""The public plugin contract: one register-callback hook per kind of component.

A plugin is a module named by an entry point in the ``primerl`` group. It implements
any of the hooks below with ``@primerl.hookimpl`` and calls ``register`` once per
component it provides::

    from primerl import hookimpl

    @hookimpl
    def register_envs(register):
        register("my-env", "my_pkg.env:MyEnv", description="what it trains")

``target`` is the component itself (a class or factory) or a lazy ``"module:attr"``
string. Prefer the string: ``primerl plugins list`` and ``primerl --help`` then never
import the component's module, so torch, transformers or vLLM stay unloaded until a
run selects it.

``capabilities`` declares what the component offers beyond its kind's Protocol, as the
kind's typed record (:class:`primerl.kv_stores.KVStoreCapabilities` for a KV store);
omitted, the record's defaults hold. The core and other plugins read it from the
registry (``Registry.capabilities(kind, name)``) without importing the component, so
config checks and launchers can ask before anything heavy loads.

Keep this module stable: third parties code against exactly these names and signatures.
"""

from __future__ import annotations

from typing import Any, Protocol

from primerl._markers import hookspec

__all__ = ["Register", "register_advantages", "register_checkpoints", "register_corrections", "register_envs",
           "register_inference_backends", "register_kv_stores", "register_launchers", "register_losses",
           "register_models", "register_monitors", "register_parallelisms", "register_routers"]


class Register(Protocol):
    """The callback each hook receives."""

    def __call__(self, name: str, target: Any, *, description: str = "", capabilities: Any = None) -> None: ...


@hookspec
def register_models(register: Register) -> None:
    """Register model adapters (architecture, presets, checkpoint layout, MoE/R3 hooks)."""


@hookspec
def register_checkpoints(register: Register) -> None:
    """Register checkpoints that installed packages carry, by name: the target is a
    :class:`primerl.models.sources.PackagedCheckpoint` (the distribution, the file or folder
    inside it, the model plugin that runs it). ``--model.checkpoint NAME`` then needs no
    machine path; ``primerl models list`` shows them."""


@hookspec
def register_envs(register: Register) -> None:
    """Register environments (tasks and rewards: single-turn, multi-turn, tool use)."""


@hookspec
def register_routers(register: Register) -> None:
    """Register request routers placed in front of several inference servers."""


@hookspec
def register_kv_stores(register: Register) -> None:
    """Register KV-cache stores (memory, disk, Mooncake...)."""


@hookspec
def register_parallelisms(register: Register) -> None:
    """Register trainer parallelism strategies (FSDP2, expert parallel, context parallel).

    The target is a class whose instances implement :class:`primerl.parallel.Parallelism`;
    ``trainer.parallelism`` selects one by name (default ``single``).
    """


@hookspec
def register_losses(register: Register) -> None:
    """Register RL losses, selected by ``trainer.loss``.

    The target, called with ``trainer.loss_options`` as keywords, returns a
    :class:`primerl.algorithms.Loss`.
    """


@hookspec
def register_corrections(register: Register) -> None:
    """Register off-policy corrections, selected by ``trainer.correction``.

    The target, called with ``trainer.correction_options`` as keywords, returns a
    :class:`primerl.algorithms.Correction`.
    """


@hookspec
def register_advantages(register: Register) -> None:
    """Register advantage estimators, selected by ``orchestrator.advantage``.

    The target, called with ``orchestrator.advantage_options`` as keywords, returns a
    :class:`primerl.algorithms.Advantage` (a batch's groups of rewards in, advantages out).
    """


@hookspec
def register_monitors(register: Register) -> None:
    """Register monitors, switched on by ``[monitors.<name>]`` tables (several at once).

    The target is a class, instantiated with its options (its ``Config``, a subclass of
    :class:`primerl.monitors.MonitorConfig`), satisfying :class:`primerl.monitors.Monitor`:
    each trainer step's metrics record, and a few rollouts every ``samples_every`` steps.
    """


@hookspec
def register_inference_backends(register: Register) -> None:
    """Register inference backends (the embedded engine, vLLM...)."""


@hookspec
def register_launchers(register: Register) -> None:
    """Register launchers that start the processes of a run (local, Slurm...)."""
