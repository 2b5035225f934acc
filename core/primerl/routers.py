"""The router contract: which inference server serves a request.

A run may have several inference servers (replicas, or prefill and decode pools); the
orchestrator talks to them through one :class:`Router`, a plugin selected by
``inference.router`` (``register_routers``). Two shapes of router exist in the field and
both fit this Protocol:

* an **in-process policy** (round-robin, least-loaded, sticky sessions): ``route`` picks
  one of the servers for each request, and ``finished`` tells it how the request went so
  it can track load and health;
* an **external router process** (the Rust ``vllm-router``, NVIDIA Dynamo's router): ``start``
  launches it in front of the servers and ``route`` always answers its one URL; the
  process balances on its own.

Admin calls that every server must see (weight updates, pause/resume) never go through
the router: the orchestrator sends them to each of ``servers`` itself.

Health is the orchestrator's: it probes every server, takes a dead one out of routing and
re-sends its requests, and puts it back once it answers again with the current weights.
A router's ``servers_up(servers)`` is told each time the set of servers that may take
requests changes; a router that ignores it (a no-op) keeps working, since the orchestrator
asks again (and finally picks an up server itself) when ``route`` names a server that is
down. ``finished(..., ok=False)`` still reports every failed request.

Requests that belong together carry the same ``session``: the samples of one group share
their prompt, and the turns of one episode extend each other, so a router that keeps a
session on one server turns the shared prefix into prefix-cache hits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs


@attrs.frozen(kw_only=True)
class Route:
    """What a router may look at to place one request."""

    path: str  # the API path: "/v1/chat/completions", "/v1/completions"
    session: str | None = None  # requests with the same session share a prefix (a group, an episode)
    prompt_tokens: int = 0  # prompt length when known (0: unknown), for load-aware policies


@runtime_checkable
class Router(Protocol):
    """Places requests on inference servers (``register_routers``; see docs/plugins.md)."""

    def start(self, servers: Sequence[str]) -> None:
        """Begin routing to ``servers`` (base URLs such as ``http://host:port``).

        An external router process is started here and must be ready on return."""

    def route(self, request: Route) -> str:
        """The base URL to send ``request`` to: one of the servers, or an external router's URL."""

    def finished(self, request: Route, url: str, *, ok: bool, seconds: float) -> None:
        """``request`` sent to ``url`` has ended (``ok`` False: an error or no answer)."""

    def close(self) -> None:
        """Stop routing; stop an external router process."""

    def servers_up(self, servers: Sequence[str]) -> None:
        """``servers``: those of ``start``'s that may take requests now, in ``start``'s order,
        after one was ejected (it stopped answering) or readmitted (it answers again and has
        the current weights); possibly empty. From then on ``route`` should answer one of
        them (an external router: remove and re-add workers, or rely on its own checks; a
        router may ignore it). Called on the orchestrator's event loop: keep it quick."""

    def headers(self, request: Route) -> Mapping[str, str]:
        """HTTP headers the orchestrator adds to ``request`` (e.g. a session header an
        external router keys on; ``{}`` for none); asked once per request, before ``route``."""


def load_router(name: str, options: Mapping[str, Any] | None = None) -> Router:
    """The router plugin ``name`` (``inference.router``), built with ``options``
    (``inference.router_options``, the class's keyword arguments)."""
    from primerl.registry import get_registry

    return get_registry().load("router", name)(**dict(options or {}))


__all__ = ["Route", "Router", "load_router"]
