"""A run that makes no progress says where it is stuck: beacons in every process, a watchdog
in the run's supervisor (:mod:`primerl.supervisor`).

Why: the field's most reported failure is the run that hangs silently, accelerators idle
and no error (an inference server that stopped answering, a tool call that never returns,
a trainer waiting for a batch that will not come). Each of those is visible from inside
the process that waits, and nowhere else.

* **Beacons** (:func:`start`, one per process of a run): the process counts its progress
  (:func:`advance`: a rollout, a batch, a trainer step; or a ``progress`` callable the
  beacon reads, such as the engine's generated tokens), says what it does (:func:`doing`)
  and records every wait in flight (``with waiting(kind, detail):``, a dict insert and
  delete: cheap enough for every request). A daemon thread writes it all once a second to
  ``OUT/progress/<role>-<host>-<pid>.json`` (:class:`BeaconRecord`, naming its machine), and
  SIGUSR1 makes the process dump every thread's Python stack (:mod:`faulthandler`) into its
  log.
* **The watchdog** (:class:`Watchdog`, the supervisor's loop calls :meth:`Watchdog.check`):
  when the progress summed over every beacon has not moved for
  ``watchdog.stall_timeout_s``, it asks every live process for its stacks (on another node:
  through the run directory), writes each one's state (``/proc`` for a process on this
  machine: running, sleeping, stopped), what it does, its waits with their
  ages and its stacks to ``logs/watchdog.log``, and names the stuck stage in one line
  (:func:`diagnose`): a stopped process, an env worker inside a call, inference not
  answering, a weight update not acknowledged, the trainer waiting for a batch.

A beacon's ``busy`` doing (loading a model, an SFT warm-up step) counts as progress: a
long load is not a stall. Beacons exist only in processes of a run a launcher started
(``OUT/config.toml`` exists) with the watchdog on; elsewhere the calls do nothing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

__all__ = ["Watchdog", "add_children_source", "add_progress_source", "advance", "doing", "start", "waiting"]

PROGRESS_DIR = "progress"  # under the run directory
WRITE_EVERY_S = 1.0
STALE_S = 10.0  # a beacon file older than this: its process no longer runs Python freely
STACKS_WAIT_S = 2.0  # for the stack dumps to reach the logs
STACKS_REQUEST = "stacks.request"  # under progress/: touched, every beacon dumps its stacks beside its record


@attrs.frozen
class Wait:
    """One wait in flight: what kind (``inference``, ``env``, ``weights``, ``batch``...), on
    what, since when (wall time)."""

    kind: str
    detail: str
    since: float


@attrs.frozen
class BeaconRecord:
    """What one process last said about itself (``OUT/progress/<role>-<host>-<pid>.json``)."""

    role: str  # "orchestrator", "trainer-0" (rank), "inference:8000" (port)
    pid: int
    time: float  # when it was written
    progress: int
    doing: str
    doing_since: float
    busy: bool  # doing counts as progress (a model loading)
    waits: tuple[Wait, ...]
    children: tuple[int, ...]  # pids that also dump their stacks on SIGUSR1 (env workers)
    host: str = ""  # the machine it runs on (socket.gethostname()); "" in a record from before hosts were kept

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BeaconRecord:
        d = json.loads(text)
        return cls(**{**d, "waits": tuple(Wait(**w) for w in d["waits"]), "children": tuple(d["children"])})


class Beacon:
    """A process's progress, doing and waits, written once a second by a daemon thread."""

    def __init__(self, role: str, directory: Path) -> None:
        self.host = socket.gethostname()
        self.role, self.path = role, directory / f"{beacon_stem(role, self.host, os.getpid())}.json"
        directory.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.progress_sources: list[Callable[[], int]] = []
        self.children_sources: list[Callable[[], list[int]]] = []
        self.doing, self.doing_since, self.busy = "starting", time.time(), True
        self.waits: dict[int, Wait] = {}
        self._ids = itertools.count()
        self.request = directory / STACKS_REQUEST
        self.answered = self._requested()  # a request from before this process started is not for it
        self.write()  # the first record now; the thread's next one a second later
        self._thread = threading.Thread(target=self._loop, name="primerl-beacon", daemon=True)
        self._thread.start()

    def record(self) -> BeaconRecord:
        progress = self.count
        for source in self.progress_sources:
            with contextlib.suppress(Exception):  # a source mid-teardown: its last value is gone, not fatal
                progress += int(source())
        children: list[int] = []
        for source in self.children_sources:
            with contextlib.suppress(Exception):
                children += source()
        return BeaconRecord(role=self.role, pid=os.getpid(), time=time.time(), progress=progress, doing=self.doing,
                            doing_since=self.doing_since, busy=self.busy, waits=tuple(list(self.waits.values())),
                            children=tuple(children), host=self.host)

    def write(self) -> None:
        tmp = self.path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(self.record().to_json())
        os.replace(tmp, self.path)

    def _requested(self) -> float:
        try:
            return self.request.stat().st_mtime
        except OSError:
            return 0.0

    def dump_stacks(self) -> None:
        """Every thread's stack to ``<role>-<host>-<pid>.stacks`` (a watchdog on another machine
        asked: it cannot signal this process), and SIGUSR1 to the children that dump theirs."""
        with open(self.path.with_suffix(".stacks"), "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        for source in self.children_sources:
            with contextlib.suppress(Exception):
                for pid in source():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGUSR1)

    def _loop(self) -> None:
        while True:
            time.sleep(WRITE_EVERY_S)
            with contextlib.suppress(OSError):  # a run directory being removed: try again later
                self.write()
                if (asked := self._requested()) > self.answered:
                    self.answered = asked
                    self.dump_stacks()


_beacon: Beacon | None = None


def beacon_stem(role: str, host: str, pid: int) -> str:
    """The name of a beacon's files under ``progress/`` without their suffix (``.json``,
    ``.stacks``): the host too, since processes on two nodes may share a role and a pid."""
    return f"{role}-{host.split('.')[0]}-{pid}" if host else f"{role}-{pid}"


def start(role: str, run_dir: Any, cfg: Any) -> None:
    """This process's beacon, when it belongs to a launched run with the watchdog on
    (``run_dir``: its :class:`~primerl.rundir.RunDir`); SIGUSR1 dumps its stacks to stderr."""
    global _beacon
    if _beacon is not None or not cfg.watchdog.stall_timeout_s or not run_dir.config.exists():
        return
    _beacon = Beacon(role, run_dir.root / PROGRESS_DIR)
    dump_stacks_on_signal()


def dump_stacks_on_signal() -> None:
    """SIGUSR1: every thread's Python stack to stderr (the process's log); the process goes on."""
    with contextlib.suppress(ValueError, RuntimeError, OSError):  # not the main thread, no stderr
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def advance(n: int = 1) -> None:
    """Progress was made (a rollout finished, a batch written, a step trained)."""
    if _beacon is not None:
        _beacon.count += n


def doing(what: str, *, busy: bool = False) -> None:
    """What the process does from now on; ``busy``: working, so it counts as progress."""
    if _beacon is not None and (what != _beacon.doing or busy != _beacon.busy):
        _beacon.doing, _beacon.doing_since, _beacon.busy = what, time.time(), busy


def add_progress_source(source: Callable[[], int]) -> None:
    """A counter the beacon reads (summed into its progress), e.g. tokens generated."""
    if _beacon is not None:
        _beacon.progress_sources.append(source)


def add_children_source(source: Callable[[], list[int]]) -> None:
    """Pids of this process's children that dump their stacks on SIGUSR1 too."""
    if _beacon is not None:
        _beacon.children_sources.append(source)


@contextlib.contextmanager
def waiting(kind: str, detail: str) -> Iterator[None]:
    """A wait in flight for the ``with`` block (works around ``await`` too)."""
    if _beacon is None:
        yield
        return
    key = next(_beacon._ids)
    _beacon.waits[key] = Wait(kind, detail, time.time())
    try:
        yield
    finally:
        _beacon.waits.pop(key, None)


# ---- the launcher's side ---------------------------------------------------------------------

_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible IO", "T": "stopped (SIGSTOP or a debugger)",
           "t": "stopped by a tracer", "Z": "exited (zombie)", "I": "idle"}


def _state(letter: str | None) -> str:
    return "state unknown (another machine)" if letter is None else _STATES.get(letter, letter)


def process_state(pid: int) -> str | None:
    """The ``/proc`` state letter of ``pid`` (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def clear_beacons(run_dir: Any) -> None:
    """Forget an earlier attempt's beacons (before a launch starts its processes)."""
    import shutil

    shutil.rmtree(run_dir.root / PROGRESS_DIR, ignore_errors=True)


def read_beacons(directory: Path) -> list[BeaconRecord]:
    out = []
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            out.append(BeaconRecord.from_json(path.read_text()))
    return out


@attrs.frozen
class Seen:
    """A beacon as the watchdog saw it when the run stalled."""

    record: BeaconRecord
    state: str | None  # /proc state letter
    name: str  # the launcher's name for the process ("inference-1", "trainer")


def _age(t: float, now: float) -> str:
    return f"{now - t:.0f} s"


def diagnose(seen: list[Seen], health: dict[str, str | None], now: float) -> str:
    """The stuck stage, in one line: the first of a stopped process, an env call, an
    unanswered inference request (with the server that does not answer ``/health``), an
    unacknowledged weight update, the trainer's wait, a process that stopped reporting."""
    for s in seen:
        if s.state in ("T", "t"):
            what = f"the {s.name} process ({s.record.pid}) is {_STATES[s.state]}"
            if s.name.startswith("inference"):
                return f"inference not answering: {what}"
            return what
    waits = sorted(((w, s) for s in seen for w in s.record.waits), key=lambda ws: ws[0].since)
    for kind in ("env", "inference", "weights", "publish"):
        for w, _s in waits:
            if w.kind != kind:
                continue
            if kind == "env":
                return f"an env worker inside a call: {w.detail}, for {_age(w.since, now)}"
            if kind == "inference":
                down = [f"{url} ({why})" for url, why in health.items() if why is not None]
                if down:
                    return f"inference not answering: {', '.join(down)}; the oldest request waits {_age(w.since, now)}"
                return f"inference requests unanswered for {_age(w.since, now)} ({w.detail}), though every server " \
                       f"answers /health"
            if kind == "publish":
                return f"the trainer is stuck {w.detail}, for {_age(w.since, now)}"
            return f"a weight update not acknowledged: {w.detail}, for {_age(w.since, now)}"
    for s in seen:
        if now - s.record.time > STALE_S:
            return f"the {s.name} process ({s.record.pid}) stopped reporting {_age(s.record.time, now)} ago " \
                   f"({_state(s.state)}: stopped, or blocked outside Python)"
    for w, _s in waits:
        if w.kind == "batch":
            return f"the trainer waits {_age(w.since, now)} for {w.detail}; the orchestrator: " + "; ".join(
                x.record.doing for x in seen if x.name == "orchestrator")
    return "no process reports a wait: " + "; ".join(f"{s.name}: {s.record.doing}" for s in seen)


@attrs.frozen
class Stall:
    stage: str  # the one line
    report: Path  # logs/watchdog.log


def same_host(a: str, b: str) -> bool:
    """Whether two hostnames name one machine (``node7`` and ``node7.cluster.local`` do)."""
    return a.split(".")[0] == b.split(".")[0]


class Watchdog:
    """Watches a run's beacons from its supervisor. ``names`` maps a beacon to the name of its
    process; ``logs`` a name to its log file; ``urls`` the inference servers (their
    ``/health`` is asked on a stall); ``here`` this machine's hostname.

    A process on this machine (its beacon's host is ``here``) is seen through ``/proc`` and
    asked for its stacks with SIGUSR1 (they land in its log); one on another node (a Slurm
    job's) cannot be: its state is unknown here and it is asked through the run directory
    (``progress/stacks.request``; each beacon answers with a ``.stacks`` file beside it)."""

    def __init__(self, cfg: Any, run_dir: Any, names: Callable[[BeaconRecord], str], logs: Callable[[str], Path],
                 urls: Callable[[], list[str]], here: str | None = None) -> None:
        self.timeout = cfg.watchdog.stall_timeout_s
        self.directory = run_dir.root / PROGRESS_DIR
        self.report_path = run_dir.logs / "watchdog.log"
        self.names, self.logs, self.urls = names, logs, urls
        self.here = here if here is not None else socket.gethostname()
        self.progress: dict[tuple[str, str, int], int] = {}
        self.last_progress = time.monotonic()

    def local(self, record: BeaconRecord) -> bool:
        return not record.host or same_host(record.host, self.here)

    def check(self) -> Stall | None:
        """None while the run progresses; a :class:`Stall` (reported) once it has not for
        ``stall_timeout_s`` (and again after as long again without progress)."""
        if not self.timeout:
            return None
        records = read_beacons(self.directory)
        moved = False
        for r in records:
            key = (r.host, r.role, r.pid)
            if self.progress.get(key) != r.progress or (r.busy and time.time() - r.time < STALE_S):
                moved = True
            self.progress[key] = r.progress
        now = time.monotonic()
        if moved:
            self.last_progress = now
            return None
        if now - self.last_progress < self.timeout:
            return None
        self.last_progress = now  # the next report, if any, after as long again
        return self.report(records)

    def _seen(self, records: list[BeaconRecord]) -> list[Seen]:
        """The processes to report: every remote one (its last record, state unknown) and the
        local ones still alive, with their ``/proc`` state."""
        seen = []
        for r in records:
            if not self.local(r):
                seen.append(Seen(r, None, self.names(r)))
            elif (state := process_state(r.pid)) not in (None, "Z"):
                seen.append(Seen(r, state, self.names(r)))
        return seen

    def _health(self) -> dict[str, str | None]:
        import httpx

        health: dict[str, str | None] = {}
        for url in self.urls():
            try:
                code = httpx.get(url + "/health", timeout=2.0).status_code
                health[url] = None if code == 200 else f"/health answered {code}"
            except httpx.HTTPError as exc:
                health[url] = f"/health: {type(exc).__name__}"
        return health

    def _ask_for_stacks(self, seen: list[Seen]) -> dict[Path, int]:
        """SIGUSR1 to every live local process that dumps its stacks (a stopped one cannot),
        a request through the run directory for the others; the local logs' sizes before."""
        sizes: dict[Path, int] = {}
        if any(s.state is None for s in seen):
            (self.directory / STACKS_REQUEST).touch()
        for s in seen:
            if s.state is None:
                continue
            log = self.logs(s.name)
            sizes.setdefault(log, log.stat().st_size if log.exists() else 0)
            for pid in (s.record.pid, *s.record.children):
                if process_state(pid) not in (None, "Z", "T", "t"):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGUSR1)
        time.sleep(STACKS_WAIT_S + (WRITE_EVERY_S if any(s.state is None for s in seen) else 0.0))
        return sizes

    def report(self, records: list[BeaconRecord]) -> Stall:
        seen = self._seen(records)
        health = self._health()
        now = time.time()
        stage = diagnose(seen, health, now)
        sizes = self._ask_for_stacks(seen)
        lines = [f"watchdog: no progress for {self.timeout:.0f} s at {time.strftime('%Y-%m-%d %H:%M:%S')}",
                 f"stuck: {stage}", ""]
        for url, why in health.items():
            lines.append(f"inference {url}: {'answers /health' if why is None else why}")
        for s in seen:
            lines += self._process_lines(s, now)
        for log, size in sizes.items():
            try:
                with open(log, errors="replace") as f:
                    f.seek(size)
                    dumped = f.read()
            except OSError:
                continue
            if dumped.strip():
                lines += ["", f"== stacks written to {log.name} after SIGUSR1", dumped.rstrip()]
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.report_path, "a") as f:
            f.write("\n".join(lines) + "\n\n")
        return Stall(stage=stage, report=self.report_path)

    def _process_lines(self, s: Seen, now: float) -> list[str]:
        r = s.record
        where = f" on {r.host}" if r.host and not self.local(r) else ""
        lines = ["", f"== {s.name} (pid {r.pid}{where}, {_state(s.state)}; last report {_age(r.time, now)} ago)",
                 f"doing: {r.doing} (for {_age(r.doing_since, now)})"]
        lines += [f"waiting on {w.kind}: {w.detail} (for {_age(w.since, now)})" for w in r.waits[:20]]
        if len(r.waits) > 20:
            lines.append(f"... and {len(r.waits) - 20} more waits")
        if s.state is None:
            stacks = self.directory / f"{beacon_stem(r.role, r.host, r.pid)}.stacks"
            if stacks.exists() and stacks.stat().st_mtime >= now - 1:
                lines += ["stacks:", stacks.read_text(errors="replace").rstrip()]
            else:
                lines.append("stacks: none came (the process is stopped, or blocked outside Python)")
        return lines
