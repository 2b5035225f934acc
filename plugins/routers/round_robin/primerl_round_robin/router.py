"""The ``round-robin`` router: each new request goes to the next server in turn.

The default, and what a single server needs. A request with a ``session`` (a group's
samples, an agent episode's turns) goes where the session's first request went, so its
shared prefix is found in that server's prefix cache; sessions are forgotten oldest
first beyond ``max_sessions``. It keeps no load statistics: a load-aware policy is
another plugin. When the orchestrator ejects a dead server (``servers_up``), the turn
skips it and its sessions move to the next server in turn; a readmitted server rejoins
the turn.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from primerl.routers import Route


class RoundRobinRouter:
    """In-process policy: servers in turn, sessions sticky."""

    def __init__(self, max_sessions: int = 65536) -> None:
        self.servers: list[str] = []
        self.up: list[str] = []  # the servers that may take requests (all, until told otherwise)
        self._turn = itertools.count()
        self._started = False
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self.max_sessions = max_sessions

    def start(self, servers: Sequence[str]) -> None:
        if not servers:
            raise ValueError("the round-robin router needs at least one inference server")
        self.servers = list(servers)
        self.up = list(self.servers)
        self._started = True

    def headers(self, request: Route) -> Mapping[str, str]:
        return {}

    def servers_up(self, servers: Sequence[str]) -> None:
        """Route only to ``servers`` from now on; sessions on the others move on their next request."""
        wanted = set(servers)
        self.up = [s for s in self.servers if s in wanted]

    def _next(self) -> str:
        pool = self.up or self.servers  # none up: the orchestrator waits and never sends
        return pool[next(self._turn) % len(pool)]

    def route(self, request: Route) -> str:
        if not self._started:
            raise RuntimeError("RoundRobinRouter.route called before start()")
        if request.session is None:
            return self._next()
        url = self._sessions.get(request.session)
        if url is None or url not in self.up:
            url = self._sessions[request.session] = self._next()
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(request.session)
        return url

    def finished(self, request: Route, url: str, *, ok: bool, seconds: float) -> None:
        """Nothing to track; a failed request's session may move on its next request."""
        if not ok and request.session is not None:
            self._sessions.pop(request.session, None)

    def close(self) -> None:
        self._sessions.clear()
