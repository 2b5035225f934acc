"""The public API: the core modules a plugin may import, and nothing else.

A plugin (built in or third party) codes against these modules and, in each, only the names
its ``__all__`` lists; every other core module is the core's own and may change without notice.
They are the contracts a plugin implements or calls: the hook markers and errors, the registry,
each kind's contract module with its config section and capability record, the model contract
and its building pieces, and the records that cross a process boundary (samples, run folder,
runtime file). ``docs/plugins.md`` names them; ``tests/test_public_api.py`` checks that every
module here declares ``__all__`` and that no built-in plugin imports anything else from core.
"""

from __future__ import annotations

__all__ = ["PUBLIC_MODULES"]

PUBLIC_MODULES: tuple[str, ...] = (
    # hooks, errors, the registry and the config's shared pieces
    "primerl",
    "primerl.hookspecs",
    "primerl.errors",
    "primerl.registry",
    "primerl.validators",
    "primerl.config",
    # environments
    "primerl.envs",
    "primerl.envs.agent",
    "primerl.envs.multiturn",
    "primerl.samples",
    "primerl.tokenizer",
    # inference backends, serving and KV stores
    "primerl.inference",
    "primerl.serving",
    "primerl.serving.front",
    "primerl.serving.protocol",
    "primerl.kv_stores",
    "primerl.kv_blocks",
    "primerl.kv_service",
    "primerl.routers",
    "primerl.sampling",
    "primerl.weights",
    # launchers: ports, process commands, supervision, the run folder and its records
    "primerl.launchers",
    "primerl.supervisor",
    "primerl.children",
    "primerl.rundir",
    "primerl.runtime",
    "primerl.runview",
    "primerl.resume",
    "primerl.watchdog",
    # monitors
    "primerl.monitors",
    # models and parallelisms
    "primerl.models",
    "primerl.models.contract",
    "primerl.models.batch",
    "primerl.models.experts",
    "primerl.models.tensors",
    "primerl.models.checkpoint",
    "primerl.models.sources",
    "primerl.models.fp8_matmul",
    "primerl.plan",
    "primerl.parallel",
    # the trainer's step, for checking a parallel layout against one process
    "primerl.algorithms",
    "primerl.trainer.packing",
    "primerl.trainer.step",
)
