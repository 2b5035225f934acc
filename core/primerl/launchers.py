"""The launcher contract: what ``primerl run`` hands a resolved config to.

A launcher (``register_launchers``, selected by ``launcher.name``) starts the processes of
a run — ``primerl inference``, ``primerl orchestrator``, ``primerl trainer``, each reading
the run directory's ``config.toml`` — wherever they belong: as local processes (the
``local`` launcher), or as jobs of a cluster scheduler. It owns their lifetime: it follows
them, shows progress, stops all of them when one fails or the user interrupts, and leaves
no orphans. Everything a run produces lands in the run directory
(:class:`primerl.rundir.RunDir`), so a launcher needs no channel of its own to the
processes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from primerl.config import RunConfig


@runtime_checkable
class Launcher(Protocol):
    """Runs a whole RL job (``register_launchers``; see docs/plugins.md)."""

    def launch(self, cfg: RunConfig) -> int:
        """Write ``cfg`` to the run directory, start the run's processes and follow them
        to the end. Returns the exit code of ``primerl run``: 0 when the trainer finished
        its last step, non-zero (having stopped the others and said why) otherwise.
        A user error found before anything starts raises :class:`primerl.errors.PrimerlError`."""


__all__ = ["Launcher"]
