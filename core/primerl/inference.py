"""The inference backend contract: its ``[inference]`` section (:class:`InferenceConfig`), what
``primerl inference`` calls, and where the servers are.

An inference backend (``register_inference_backends``) serves a model over HTTP: the
OpenAI-compatible API plus primerl's admin endpoints, every one of them written down once in
:mod:`primerl.serving.protocol` (its path, request and response) and answered by the one
serving front (:mod:`primerl.serving.front`) over the backend's generator. ``primerl
inference`` resolves the backend named by ``inference.backend``, calls it with no arguments
and calls :meth:`InferenceBackend.serve` on the result; that call blocks until the server
stops.

The orchestrator, the env bridges and the trainer never import a backend: they talk HTTP to
the servers :func:`servers` names (the trainer's one exception: the nccl weight channel's
:class:`WeightSender`, which it asks the selected backend for). This module is light (no
pydantic, no torch): the registry reads :class:`InferenceBackendCapabilities` from it when a
config loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import attrs

from primerl.validators import non_negative, positive

if TYPE_CHECKING:  # pragma: no cover
    import socket

    from primerl.config import RunConfig

__all__ = [
    "InferenceBackend",
    "InferenceConfig",
    "InferenceBackendCapabilities",
    "Servers",
    "WeightSender",
    "listening",
    "server_socket",
    "inference_urls",
    "pd_urls",
    "server_url",
    "servers",
]


@attrs.define(kw_only=True)
class InferenceConfig:
    """The ``[inference]`` section: the server(s) that generate rollouts."""

    # the keys (fnmatch patterns) that may differ when a run continues (primerl.resume):
    # where the servers are, not what they compute; a backend's Config adds its own
    may_change_on_resume: ClassVar[tuple[str, ...]] = ("host", "*port", "*urls", "api_key", "*replicas", "role",
                                                       "listen_fd")

    # the inference backend plugin (register_inference_backends): "embedded" (primerl's own
    # engine, CPU or GPU) or "vllm" (its own keys: docs/vllm.md)
    backend: str = "embedded"
    # the router plugin in front of the inference servers (the orchestrator talks to one endpoint)
    router: str = "round-robin"
    # keyword arguments of the router's constructor (docs/routers.md lists each router's),
    # e.g. [inference.router_options] policy = "consistent_hash"
    router_options: dict[str, Any] = attrs.field(factory=dict)
    host: str = "127.0.0.1"  # address the inference server listens on and the orchestrator calls
    # the server's HTTP port (OpenAI API + admin); 0, or a port in use (another run's
    # included), makes the local launcher pick a free one
    port: int = attrs.field(default=8000, validator=non_negative)
    # a socket this server inherited, bound to host:port, to listen on (the local launcher binds
    # each server's port for the whole run and hands it down, so that no other process, another
    # run on the machine included, takes it before the server listens or while it restarts);
    # None: the server binds host:port itself
    listen_fd: int | None = attrs.field(default=None, validator=attrs.validators.optional(non_negative))
    # inference servers (replicas of the same policy) the launcher starts; the orchestrator
    # spreads requests over them through the router, re-sends a dead one's requests to
    # another, and readmits it with the current weights when its /health answers again
    replicas: int = attrs.field(default=1, validator=positive)
    # local and slurm launchers: times each inference server that exits while another one serves
    # is started again on its port (the orchestrator readmits it with the current weights);
    # past that, or with no other server up, it stays down (and with none up the run stops)
    max_restarts: int = attrs.field(default=3, validator=non_negative)
    # the servers' base URLs ("http://host:port") the orchestrator and trainer call; empty:
    # replica i on host:port+i. The local launcher sets it to the ports it picked
    urls: list[str] = attrs.field(factory=list)
    # prefill/decode disaggregation (docs/kv_stores.md, "Prefill/decode"): this many servers
    # only prefill prompts and hand their KV, through the KV store, to decode_replicas servers
    # that sample; the embedded engine needs a KV store every server shares (disk, whose
    # directory the launcher puts under the run directory, or mooncake). 0 and 0: off; when
    # set, the two replace replicas
    prefill_replicas: int = attrs.field(default=0, validator=non_negative)
    # with prefill_replicas: the servers that load each prompt's KV from the store and sample
    decode_replicas: int = attrs.field(default=0, validator=non_negative)
    # with prefill/decode: the prefill servers' base URLs (urls then lists every server,
    # prefill first: weight updates reach them all); empty: prefill server i on host:port+i.
    # The local launcher sets it
    prefill_urls: list[str] = attrs.field(factory=list)
    # with prefill/decode: the decode servers' base URLs; empty: decode server j on
    # host:port+prefill_replicas+j. The local launcher sets it
    decode_urls: list[str] = attrs.field(factory=list)
    # this server's part with prefill/decode, set per server by the launcher: "both" (whole
    # requests), "prefill" or "decode". The embedded engine serves either phase on request;
    # vLLM gets the matching KV connector role (kv_producer / kv_consumer)
    role: Literal["both", "prefill", "decode"] = "both"
    # sequences decoded together (vLLM's --max-num-seqs); the embedded engine also refuses
    # a request for more samples (n) than this
    max_batch_size: int = attrs.field(default=64, validator=positive)
    # most tokens of one sequence, prompt + completion (vLLM's --max-model-len)
    max_model_len: int = attrs.field(default=1024, validator=positive)
    # "float32", "bfloat16" or "float16" for the served model; None: the model section's dtype
    dtype: str | None = None
    # KV store plugin (register_kv_stores) that keeps finished sequences' KV for prefix reuse
    kv_store: str = "memory"
    # keyword arguments of the KV store's constructor (docs/kv_stores.md lists each store's),
    # e.g. [inference.kv_store_options] max_bytes = 17179869184
    kv_store_options: dict[str, Any] = attrs.field(factory=dict)
    # where the engine runs: "auto" is CUDA when torch sees a GPU, else the CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # the key every request must carry (Authorization: Bearer KEY); needed to bind a host
    # other than loopback. PRIMERL_API_KEY in the environment keeps it out of config.toml.
    api_key: str | None = None

    def resolved_api_key(self) -> str | None:
        """``api_key``, else the ``PRIMERL_API_KEY`` environment variable, else None."""
        import os

        return self.api_key or os.environ.get("PRIMERL_API_KEY") or None

    def disaggregated(self) -> bool:
        """Whether prefill and decode run on separate servers (``prefill_replicas`` and
        ``decode_replicas`` set)."""
        return self.prefill_replicas > 0 and self.decode_replicas > 0

    def fixed_ports(self) -> dict[str, int]:
        """Ports a server binds besides ``port`` that the config fixes (key -> port): servers
        sharing a machine cannot share them. None here; a backend's Config names its own."""
        return {}

    def resolved_device(self) -> str:
        """``device``, with ``auto`` resolved (a backend's Config may resolve it its own way)."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def check(self, run: RunConfig, sources: Mapping[str, str]) -> None:
        """Rules that need the whole run (the backend's device, the model, the trainer's
        settings); called once the run's config is complete. A backend's ``Config`` (a
        subclass) overrides it and raises ConfigError naming the key."""


class InferenceBackend(Protocol):
    """What ``primerl inference`` calls: ``backend_cls().serve(cfg)``.

    ``serve`` builds the model from ``cfg.model`` and serves it on ``cfg.inference.host`` /
    ``cfg.inference.port`` until the process is stopped, answering the endpoints below
    with the records of :mod:`primerl.serving.protocol` (a backend serves the one front,
    :func:`primerl.serving.front.create_app`, over its generator). Options come from
    ``cfg.inference``, an instance of the backend's ``Config``.
    """

    # the class that checks [inference] when this backend is selected: InferenceConfig, or a
    # subclass with the backend's own keys (load_config structures the section with it)
    Config: ClassVar[type[InferenceConfig]]

    def serve(self, cfg: RunConfig) -> None: ...


@attrs.frozen(kw_only=True)
class InferenceBackendCapabilities:
    """What a backend declares when it registers (``register(..., capabilities=...)``).

    ``weight_sender``: ``"module:attr"`` of ``(cfg, urls) -> WeightSender`` when the backend
    receives weights straight from the trainer (``trainer.weight_channel = "nccl"``); the
    trainer's global rank 0 calls it once, after v0 is on disk. A config with the nccl
    channel and a backend that declares none is refused up front.
    """

    weight_sender: str | None = None


class WeightSender(Protocol):
    """Streams published weights to inference servers without the filesystem (the nccl
    weight channel), unit by unit as the trainer gathers them."""

    def send(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> Any:
        """Send every ``(HF name, tensor)`` of the model and make ``version`` the servers'
        policy version (in-flight requests carry on, later ones run on it)."""
        ...

    def mark(self, directory: Path, version: int) -> None:
        """Write into ``weights/step_n/`` (before its ``STABLE``) what tells the servers'
        ``/admin/weights`` that version ``n`` arrived by this channel."""
        ...

    def close(self) -> None: ...


def server_socket(inf: InferenceConfig) -> socket.socket:
    """The socket this server will listen on, bound before its model is built (tens of
    seconds): a port in use fails at once, in one line, rather than later from uvicorn's bare
    errno, and no process takes the port meanwhile. With ``listen_fd``, the socket a launcher
    bound and handed down (checked to be a TCP socket bound to ``port``)."""
    import socket

    from primerl.errors import PrimerlError

    if inf.listen_fd is not None:
        try:
            sock = socket.socket(fileno=inf.listen_fd)
        except OSError as exc:
            raise PrimerlError(f"inference.listen_fd {inf.listen_fd} is not a socket this process inherited "
                               f"({exc.strerror}): leave it unset, and the server binds inference.port itself") from None
        bound = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
        if sock.type != socket.SOCK_STREAM or bound is None or (inf.port and bound != inf.port):
            raise PrimerlError(f"inference.listen_fd {inf.listen_fd} is not a TCP socket bound to inference.port "
                               f"{inf.port} (bound to: {bound}): leave it unset, and the server binds the port itself")
        sock.set_inheritable(False)  # this server's own children (vLLM) do not hold the port
        return sock
    sock = socket.socket(socket.AF_INET6 if ":" in inf.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT is no obstacle
    try:
        sock.bind((inf.host.strip("[]"), inf.port))
    except OSError as exc:
        sock.close()
        raise PrimerlError(f"inference.port {inf.port} on {inf.host} cannot be used ({exc.strerror}): another process "
                           f"holds it; choose another --inference.port (or 0 for a free one)") from None
    return sock


def listening(sock: socket.socket, inf: InferenceConfig) -> socket.socket:
    """``sock`` (from :func:`server_socket`) listening, for uvicorn to serve on
    (``uvicorn.Server.run(sockets=[...])``), with ``SO_REUSEADDR`` as uvicorn sets it: the
    connections it closes, waiting out TIME_WAIT, do not keep the port from the server's next
    start. Another process that bound the port with ``SO_REUSEADDR`` too and listened first
    fails here in one line."""
    import socket

    from primerl.errors import PrimerlError

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.listen(2048)
    except OSError as exc:
        raise PrimerlError(f"inference.port {sock.getsockname()[1]} on {inf.host} cannot be used ({exc.strerror}): "
                           f"another process listens on it; choose another --inference.port (or 0 for a free "
                           f"one)") from None
    return sock


# ---- where the servers are: one place -------------------------------------------------------


def server_url(host: str, port: int) -> str:
    """The base URL of a server on ``host:port`` (an IPv6 address in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


@attrs.frozen
class Servers:
    """A run's inference servers, by base URL (no trailing slash)."""

    every: tuple[str, ...]  # every server (prefill ones first with prefill/decode): what weight updates reach
    prefill: tuple[str, ...] = ()  # with prefill/decode: the prefill pool
    decode: tuple[str, ...] = ()  # and the decode pool


def servers(cfg: Any) -> Servers:
    """Where run ``cfg``'s inference servers are, worked out here and nowhere else: those the
    launcher started (the run-time record, :mod:`primerl.runtime`), else the URLs the config
    names (``inference.urls``; with prefill/decode ``inference.prefill_urls`` and
    ``decode_urls``: servers started otherwise), else ports from ``inference.port`` on
    (replica i on ``port + i``; with prefill/decode, prefill server i on ``port + i`` and
    decode server j on ``port + prefill_replicas + j``)."""
    from primerl.runtime import read_runtime

    inf = cfg.inference
    started = read_runtime(cfg.output_dir)
    if started is not None and started.prefill_urls and started.decode_urls:
        prefill, decode = _urls(started.prefill_urls), _urls(started.decode_urls)
    elif inf.prefill_urls and inf.decode_urls:
        prefill, decode = _urls(inf.prefill_urls), _urls(inf.decode_urls)
    else:
        ports = [inf.port + i for i in range(inf.prefill_replicas + inf.decode_replicas)]
        pools = [server_url(inf.host, p) for p in ports]
        prefill, decode = tuple(pools[:inf.prefill_replicas]), tuple(pools[inf.prefill_replicas:])
    if started is not None and started.inference_urls:
        every = _urls(started.inference_urls)
    elif inf.urls:
        every = _urls(inf.urls)
    elif inf.prefill_replicas:
        every = prefill + decode
    else:
        every = tuple(server_url(inf.host, inf.port + i) for i in range(inf.replicas))
    return Servers(every=every, prefill=prefill, decode=decode)


def _urls(urls: Iterable[str]) -> tuple[str, ...]:
    return tuple(u.rstrip("/") for u in urls)


def inference_urls(cfg: Any) -> list[str]:
    """Every inference server's base URL (:func:`servers`)."""
    return list(servers(cfg).every)


def pd_urls(cfg: Any) -> tuple[list[str], list[str]]:
    """(prefill servers, decode servers) of a prefill/decode run (:func:`servers`)."""
    found = servers(cfg)
    return list(found.prefill), list(found.decode)
