"""The ``sticky`` router: a session stays on the server that holds its prefix, new
sessions go where the load is lowest, and failed or unhealthy servers are avoided.

Why: the samples of a group share their prompt and the turns of an episode extend each
other (``Route.session``), so the server that served a session's last request holds its
prefix in its KV cache; sending the next request anywhere else prefills it again.
``round-robin`` keeps sessions too, but places new ones blindly and keeps sending to a
server that stopped answering. This router places each *new* session on the least loaded
healthy server and moves the sessions of a failed one.

Load. A background thread reads every server's ``/metrics`` (Prometheus text) each
``poll_s`` seconds: the embedded engine exports ``primerl_batch_size`` (sequences
running), ``primerl_waiting_sequences`` and ``primerl_kv_cache_usage``; a vLLM server
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before vLLM 0.10). A server's
load is the router's own requests in flight there now plus the others the last read saw
(running + waiting beyond what the router had in flight then: other clients'): the
in-flight count reacts at once, so a burst of new sessions between two reads spreads
out, and a read up to ``poll_s`` old cannot make a server that has since gone quiet look
busy. Ties go to lower KV usage (in tenths), then to fewer sessions, then in turn.

Health. A server whose ``/metrics`` does not answer (refused, timed out, 5xx) is
unhealthy until it answers again; one with ``max_failures`` failed requests in a row
(``finished(ok=False)``) is avoided for ``avoid_s`` seconds; one the orchestrator's
client leaves out of ``servers_up`` (it ejected it) is avoided until a later call names
it again. A session whose server is avoided moves to the least loaded healthy server and
stays there. With every server avoided the least loaded of all is used: routing never
refuses.

``route(Route(path="/v1", session=...))`` hands a base URL to an env that sends its own
requests (an agent env's group): it places the session but counts nothing in flight,
since no ``finished`` follows. Sessions are forgotten oldest first beyond
``max_sessions``.

Settings are constructor keywords with defaults (the registry constructs routers with no
arguments; see docs/routers.md).
"""

from __future__ import annotations

import itertools
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import attrs

from primerl.routers import Route

# gauges read from /metrics, by what they measure; each name's samples are summed over labels
RUNNING = ("primerl_batch_size", "vllm:num_requests_running")
WAITING = ("primerl_waiting_sequences", "vllm:num_requests_waiting")
KV_USAGE = ("primerl_kv_cache_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
HANDOUT_PATHS = frozenset({"", "/v1"})  # route() for a base URL an env uses itself: no finished() follows

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to ``{name: value}``, samples of one name summed over their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        if math.isfinite(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


@attrs.define
class ServerState:
    """What the router knows of one server."""

    url: str
    in_flight: int = 0  # this router's requests sent there and not finished
    running: float = 0.0  # from the last /metrics read
    waiting: float = 0.0
    foreign: float = 0.0  # running + waiting beyond this router's in-flight requests at that read
    kv_usage: float = 0.0
    sessions: int = 0  # sessions placed there and remembered
    healthy: bool = True  # the last /metrics read answered
    up: bool = True  # named by the last servers_up() (the orchestrator's health view)
    failures: int = 0  # failed requests in a row
    avoid_until: float = 0.0  # monotonic time before which new requests avoid it
    polled_at: float = 0.0  # monotonic time of the last good /metrics read (0: never)

    def usable(self, now: float) -> bool:
        return self.healthy and self.up and now >= self.avoid_until

    def load(self) -> float:
        return self.in_flight + self.foreign


class StickyRouter:
    """In-process policy: sessions sticky, new sessions least loaded, failures avoided."""

    def __init__(self, *, max_sessions: int = 65536, poll_s: float = 1.0, timeout_s: float = 2.0,
                 max_failures: int = 1, avoid_s: float = 10.0) -> None:
        if max_sessions < 1 or poll_s <= 0 or timeout_s <= 0 or max_failures < 1 or avoid_s < 0:
            raise ValueError("StickyRouter needs max_sessions >= 1, poll_s > 0, timeout_s > 0, "
                             "max_failures >= 1 and avoid_s >= 0")
        self.max_sessions, self.poll_s, self.timeout_s = max_sessions, poll_s, timeout_s
        self.max_failures, self.avoid_s = max_failures, avoid_s
        self.servers: dict[str, ServerState] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._http = None

    # ---- the Router protocol -----------------------------------------------------------------
    def start(self, servers: Sequence[str]) -> None:
        if not servers:
            raise ValueError("the sticky router needs at least one inference server")
        import httpx

        self.servers = {url: ServerState(url) for url in servers}
        self._http = httpx.Client(timeout=self.timeout_s)
        self.poll()  # know the servers' load and health before the first request
        self._stop.clear()
        self._poller = threading.Thread(target=self._poll_loop, name="sticky-router-poll", daemon=True)
        self._poller.start()

    def route(self, request: Route) -> str:
        if not self.servers:
            raise RuntimeError("StickyRouter.route called before start()")
        now = time.monotonic()
        with self._lock:
            url = self._sessions.get(request.session) if request.session is not None else None
            if url is not None and self.servers[url].usable(now):
                self._sessions.move_to_end(request.session)
            else:
                if url is not None:  # its server is avoided: the session moves
                    self._forget(request.session)
                url = self._least_loaded(now)
                if request.session is not None:
                    self._remember(request.session, url)
            if request.path.rstrip("/") not in HANDOUT_PATHS:
                self.servers[url].in_flight += 1
        return url

    def finished(self, request: Route, url: str, *, ok: bool, seconds: float) -> None:
        with self._lock:
            state = self.servers.get(url)
            if state is None:
                return
            if request.path.rstrip("/") not in HANDOUT_PATHS:
                state.in_flight = max(0, state.in_flight - 1)
            if ok:
                state.failures = 0
                return
            state.failures += 1
            if state.failures >= self.max_failures:
                state.avoid_until = time.monotonic() + self.avoid_s
            if request.session is not None and self._sessions.get(request.session) == url:
                self._forget(request.session)  # its next request is placed afresh

    def headers(self, request: Route) -> Mapping[str, str]:
        return {}

    def servers_up(self, servers: Sequence[str]) -> None:
        """The orchestrator's client ejected or readmitted a server: only ``servers`` take
        requests now (optional in the Router protocol); sessions elsewhere move on their
        next request."""
        up = set(servers)
        with self._lock:
            for url, state in self.servers.items():
                if url in up and not state.up:  # readmitted: it answers again, with the current weights
                    state.failures, state.avoid_until = 0, 0.0
                state.up = url in up

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=self.timeout_s + 1)
            self._poller = None
        if self._http is not None:
            self._http.close()
            self._http = None
        with self._lock:
            self._sessions.clear()
            for state in self.servers.values():
                state.sessions = 0

    # ---- placement ---------------------------------------------------------------------------
    def _least_loaded(self, now: float) -> str:
        states = list(self.servers.values())
        candidates = [s for s in states if s.usable(now)] or states
        turn = next(self._turn)
        n = len(states)
        order = {s.url: (i - turn) % n for i, s in enumerate(states)}  # rotating last tie-break
        best = min(candidates, key=lambda s: (s.load(), round(s.kv_usage, 1), s.sessions, order[s.url]))
        return best.url

    def _remember(self, session: str, url: str) -> None:
        self._sessions[session] = url
        self.servers[url].sessions += 1
        while len(self._sessions) > self.max_sessions:
            _, old = self._sessions.popitem(last=False)
            self.servers[old].sessions -= 1

    def _forget(self, session: str) -> None:
        url = self._sessions.pop(session, None)
        if url is not None:
            self.servers[url].sessions -= 1

    # ---- load and health ---------------------------------------------------------------------
    def poll(self) -> None:
        """Read every server's /metrics once (the background thread calls this each poll_s)."""
        for url, state in list(self.servers.items()):
            try:
                r = self._http.get(url + "/metrics")
                if r.status_code >= 500:
                    raise RuntimeError(f"/metrics answered {r.status_code}")
                values = parse_metrics(r.text) if r.status_code == 200 else {}
            except Exception:  # noqa: BLE001 - refused, timed out, closed: the server is unhealthy
                with self._lock:
                    state.healthy = False
                continue
            with self._lock:
                state.healthy = True
                state.running = sum(values.get(n, 0.0) for n in RUNNING)
                state.waiting = sum(values.get(n, 0.0) for n in WAITING)
                state.foreign = max(0.0, state.running + state.waiting - state.in_flight)
                state.kv_usage = max((values[n] for n in KV_USAGE if n in values), default=0.0)
                state.polled_at = time.monotonic()

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._http is None:
                return
            self.poll()

    def snapshot(self) -> dict[str, dict[str, float | int | bool]]:
        """Per server: load, health and sessions, as the router sees them now."""
        now = time.monotonic()
        with self._lock:
            return {url: {"load": s.load(), "in_flight": s.in_flight, "foreign": s.foreign, "running": s.running,
                          "waiting": s.waiting,
                          "kv_usage": s.kv_usage, "sessions": s.sessions, "usable": s.usable(now),
                          "healthy": s.healthy, "up": s.up, "failures": s.failures}
                    for url, s in self.servers.items()}


__all__ = ["StickyRouter", "parse_metrics"]
