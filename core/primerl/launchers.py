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

import socket
from typing import Protocol, runtime_checkable

import attrs

from primerl.config import RunConfig


@attrs.frozen(kw_only=True)
class LauncherCapabilities:
    """What a launcher declares when it registers (``register(..., capabilities=...)``).

    ``supports_pd``: it starts prefill/decode server pools (``inference.prefill_replicas``,
    ``decode_replicas``) and hands each server its role.
    ``dry_run``: its ``Config`` has a ``dry_run`` key: ``primerl run --dry-run`` sets it and
    the launcher writes what it would start (a batch job's scripts) and starts nothing;
    without it ``--dry-run`` prints the resolved config.
    """

    supports_pd: bool = False
    dry_run: bool = False


@runtime_checkable
class Launcher(Protocol):
    """Runs a whole RL job (``register_launchers``; see docs/plugins.md)."""

    def launch(self, cfg: RunConfig) -> int:
        """Write ``cfg`` to the run directory, start the run's processes and follow them
        to the end. Returns the exit code of ``primerl run``: 0 when the trainer finished
        its last step, non-zero (having stopped the others and said why) otherwise.
        A user error found before anything starts raises :class:`primerl.errors.PrimerlError`."""


__all__ = ["Launcher"]


# -- what launchers share ------------------------------------------------------------------


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except (OSError, OverflowError):
            return False


def pick_ports(host: str, first: int, n: int) -> list[int]:
    """``n`` distinct free ports: ``first + i`` where free (``first`` 0: any), else a free one."""
    ports: list[int] = []
    for i in range(n):
        port = first + i if first else 0
        while port == 0 or port in ports or not _port_free(host, port):
            port = _free_port(host)
        ports.append(port)
    return ports
