"""One supervisor for a run's processes: what to watch, when to restart, when to stop, and why.

Both launchers run it. The local launcher runs it on this machine over ``primerl inference``,
``primerl orchestrator`` and ``primerl trainer``; the Slurm job runs it on its first node
over the same commands wrapped in ``srun`` steps, one per process and node
(``primerl_slurm.job``). What a launcher decides is where each process runs and how it is
started (a :class:`Child` each); everything after that is here, once:

* **duties** (:class:`Duty`): the run has finished when every trainer process has exited 0
  (``FINISHES``); a trainer or orchestrator (``WORKS``: its exit 0 is fine) exiting with
  another code fails the run, and so does a run service exiting at all (``SUPPORTS``: the
  Mooncake master);
* **restarts**: an inference server (``SERVES``) that exits while another one serves is
  started again with the same command, up to ``inference.max_restarts`` times per server
  (the orchestrator readmits it with the current weights once its ``/health`` answers),
  except when it exited on a config error (code 2: it would again) or was stopped on purpose
  (SIGINT, SIGTERM); one that exits for good leaves the run to the others, and when none is
  left the run fails. A server whose port its launcher holds (:attr:`Child.held`) is handed
  the held socket at each start; when it exits the socket is bound afresh, so that clients
  are refused, not queued, until the next start;
* **stalls**: the :class:`primerl.watchdog.Watchdog` reads every process's beacon; a run
  that makes no progress for ``watchdog.stall_timeout_s`` is reported (each process's waits
  and stacks in ``logs/watchdog.log``, the stuck stage in one line) and, with
  ``watchdog.on_stall = "exit"``, stopped with code 3;
* **order**: services (``SUPPORTS``) start first and are waited for until they serve; then
  the launcher writes what they set up (the run-time record) and everything else starts;
* **stopping**: SIGINT or SIGTERM, a failure, a stall or the end stop every process still
  running (SIGTERM to its process group, SIGKILL after a grace period), so nothing is left.

The result is an :class:`Outcome`: its exit code, the process it is about and one line
saying why; the launcher shows it (the Slurm job also writes it for ``primerl run`` to read).
Every process runs in its own process group and dies with the supervisor
(:mod:`primerl.children`).
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from primerl.children import own_group_and_die_with_parent
from primerl.launchers import HeldPort
from primerl.watchdog import BeaconRecord, Watchdog, clear_beacons, same_host

__all__ = ["Child", "Duty", "Outcome", "Reporter", "Supervisor", "STALLED", "GRACE_SECONDS", "tail"]

GRACE_SECONDS = 10.0  # between SIGTERM and SIGKILL when stopping
POLL_SECONDS = 0.5
SERVICE_WAIT_SECONDS = 120.0  # for a service to serve before the run gives up
STALLED = 3  # the exit code of a run the watchdog stopped
CONFIG_ERROR = 2  # a process's exit code for bad settings: starting it again would fail again
STOPPED_ON_PURPOSE = (130, 143, -signal.SIGINT, -signal.SIGTERM)  # SIGINT, SIGTERM (as a shell or Python reports them)


class Duty(enum.Enum):
    """What a process is for, which says what its exit means."""

    FINISHES = "finishes"  # the trainer: the run is done when every one of these exited 0
    WORKS = "works"  # the orchestrator: exit 0 is fine (its last batch is written), another code fails the run
    SERVES = "serves"  # an inference server: restarted while others serve; the run fails when none is left
    SUPPORTS = "supports"  # a run service (the Mooncake master): any exit fails the run


@attrs.frozen(kw_only=True)
class Child:
    """One process of a run, as a launcher places it."""

    name: str  # "inference-1", "orchestrator", "trainer", "trainer-1" (a trainer node), "mooncake"
    duty: Duty
    command: tuple[str, ...]
    log: Path  # its stdout and stderr (appended to when it restarts)
    env: Mapping[str, str] = attrs.field(factory=dict)  # the whole environment it gets
    node: str | None = None  # the node it runs on (a Slurm job); None: this machine
    # the role its beacon reports (primerl.watchdog.start): "inference:<port>", "orchestrator",
    # "trainer" (its ranks report "trainer-<rank>"); "" for a process without a beacon
    beacon: str = ""
    # a service (Duty.SUPPORTS): whether it serves yet; the other processes start once every
    # service says so (None: as soon as it is started)
    ready: Callable[[], bool] | None = attrs.field(default=None, eq=False)
    # an inference server's port its launcher holds (primerl.launchers.HeldPort): each start
    # is handed its socket (--inference.listen_fd); None: the server binds its port itself
    held: HeldPort | None = attrs.field(default=None, eq=False)

    def describe(self) -> str:
        return f"the {self.name} process" + (f" on {self.node}" if self.node else "")

    def owns(self, record: BeaconRecord) -> bool:
        """Whether ``record`` is this process's beacon (or one of its ranks'): its role, and
        its host when the process was placed on a node."""
        if not self.beacon or (record.role != self.beacon and not record.role.startswith(self.beacon + "-")):
            return False
        return self.node is None or not record.host or same_host(record.host, self.node)


@attrs.frozen(kw_only=True)
class Outcome:
    """How a supervised run ended."""

    code: int  # the run's exit code: 0 finished, 1 a process failed, 3 stalled, 128 + signal interrupted
    message: str  # one line: "the trainer finished its last step", "the trainer process exited with code 1"
    child: str | None = None  # the process it is about (its log holds the rest), if one
    log: Path | None = None
    stalled: bool = False  # the watchdog stopped it
    signal: str | None = None  # "SIGINT": stopped from outside


class Reporter(Protocol):
    """Where the supervisor says what happens while it runs (the live view, a job's log)."""

    def tick(self) -> None:
        """Called every turn of the loop (twice a second)."""

    def note(self, line: str) -> None:
        """A warning while the run goes on (a server restarted, a stall waited out)."""

    def stopping(self, outcome: Outcome) -> None:
        """The run ends for ``outcome``; the supervisor stops the processes next."""


class _Interrupted(Exception):
    pass


class Supervisor:
    """Runs a run's processes to the end (see the module docstring)."""

    def __init__(self, cfg: Any, run_dir: Any, children: Sequence[Child], reporter: Reporter, *,
                 urls: Callable[[], list[str]] | None = None, here: str | None = None,
                 services_ready: Callable[[], None] | None = None, grace: float = GRACE_SECONDS) -> None:
        """``cfg``: the run's config (``inference.max_restarts``, ``[watchdog]``); ``urls``: the
        inference servers' URLs (their ``/health`` is asked on a stall); ``here``: this
        machine's hostname, which the beacons of processes on it carry; ``services_ready``:
        called once every service serves, before the other processes start (a launcher
        writes the run-time record there)."""
        import socket

        names = [c.name for c in children]
        if len(set(names)) != len(names):
            raise ValueError(f"two processes of one run share a name: {names}")
        self.cfg, self.run_dir, self.reporter, self.grace = cfg, run_dir, reporter, grace
        self.services_ready = services_ready
        self.children = {c.name: c for c in children}
        self.here = here if here is not None else socket.gethostname()
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts = dict.fromkeys(names, 0)
        self.gone: list[str] = []  # servers that exited for good, in the order seen
        self.dog = Watchdog(cfg, run_dir, names=self.name_of, logs=lambda name: self.children[name].log,
                            urls=urls or (lambda: []), here=self.here)

    # ---- what the watchdog asks -----------------------------------------------------------

    def name_of(self, record: BeaconRecord) -> str:
        """The name of the process a beacon belongs to (its role when none claims it)."""
        for child in self.children.values():
            if child.owns(record):
                return child.name
        return record.role

    # ---- the run --------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Start every process, follow them to the end, stop what is left; the outcome."""

        def on_signal(signum: int, _frame: Any) -> None:
            raise _Interrupted(signal.Signals(signum).name)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        outcome: Outcome | None = None
        try:
            clear_beacons(self.run_dir)
            outcome = self._start_services()
            if outcome is None:
                if self.services_ready is not None:
                    self.services_ready()
                for name in self.children:
                    if name not in self.procs:
                        self._start(name)
            while outcome is None and (outcome := self._turn()) is None:
                time.sleep(POLL_SECONDS)
        except _Interrupted as exc:
            sig = signal.Signals[exc.args[0]]
            outcome = Outcome(code=128 + sig.value, message=f"stopped by {sig.name}", signal=sig.name)
        finally:
            try:
                if outcome is not None:
                    self.reporter.stopping(outcome)
                self.stop_all()
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
        return outcome

    def _start_services(self) -> Outcome | None:
        """Start the services and wait until each serves; an outcome if one cannot."""
        for name, child in self.children.items():
            if child.duty is not Duty.SUPPORTS:
                continue
            self._start(name)
            deadline = time.monotonic() + SERVICE_WAIT_SECONDS
            while child.ready is not None and not child.ready():
                self.reporter.tick()
                if (rc := self.procs[name].poll()) is not None:
                    return Outcome(code=rc if 0 < rc < 256 else 1, child=name, log=child.log,
                                   message=f"{child.describe()} exited with code {rc} before serving")
                if time.monotonic() > deadline:
                    return Outcome(code=1, child=name, log=child.log,
                                   message=f"{child.describe()} did not serve within {SERVICE_WAIT_SECONDS:.0f} s")
                time.sleep(POLL_SECONDS)
        return None

    def _turn(self) -> Outcome | None:
        """One look at every process and the beacons: an outcome once the run ends."""
        self.reporter.tick()
        finishers = [n for n, c in self.children.items() if c.duty is Duty.FINISHES]
        if finishers and all(self.procs[n].poll() == 0 for n in finishers):
            return Outcome(code=0, message="the trainer finished its last step", child=finishers[0])
        if (stalled := self._stall()) is not None:
            return stalled
        for name, child in self.children.items():
            rc = self.procs[name].poll()
            if rc is None or name in self.gone:
                continue
            if child.duty is Duty.SERVES:
                if (ended := self._server_exited(child, rc)) is not None:
                    return ended
            elif rc != 0 or child.duty is Duty.SUPPORTS:
                if child.duty is Duty.FINISHES and rc == 0:
                    continue  # a trainer node done; the others finish theirs
                return Outcome(code=rc if 0 < rc < 256 else 1, message=f"{child.describe()} exited with code {rc}",
                               child=name, log=child.log)
        return None

    def _stall(self) -> Outcome | None:
        stall = self.dog.check()
        if stall is None:
            return None
        line = (f"the run made no progress for {self.cfg.watchdog.stall_timeout_s:.0f} s: {stall.stage} "
                f"(every process's waits and stacks: {stall.report})")
        if self.cfg.watchdog.on_stall == "exit":
            return Outcome(code=STALLED, message=line, stalled=True)
        self.reporter.note(f"warning: {line}; still waiting (watchdog.on_stall = \"wait\")")
        return None

    def _server_exited(self, child: Child, rc: int) -> Outcome | None:
        """An inference server exited: restart it, leave the run to the others, or fail the run."""
        servers = [n for n, c in self.children.items() if c.duty is Duty.SERVES]
        serving = sum(self.procs[n].poll() is None for n in servers)
        limit = self.cfg.inference.max_restarts
        name = child.name
        restart = serving and self.restarts[name] < limit and rc not in (CONFIG_ERROR, *STOPPED_ON_PURPOSE)
        if child.held is not None:
            try:
                child.held.renew()  # its listening socket closed: connections are refused until it restarts
            except OSError as exc:
                if restart:
                    self.reporter.note(f"warning: {child.describe()} cannot be restarted: port {child.held.port} was "
                                       f"taken by another process after it exited ({exc})")
                restart = False
        if restart:
            self.restarts[name] += 1
            with open(child.log, "a") as log:
                log.write(f"[primerl] the server exited with code {rc}; restarting it ({self.restarts[name]} of "
                          f"at most {limit})\n")
            self.reporter.note(f"warning: {child.describe()} exited with code {rc}; restarting it "
                               f"({self.restarts[name]} of at most {limit}), {serving} of {len(servers)} inference "
                               f"servers serve meanwhile (log: {child.log})")
            self._start(name, mode="a")
            return None
        self.gone.append(name)
        if len(self.gone) < len(servers):
            self.reporter.note(f"warning: {child.describe()} exited with code {rc}; {len(servers) - len(self.gone)} "
                               f"of {len(servers)} inference servers left, the run goes on (log: {child.log})")
            return None
        what = (f"{child.describe()} exited with code {rc}" if len(servers) == 1 else
                f"every inference process exited (the last, {name}{f' on {child.node}' if child.node else ''}, "
                f"with code {rc})")
        return Outcome(code=rc if 0 < rc < 256 else 1, message=what, child=name, log=child.log)

    # ---- processes ------------------------------------------------------------------------

    def _start(self, name: str, mode: str = "w") -> None:
        child = self.children[name]
        child.log.parent.mkdir(parents=True, exist_ok=True)
        command, fds = list(child.command), ()
        if child.held is not None:  # the socket of the port its launcher holds
            command += ["--inference.listen_fd", str(child.held.fd)]
            fds = (child.held.fd,)
        with open(child.log, mode) as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=fds,
                env=dict(child.env) if child.env else None, preexec_fn=own_group_and_die_with_parent)

    def stop_all(self) -> None:
        """SIGTERM every live process's group, SIGKILL what is left after the grace period."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in live:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()


def _signal_group(p: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def tail(path: Path | None, lines: int = 25) -> str:
    """The last ``lines`` lines of a log ("" when there is none)."""
    if path is None:
        return ""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
