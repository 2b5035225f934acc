"""The orchestrator's inference client: requests spread over the replicas, and a dead one survived.

A run may serve its policy from several inference servers (``inference.replicas``). The
:class:`InferenceClient` sends every request where the router plugin says
(``inference.router``) and every admin call (a weight load) to each server itself, and it
keeps a health state per server so that losing one costs the run nothing but time:

* **ejection** — a server is taken out of routing when a request to it loses its
  connection (refused, reset, closed without an answer), when its ``/health`` stops
  answering (refused at once, or three probes in a row without an answer), or when
  ``/health`` reports an older policy than the one it was given (it restarted). The
  router is told (its optional ``servers_up``, see :mod:`primerl.routers`);
* **re-send** — the requests in flight on an ejected server are sent again, whole, to
  another: completions are generated again from the same prompt (a group's chat request
  with all its samples, one turn of a multi-turn episode); only the answer that arrives
  is used, so nothing is lost or counted twice. Each re-send is counted
  (``inference/resent`` in the next batch's metrics, beside ``inference/servers_up``).
  An agent env's group, whose calls its worker makes itself, is re-run whole by the
  orchestrator with :meth:`InferenceClient.endpoint` / :meth:`InferenceClient.lost_since`;
* **readmission** — an ejected server is probed every ``probe_every_s``; once its
  ``/health`` answers, the current weights are loaded into it and only then does it
  serve again;
* **weight updates** go to the servers that are up, concurrently; a server that dies
  during one is ejected and the update goes on without it (readmission catches it up).

A request answered 503 with ``Retry-After`` (the server's queue is full) is sent again
after that pause (at most 5 s; the router hears ``ok=False`` and may place it elsewhere):
back-pressure, not a failure, and not counted. A request whose server is merely slow (a
read timeout with ``/health`` still answering) is not re-sent: it fails as before, and the
orchestrator counts the failed group. The servers' key (``inference.api_key``), when
set, goes with every call. With no server up for ``all_down_s`` seconds a request raises :class:`NoServerUp`, a
:class:`~primerl.errors.PrimerlError` that stops the run with every server's cause in
one line. An external router process (``route`` answers a URL that is not one of the
servers) balances and health-checks on its own: errors through it are not re-sent here.

Prefill/decode disaggregation (``inference.prefill_replicas`` / ``decode_replicas``):
:class:`PDInferenceClient`, at the end of this module, runs each request as two phases over
two pools, each an :class:`InferenceClient` with its own router and health; build either
client with :func:`inference_client`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from primerl import watchdog
from primerl.errors import PrimerlError
from primerl.routers import Route, Router
from primerl.serving.protocol import (
    ADMIN_WEIGHTS,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    HEALTH,
    ChatCompletionResponse,
    CompletionResponse,
)


def log(msg: str) -> None:
    print(f"[orchestrator {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class NoServerUp(PrimerlError):
    """No inference server has answered for ``all_down_s`` seconds: the run cannot go on."""


class ServerLost(Exception):
    """The server a request was waiting on was ejected while it waited."""


class KVMissing(Exception):
    """A decode server did not find the prompt's KV in the KV store (409 ``kv_missing``):
    prefill/decode disaggregation runs the prefill phase again."""


@attrs.define
class Server:
    """One inference server's health, as the client sees it."""

    url: str
    up: bool = False
    cause: str = "not ready yet"  # why it is down (the last failure)
    ejections: int = 0  # times it was taken out of routing (a change means it died in between)
    version: int | None = None  # the policy version the client last loaded into it
    silent_probes: int = 0  # /health probes in a row without an answer
    # set while the server is out of routing: requests waiting on it are re-sent at once
    lost: asyncio.Event = attrs.Factory(asyncio.Event)

    def admit(self) -> None:
        self.up, self.cause, self.silent_probes = True, "", 0
        self.lost = asyncio.Event()


def _connection_lost(exc: BaseException) -> bool:
    """Errors that say the server process is gone (or was replaced), not merely slow."""
    import httpx

    return isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout, ServerLost))


def _retry_after(value: str) -> float:
    """A Retry-After header's seconds (0.1 to 5; 1 when it is an HTTP date)."""
    try:
        return min(max(float(value), 0.1), 5.0)
    except ValueError:
        return 1.0


def _cause(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Client(Protocol):
    """What the orchestrator (and the trainer's weight channel) ask of the inference servers:
    :class:`InferenceClient` over one pool, :class:`PDInferenceClient` over two."""

    servers: list[str]

    def servers_up(self) -> list[str]: ...

    async def wait_ready(self, deadline_s: float = 600.0) -> None: ...

    def base_url(self, session: str) -> str: ...

    async def endpoint(self, session: str) -> tuple[str, int]:
        """A server's URL for an agent env that calls inference itself, and a token for
        :meth:`lost_since`."""

    async def lost_since(self, url: str, token: int) -> bool: ...

    def count_resent(self) -> None: ...

    async def chat(self, body: dict[str, Any], session: str | None = None) -> ChatCompletionResponse: ...

    async def completions(self, body: dict[str, Any], session: str | None = None) -> CompletionResponse: ...

    async def post(self, path: str, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        """Any generation endpoint's request, routed, re-sent when its server is lost."""

    async def load_weights(self, path: Path, version: int) -> None: ...

    def take_metrics(self) -> dict[str, int]: ...

    async def close(self) -> None: ...


class InferenceClient:
    """The OpenAI-compatible API plus primerl's admin endpoints, over one or more servers.

    Requests go where the router plugin says; admin calls that every server must see
    (weight updates) go to each server that is up. See the module docstring for health.
    """

    def __init__(self, servers: Sequence[str], router: Router, timeout: float = 600.0, *,
                 probe_every_s: float = 1.0, all_down_s: float = 60.0, ready_grace_s: float = 60.0,
                 api_key: str | None = None):
        import httpx

        if not servers:
            raise ValueError("InferenceClient needs at least one inference server URL")
        self.servers = [u.rstrip("/") for u in servers]
        self.router = router
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else None  # servers that require a key
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024), headers=auth)
        self.state = {url: Server(url) for url in self.servers}
        for srv in self.state.values():
            srv.lost.set()  # down until it answers
        self.probe_every_s = probe_every_s
        self.all_down_s = all_down_s
        self.ready_grace_s = ready_grace_s
        self.weights: tuple[str, int] | None = None  # the newest weights loaded: what a readmitted server gets
        self.resent = 0  # requests (and agent groups) sent again since the last take_metrics()
        self._turn = itertools.count()
        self._watchers: list[asyncio.Task] = []

    # ---- health -------------------------------------------------------------------------
    def servers_up(self) -> list[str]:
        return [s.url for s in self.state.values() if s.up]

    async def wait_ready(self, deadline_s: float = 600.0) -> None:
        """Wait until every server answers ``/health``, then start routing and watching.

        Once one answers, the others get ``ready_grace_s`` more; one still silent then
        starts ejected and is admitted (with the current weights) when it answers."""
        t0 = time.monotonic()
        first_up: float | None = None
        while True:
            waiting = [s for s in self.state.values() if not s.up]
            answers = await asyncio.gather(*(self._health(s.url, 2.0) for s in waiting))
            for srv, answer in zip(waiting, answers):
                if isinstance(answer, dict):
                    srv.admit()
                elif answer == "/health answered 401":
                    raise PrimerlError(f"inference server {srv.url} requires an API key the orchestrator does not "
                                       f"have (401): give every process the same inference.api_key or "
                                       f"PRIMERL_API_KEY")
                else:
                    srv.cause = answer
            now = time.monotonic()
            up = self.servers_up()
            if len(up) == len(self.servers):
                break
            if up and first_up is None:
                first_up = now
            if first_up is not None and now - first_up > self.ready_grace_s:
                for srv in self.state.values():
                    if not srv.up:
                        log(f"inference server {srv.url} is not ready {self.ready_grace_s:.0f}s after another was "
                            f"({srv.cause}); routing to the others until it answers")
                break
            if now - t0 > deadline_s:
                late = ", ".join(s.url for s in self.state.values() if not s.up)
                raise RuntimeError(f"inference server {late} not ready after {deadline_s:.0f}s")
            await asyncio.sleep(0.2)
        self.router.start(self.servers)
        if len(self.servers_up()) < len(self.servers):
            self._tell_router()
        self._watchers = [asyncio.create_task(self._watch(srv)) for srv in self.state.values()]

    async def _health(self, url: str, timeout: float) -> dict[str, Any] | str:
        """``/health``'s answer, or why there was none (one line)."""
        import httpx

        try:
            r = await self.http.get(url + HEALTH, timeout=timeout)
        except httpx.HTTPError as exc:
            return _cause(exc)
        if r.status_code != 200:
            return f"/health answered {r.status_code}"
        try:
            return r.json()
        except ValueError:
            return {}

    async def _watch(self, srv: Server) -> None:
        """Probe one server forever: eject it when it stops answering or restarted, readmit
        it (with the current weights) when it answers again."""
        import httpx

        while True:
            await asyncio.sleep(self.probe_every_s)
            given = srv.version  # before the probe: a load that lands meanwhile only raises it
            if not srv.up:
                if isinstance(await self._health(srv.url, 2.0), dict):
                    await self._readmit(srv)
                continue
            try:
                r = await self.http.get(srv.url + HEALTH, timeout=5.0)
            except httpx.HTTPError as exc:
                srv.silent_probes += 1
                if _connection_lost(exc) or srv.silent_probes >= 3:
                    self.eject(srv.url, f"/health: {_cause(exc)}")
                continue
            srv.silent_probes = 0
            try:
                serving = r.json().get("policy_version") if r.status_code == 200 else None
            except ValueError:
                serving = None
            if isinstance(serving, int) and given is not None and serving < given:
                self.eject(srv.url, f"it restarted (serves policy v{serving}, was given v{given})")

    def eject(self, url: str, cause: str) -> None:
        """Take ``url`` out of routing; its waiting requests are re-sent elsewhere."""
        srv = self.state[url]
        if not srv.up:
            return
        srv.up, srv.cause, srv.silent_probes = False, cause, 0
        srv.ejections += 1
        srv.lost.set()
        up = self.servers_up()
        log(f"inference server {url} ejected from routing: {cause}; {len(up)} of {len(self.servers)} up")
        self._tell_router()

    async def _readmit(self, srv: Server) -> None:
        """Load the current weights into a server that answers again, then route to it."""
        while True:
            current = self.weights
            if current is not None:
                error = await self._load(srv, *current)
                if error:
                    srv.cause = error
                    return  # still down; the next probe tries again
            if self.weights is current:  # no newer version was published during the load
                break
        srv.admit()
        log(f"inference server {srv.url} answers /health: back in routing"
            + (f" with policy v{current[1]}" if current else "")
            + f"; {len(self.servers_up())} of {len(self.servers)} up")
        self._tell_router()

    def _tell_router(self) -> None:
        try:
            self.router.servers_up(self.servers_up())
        except Exception as exc:  # noqa: BLE001 - a router bug must not stop health tracking
            log(f"router {type(self.router).__name__}.servers_up failed: {_cause(exc)}")

    # ---- routing ------------------------------------------------------------------------
    def _choose(self, route: Route) -> str | None:
        """The router's choice when it is up (or an external router's URL); else an up
        server in turn (a router unaware of health may keep naming a dead one); None when
        no server is up."""
        up = self.servers_up()
        if not up:
            return None
        for _ in range(len(self.servers)):
            url = self.router.route(route)
            srv = self.state.get(url)
            if srv is None or srv.up:
                return url
        return up[next(self._turn) % len(up)]

    async def _pick(self, route: Route) -> str:
        """Where to send ``route``; waits up to ``all_down_s`` for a server to come back."""
        deadline = time.monotonic() + self.all_down_s
        while (url := self._choose(route)) is None:
            if time.monotonic() > deadline:
                causes = "; ".join(f"{s.url}: {s.cause}" for s in self.state.values())
                raise NoServerUp(f"no inference server has answered for {self.all_down_s:.0f}s ({causes})")
            await asyncio.sleep(0.1)
        return url

    def base_url(self, session: str) -> str:
        """Where a session's requests go when the env sends them itself (an agent env's group)."""
        url = self._choose(Route(path="/v1", session=session))
        if url is None:
            raise NoServerUp("no inference server is up")
        return url

    async def endpoint(self, session: str) -> tuple[str, int]:
        """For an env that calls inference itself: the base URL for ``session`` and a token
        for :meth:`lost_since` (waits for a server like a request does)."""
        url = await self._pick(Route(path="/v1", session=session))
        srv = self.state.get(url)
        return url, (srv.ejections if srv else 0)

    async def lost_since(self, url: str, token: int) -> bool:
        """Whether the server behind ``url`` was lost since :meth:`endpoint` gave ``token``
        (checked now with a ``/health`` probe, which ejects it if it does not answer).
        False for an external router's URL."""
        srv = self.state.get(url)
        if srv is None:
            return False
        if srv.ejections != token or not srv.up:
            return True
        answer = await self._health(url, 5.0)
        if not isinstance(answer, dict):
            self.eject(url, f"/health: {answer}")
            return True
        return False

    def count_resent(self) -> None:
        self.resent += 1

    # ---- requests -----------------------------------------------------------------------
    async def chat(self, body: dict[str, Any], session: str | None = None) -> ChatCompletionResponse:
        return await self.post(CHAT_COMPLETIONS, body, session)

    async def completions(self, body: dict[str, Any], session: str | None = None) -> CompletionResponse:
        return await self.post(COMPLETIONS, body, session)

    def _headers(self, route: Route) -> dict[str, str] | None:
        return dict(self.router.headers(route)) or None

    async def _send(self, url: str, path: str, body: dict[str, Any], watch: bool = True,
                    headers: dict[str, str] | None = None) -> Any:
        """POST, abandoned (ServerLost) the moment the server is ejected (``watch`` False:
        a server being readmitted, not in routing yet)."""
        srv = self.state.get(url)
        if srv is None or not watch:  # an external router's URL
            return await self.http.post(url + path, json=body, headers=headers)
        lost = srv.lost
        if lost.is_set():
            raise ServerLost(f"{url} is down ({srv.cause})")
        request = asyncio.ensure_future(self.http.post(url + path, json=body, headers=headers))
        waiter = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({request, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not request.done():
                request.cancel()
        if request.done() and not request.cancelled():
            return request.result()
        raise ServerLost(f"{url} was ejected ({srv.cause})")

    async def post(self, path: str, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        import httpx

        prompt = body.get("prompt")
        route = Route(path=path, session=session, prompt_tokens=len(prompt) if isinstance(prompt, list) else 0)
        headers = self._headers(route)
        while True:
            with watchdog.waiting("inference", f"a server up for {path} (none is)"):
                url = await self._pick(route)
            srv = self.state.get(url)
            token = srv.ejections if srv else 0
            t0 = time.monotonic()
            try:
                with watchdog.waiting("inference", f"{path} to {url}"):
                    r = await self._send(url, path, body, headers=headers)
            except (httpx.HTTPError, ServerLost) as exc:
                self.router.finished(route, url, ok=False, seconds=time.monotonic() - t0)
                if not await self._gone(url, token, exc):
                    raise RuntimeError(f"inference request to {url} failed: {_cause(exc)}") from None
                self.resent += 1  # the whole request again, on another server
                continue
            ok = r.status_code == 200
            self.router.finished(route, url, ok=ok, seconds=time.monotonic() - t0)
            if r.status_code == 503 and "retry-after" in r.headers:  # the server's queue is full: later
                await asyncio.sleep(_retry_after(r.headers["retry-after"]))
                continue
            if r.status_code == 409 and "kv_missing" in r.text:  # P/D: the decode phase's KV is gone
                raise KVMissing(r.text[:500])
            if not ok:
                raise RuntimeError(f"inference request failed ({r.status_code}): {r.text[:500]}")
            return r.json()

    async def _gone(self, url: str, token: int, exc: BaseException) -> bool:
        """Whether a failed request's server is gone (ejected now if so; ``token``: its
        ejections when the request was sent): then the request is re-sent."""
        srv = self.state.get(url)
        if srv is None:
            return False  # an external router: it health-checks its servers itself
        if not srv.up or srv.ejections != token:  # lost meanwhile (and maybe readmitted since)
            return True
        if _connection_lost(exc):
            self.eject(url, _cause(exc))
            return True
        answer = await self._health(url, 5.0)  # a timeout: dead, or only slow?
        if not isinstance(answer, dict):
            self.eject(url, f"{_cause(exc)}, and /health: {answer}")
            return True
        return False

    # ---- weights ------------------------------------------------------------------------
    async def load_weights(self, path: Path, version: int) -> None:
        """Load ``version`` into every server that is up, concurrently; a server lost on the
        way is ejected (readmission loads the newest weights into it later)."""
        self.weights = (str(path), version)
        targets = [s for s in self.state.values() if s.up]
        errors = await asyncio.gather(*(self._load(s, str(path), version) for s in targets))
        for srv, error in zip(targets, errors):
            if error and srv.up:  # the server answered and refused the weights: a real error
                raise RuntimeError(error)

    async def _load(self, srv: Server, path: str, version: int) -> str | None:
        """POST the weights to one server; None when loaded, else the cause. A server
        lost on the way is ejected (and the cause returned)."""
        import httpx

        try:
            r = await self._send(srv.url, ADMIN_WEIGHTS, {"path": path, "version": version}, watch=srv.up)
        except (httpx.HTTPError, ServerLost) as exc:
            cause = f"loading weights v{version} failed: {_cause(exc)}"
            self.eject(srv.url, cause)
            return cause
        if r.status_code != 200:
            return f"{srv.url} could not load weights {path}: {r.text[:500]}"
        srv.version = version
        return None

    # ---- metrics and shutdown --------------------------------------------------------------
    def take_metrics(self) -> dict[str, int]:
        """Since the last call: requests re-sent; and the servers up now."""
        out = {"inference/resent": self.resent, "inference/servers_up": len(self.servers_up())}
        self.resent = 0
        return out

    async def close(self) -> None:
        for job in self._watchers:
            job.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self.router.close()
        await self.http.aclose()


# ---- prefill/decode disaggregation ------------------------------------------------------------

MAX_PREFILLS = 3  # prefill phases a request runs before it runs whole on a decode server


class PDInferenceClient:
    """Prefill/decode disaggregation: every request in two phases, over two pools of servers.

    Each pool is an :class:`InferenceClient` (its own router instance, health state, ejection,
    re-sends and readmission). A completion or chat request goes

    1. to a prefill server (the prefill pool's router), with ``kv_transfer_params:
       {"do_remote_decode": true}``: it runs the prompt and writes its KV blocks (and their
       routed experts) to the KV store every server shares, and answers the decode phase's
       ``kv_transfer_params``;
    2. to a decode server (the decode pool's router): the same request with those params; it
       loads the prompt's KV from the store and samples.

    Failures, per phase: a prefill server lost on the way costs a prefill on another (the
    prefill pool re-sends it); a decode server lost costs the decode phase on another decode
    server, from the same KV (the store outlives the server); a decode server that does not
    find the KV (``kv_missing``: evicted, its Mooncake segment gone with a prefill server, or
    the weights changed in between) makes the client prefill again. After
    :data:`MAX_PREFILLS` misses, or with no prefill server up, the request runs whole on a
    decode server (a decode server is a whole engine), so P/D never fails a rollout that one
    server could serve. Requests that score their prompt (``echo``) always run whole.

    Weight updates go to every server of both pools; an agent env that calls inference itself
    gets a decode server (:meth:`endpoint`), which runs its requests whole. Metrics: the two
    pools' re-sends and servers summed, plus ``inference/prefill_up``,
    ``inference/decode_up``, ``inference/kv_reprefilled`` (prefill phases run again after a
    miss) and ``inference/pd_whole`` (requests that fell back to one decode server).
    """

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], router: Callable[[], Router],
                 timeout: float = 600.0, **kwargs: Any) -> None:
        """``router``: makes one router per pool (the ``inference.router`` plugin's class);
        ``kwargs``: :class:`InferenceClient`'s keyword arguments, for both pools."""
        if not prefill or not decode:
            raise ValueError("prefill/decode disaggregation needs at least one prefill and one decode server URL")
        self.prefill = InferenceClient(prefill, router(), timeout, **kwargs)
        self.decode = InferenceClient(decode, router(), timeout, **kwargs)
        self.servers = [*self.prefill.servers, *self.decode.servers]
        self.reprefilled = 0  # prefill phases run again after a decode server missed the KV
        self.whole = 0  # requests run whole on a decode server (no prefill server up, or KV missed every time)

    # ---- health -------------------------------------------------------------------------
    def servers_up(self) -> list[str]:
        return self.prefill.servers_up() + self.decode.servers_up()

    async def wait_ready(self, deadline_s: float = 600.0) -> None:
        await asyncio.gather(self.prefill.wait_ready(deadline_s), self.decode.wait_ready(deadline_s))

    def base_url(self, session: str) -> str:
        return self.decode.base_url(session)

    async def endpoint(self, session: str) -> tuple[str, int]:
        """An agent env's calls run whole on one decode server."""
        return await self.decode.endpoint(session)

    async def lost_since(self, url: str, token: int) -> bool:
        return await self.decode.lost_since(url, token)

    def count_resent(self) -> None:
        self.decode.count_resent()

    # ---- requests -----------------------------------------------------------------------
    async def chat(self, body: dict[str, Any], session: str | None = None) -> ChatCompletionResponse:
        return await self._two_phases(CHAT_COMPLETIONS, body, session)

    async def completions(self, body: dict[str, Any], session: str | None = None) -> CompletionResponse:
        return await self._two_phases(COMPLETIONS, body, session)

    async def _two_phases(self, path: str, body: dict[str, Any], session: str | None) -> Any:
        if body.get("echo"):  # a scored prompt runs whole: every position's logits are needed
            return await self.decode.post(path, body, session)
        for _ in range(MAX_PREFILLS):
            if not self.prefill.servers_up():
                break
            try:
                pre = await self.prefill.post(path, {**body, "kv_transfer_params": {"do_remote_decode": True}},
                                               session)
            except NoServerUp:
                break
            try:
                return await self.decode.post(path, {**body, "kv_transfer_params": pre["kv_transfer_params"]},
                                               session)
            except KVMissing:
                self.reprefilled += 1
        self.whole += 1
        return await self.decode.post(path, body, session)

    # ---- weights ------------------------------------------------------------------------
    async def load_weights(self, path: Path, version: int) -> None:
        """Every server of both pools (see :meth:`InferenceClient.load_weights`)."""
        await asyncio.gather(self.prefill.load_weights(path, version), self.decode.load_weights(path, version))

    # ---- metrics and shutdown --------------------------------------------------------------
    def take_metrics(self) -> dict[str, int]:
        p, d = self.prefill.take_metrics(), self.decode.take_metrics()
        out = {key: p[key] + d[key] for key in p}
        out.update({"inference/prefill_up": p["inference/servers_up"], "inference/decode_up": d["inference/servers_up"],
                    "inference/kv_reprefilled": self.reprefilled, "inference/pd_whole": self.whole})
        self.reprefilled = self.whole = 0
        return out

    async def close(self) -> None:
        await asyncio.gather(self.prefill.close(), self.decode.close())


def inference_client(cfg: Any, router: Callable[[], Router] | None = None, *, servers: Sequence[str] | None = None,
                     **kwargs: Any) -> Client:
    """The client for run config ``cfg``: :class:`PDInferenceClient` over
    :func:`primerl.inference.pd_urls` when prefill/decode are disaggregated, else an
    :class:`InferenceClient` over ``servers`` (the run's inference URLs). ``router`` makes a
    router (default: the ``inference.router`` plugin with ``inference.router_options``; one per
    pool with prefill/decode); ``kwargs`` go to the client."""
    inf = cfg.inference
    if router is None:
        from primerl.routers import load_router

        def router() -> Router:
            return load_router(inf.router, inf.router_options)

    if inf.disaggregated():
        from primerl.inference import pd_urls

        prefill, decode = pd_urls(cfg)
        return PDInferenceClient(prefill, decode, router, **kwargs)
    if servers is None:
        raise ValueError("inference_client needs the servers' URLs when prefill/decode are not disaggregated")
    return InferenceClient(servers, router(), **kwargs)


__all__ = ["Client", "InferenceClient", "KVMissing", "NoServerUp", "PDInferenceClient", "Server", "inference_client"]
