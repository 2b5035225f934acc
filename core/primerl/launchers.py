"""The launcher contract: what ``primerl run`` hands a resolved config to.

A launcher (``register_launchers``, selected by ``launcher.name``) starts the processes of
a run — ``primerl inference``, ``primerl orchestrator``, ``primerl trainer``, each reading
the run directory's ``config.toml`` — wherever they belong: as local processes (the
``local`` launcher), or as steps of a cluster scheduler's job. It decides where each one
runs and how it is started; following them (restarts, stalls, failures, stopping all of
them and leaving no orphans) is the one supervisor's (:mod:`primerl.supervisor`), which
every launcher runs. Everything a run produces lands in the run directory
(:class:`primerl.rundir.RunDir`), so a launcher needs no channel of its own to the
processes. The helpers below name and build the processes' commands the same way for
every launcher.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # pragma: no cover
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


@attrs.define(kw_only=True)
class LauncherConfig:
    """The ``[launcher]`` section; a launcher whose ``Config`` is a subclass adds its keys."""

    # the launcher plugin (register_launchers) that starts inference, orchestrator and
    # trainer: "local" runs them all on this machine, "slurm" submits them as a Slurm job
    # (its own keys: docs/slurm.md); `primerl run --launcher NAME` sets it
    name: str = "local"

    def trainer_nodes_used(self) -> int:
        """The nodes the trainer's ranks span (one unless the launcher's Config says more)."""
        return 1


@runtime_checkable
class Launcher(Protocol):
    """Runs a whole RL job (``register_launchers``; see docs/plugins.md)."""

    # the class that checks [launcher] when this launcher is selected: LauncherConfig, or a
    # subclass with the launcher's own keys
    Config: ClassVar[type[LauncherConfig]]

    def launch(self, cfg: RunConfig) -> int:
        """Write ``cfg`` to the run directory, start the run's processes and follow them
        to the end. Returns the exit code of ``primerl run``: 0 when the trainer finished
        its last step, non-zero (having stopped the others and said why) otherwise.
        A user error found before anything starts raises :class:`primerl.errors.PrimerlError`."""


__all__ = ["HeldPort", "Launcher", "LauncherCapabilities", "LauncherConfig", "hold_ports", "inference_names",
           "inference_roles", "process_command", "pick_ports"]


# -- what launchers share ------------------------------------------------------------------


def _bound_socket(host: str, port: int, *, reuse: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening), which no other socket can bind
    (not even with ``SO_REUSEADDR``); OSError where it cannot be. ``reuse``: past the
    connections a server that just exited closed on the port (in TIME_WAIT, which a server
    listening with ``SO_REUSEADDR`` lets be bound past)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        s.bind((host.strip("[]"), port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)  # bound: now no one else's
    except (OSError, OverflowError) as exc:
        s.close()
        raise OSError(str(exc)) from None
    return s


class HeldPort:
    """An inference server's port, bound by its launcher for the whole run and handed to each
    start of the server (``--inference.listen_fd``, :func:`primerl.inference.server_socket`).
    Between a launcher finding a port free and its server listening there are seconds (the
    server's interpreter, its model); another run on the machine that picked the same port
    meanwhile would fail to bind it. A held port cannot be picked: it is bound the whole time."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.sock = _bound_socket(host, port)
        self.port: int = self.sock.getsockname()[1]

    @property
    def fd(self) -> int:
        """The descriptor a server is handed (``subprocess.Popen(pass_fds=...)``)."""
        return self.sock.fileno()

    def renew(self) -> None:
        """After its server exited: the socket it listened on (the same one) is closed, so that
        connections are refused rather than queued for a server that is gone, and the port is
        bound again for the next start (past the connections the server closed, which wait
        out TIME_WAIT on it). OSError: another process bound it in between."""
        self.sock.close()
        self.sock = _bound_socket(self.host, self.port, reuse=True)

    def close(self) -> None:
        self.sock.close()


def hold_ports(host: str, first: int, n: int) -> list[HeldPort]:
    """``n`` ports held for servers (:class:`HeldPort`): ``first + i`` where free (``first``
    0: any), else a free one."""
    held: list[HeldPort] = []
    try:
        for i in range(n):
            try:
                held.append(HeldPort(host, first + i if first else 0))
            except OSError:
                if not first:
                    raise
                held.append(HeldPort(host, 0))
    except OSError:
        for h in held:
            h.close()
        raise
    return held


def pick_ports(host: str, first: int, n: int) -> list[int]:
    """``n`` distinct free ports, picked as :func:`hold_ports` picks them and let go at once:
    for servers a launcher cannot hand a socket (a Slurm job's ``srun`` steps), which bind
    the port themselves."""
    held = hold_ports(host, first, n)
    for h in held:
        h.close()
    return [h.port for h in held]


def inference_names(cfg: RunConfig) -> list[str]:
    """The inference servers' process names (and log names): ``inference``, or
    ``inference-<i>`` for each of ``inference.replicas`` > 1; with prefill/decode,
    ``inference-prefill-<i>`` then ``inference-decode-<j>``."""
    inf = cfg.inference
    if inf.disaggregated():
        return ([f"inference-prefill-{i}" for i in range(inf.prefill_replicas)]
                + [f"inference-decode-{j}" for j in range(inf.decode_replicas)])
    n = inf.replicas
    return ["inference"] if n == 1 else [f"inference-{i}" for i in range(n)]


def inference_roles(cfg: RunConfig) -> list[str | None]:
    """Each inference server's ``--inference.role`` (None: a whole-request server), in
    :func:`inference_names`' order."""
    inf = cfg.inference
    if inf.disaggregated():
        return ["prefill"] * inf.prefill_replicas + ["decode"] * inf.decode_replicas
    return [None] * len(inference_names(cfg))


def process_command(kind: str, config: Path, *, python: str = sys.executable, port: int | None = None,
                    role: str | None = None, host: str | None = None) -> list[str]:
    """``python -m primerl.cli <kind> @ config.toml``; an inference server's ``--inference.host``,
    ``--inference.port`` and (prefill/decode) ``--inference.role`` after it. The trainer's
    ranks wrap it in torchrun (each launcher knows its rendezvous)."""
    cmd = [python, "-m", "primerl.cli", kind, "@", str(config)]
    if host is not None:
        cmd += ["--inference.host", host]
    if port is not None:
        cmd += ["--inference.port", str(port)]
    if role is not None:
        cmd += ["--inference.role", role]
    return cmd
