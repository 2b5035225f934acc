"""The ``round-robin`` router: each new request goes to the next server in turn.

The default, and what a single server needs. A request with a ``session`` (a group's
samples, an agent episode's turns) goes where the session's first request went, so its
shared prefix is found in that server's prefix cache; sessions are forgotten oldest
first beyond ``max_sessions``. It keeps no load statistics: a load-aware policy is
another plugin.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from primerl.routers import Route


class RoundRobinRouter:
    """In-process policy: servers in turn, sessions sticky."""

    def __init__(self, max_sessions: int = 65536) -> None:
        self.servers: list[str] = []
        self._turn: itertools.cycle | None = None
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self.max_sessions = max_sessions

    def start(self, servers: Sequence[str]) -> None:
        if not servers:
            raise ValueError("the round-robin router needs at least one inference server")
        self.servers = list(servers)
        self._turn = itertools.cycle(self.servers)

    def route(self, request: Route) -> str:
        if self._turn is None:
            raise RuntimeError("RoundRobinRouter.route called before start()")
        if request.session is None:
            return next(self._turn)
        url = self._sessions.get(request.session)
        if url is None:
            url = self._sessions[request.session] = next(self._turn)
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
