"""The inference backend contract: what ``primerl inference`` calls, and what a server answers.

An inference backend (``register_inference_backends``) serves a model over HTTP: the
OpenAI-compatible API plus primerl's admin endpoints. ``primerl inference`` resolves the
backend named by ``inference.backend``, calls it with no arguments and calls
:meth:`InferenceBackend.serve` on the result; that call blocks until the server stops.

The orchestrator, the env bridges and the trainer never import a backend: they talk HTTP
(the trainer's one exception: the nccl weight channel's :class:`WeightSender`, which it asks
the selected backend for).
So the contract is the wire format, written down here as typed records (``TypedDict``: a
response is a plain JSON object; these name its keys and their types). Every backend (the
embedded engine, a vLLM plugin) must return at least these fields; OpenAI's other fields
may come too. What RL needs beyond OpenAI:

* token exactness: ``prompt_token_ids`` and every choice's ``token_ids``, the ids the
  engine actually ran and sampled (never re-tokenized text);
* the sampling log-probability of every generated token (``logprobs``), as
  :mod:`primerl.sampling` defines it (float32 ``log_softmax(logits / T)``, T = 0 scored at
  1, top-k/top-p not renormalised), which the trainer's importance ratio compares against;
* the policy version of every generated token (``policy_versions``): a weight update may
  land in the middle of a request, and staleness is counted per token;
* with ``return_routed_experts``, the experts each MoE layer routed every processed token
  to (:class:`RoutedExperts`), for router replay (R3);
* the admin endpoints (:data:`ADMIN_WEIGHTS` ...) through which the orchestrator loads
  each new policy into every server without stopping generation.

Records with optional keys are split into a required base and a ``total=False`` subclass
(Python 3.10 has no ``NotRequired``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict

import attrs

from primerl.validators import non_negative, positive

if TYPE_CHECKING:  # pragma: no cover
    from primerl.config import RunConfig


@attrs.define(kw_only=True)
class InferenceConfig:
    """The ``[inference]`` section: the server(s) that generate rollouts."""

    # the inference backend plugin (register_inference_backends): "embedded" (primerl's own
    # engine, CPU or GPU) or "vllm" (its own keys: docs/vllm.md)
    backend: str = "embedded"
    # the router plugin in front of the inference servers (the orchestrator talks to one endpoint)
    router: str = "round-robin"
    # keyword arguments of the router's constructor (docs/routers.md lists each router's),
    # e.g. [inference.router_options] policy = "consistent_hash"
    router_options: dict[str, Any] = attrs.field(factory=dict)
    host: str = "127.0.0.1"  # address the inference server listens on and the orchestrator calls
    # the server's HTTP port (OpenAI API + admin); 0, or a port in use, makes the local
    # launcher pick a free one
    port: int = attrs.field(default=8000, validator=non_negative)
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
    # embedded engine: sequences its KV cache holds, each max_model_len long (running ones
    # and idle cached prefixes); at least max_batch_size, more leaves room for prefix reuse
    kv_slots: int = attrs.field(default=128, validator=positive)
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
    # sequences that may wait for the engine; beyond it requests get 503 (Retry-After)
    max_queue: int = attrs.field(default=4096, validator=positive)

    def resolved_api_key(self) -> str | None:
        """``api_key``, else the ``PRIMERL_API_KEY`` environment variable, else None."""
        import os

        return self.api_key or os.environ.get("PRIMERL_API_KEY") or None

    def disaggregated(self) -> bool:
        """Whether prefill and decode run on separate servers (``prefill_replicas`` and
        ``decode_replicas`` set)."""
        return self.prefill_replicas > 0 and self.decode_replicas > 0

    def pd_urls(self) -> tuple[list[str], list[str]]:
        """(prefill servers, decode servers): ``prefill_urls`` / ``decode_urls`` when set, else
        consecutive ports from ``port``, prefill first."""
        if self.prefill_urls and self.decode_urls:
            return [u.rstrip("/") for u in self.prefill_urls], [u.rstrip("/") for u in self.decode_urls]
        ports = [self.port + i for i in range(self.prefill_replicas + self.decode_replicas)]
        urls = [f"http://{self.host}:{p}" for p in ports]
        return urls[: self.prefill_replicas], urls[self.prefill_replicas:]

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
    with the records below. Options come from ``cfg.inference`` (``max_model_len``,
    ``kv_slots``, ``kv_store``...); a backend ignores the keys it has no use for.
    """

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


def check_port_free(host: str, port: int) -> None:
    """Fail at once, in one line, when ``host:port`` is taken: a server would otherwise find
    out only after building its model (tens of seconds), from uvicorn's bare errno."""
    import socket

    from primerl.errors import PrimerlError

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PrimerlError(f"inference.port {port} on {host} cannot be used ({exc.strerror}): another process "
                               f"holds it; choose another --inference.port (or 0 for a free one)") from None


# ---- endpoints ------------------------------------------------------------------------------

COMPLETIONS = "/v1/completions"  # POST: CompletionResponse
CHAT_COMPLETIONS = "/v1/chat/completions"  # POST: ChatCompletionResponse
CHAT_COMPLETIONS_TOKENS = "/v1/chat/completions/tokens"  # POST: a chat request whose prompt is `tokens`
TOKENIZE = "/tokenize"  # POST: TokenizeResponse (vLLM's)
DETOKENIZE = "/detokenize"  # POST: {"prompt": str}
MODELS = "/v1/models"  # GET: OpenAI's model list
HEALTH = "/health"  # GET: Health, 200 once the server accepts requests
METRICS = "/metrics"  # GET: Prometheus text
GENERATE = "/inference/v1/generate"  # POST: GenerateResponse (vLLM's token-in API: token ids in and out)
ADMIN_WEIGHTS = "/admin/weights"  # POST WeightUpdateRequest -> WeightUpdateResponse
ADMIN_PAUSE = "/admin/pause"  # POST -> PauseResponse (stop scheduling; in-flight requests wait)
ADMIN_RESUME = "/admin/resume"  # POST -> PauseResponse
ADMIN_STATUS = "/admin/status"  # GET -> AdminStatus


# ---- request fields beyond OpenAI's (completions and chat) ------------------------------------


class SamplingExtras(TypedDict, total=False):
    """Request fields every backend accepts beyond OpenAI's (vLLM accepts the same)."""

    top_k: int  # -1: off
    stop_token_ids: list[int]
    ignore_eos: bool
    return_routed_experts: bool  # add RoutedExperts to every choice


# ---- pieces of a choice ---------------------------------------------------------------------


class RoutedExperts(TypedDict):
    """The experts that processed each token, vLLM's layout: base64 of a C-order array.

    ``shape`` is ``[tokens, moe_layers, top_k]``: one row per token the engine *ran* --
    the prompt and every sampled token but the last (which was never fed back) -- starting
    at token ``start`` of the prompt (0 from primerl's engine; the orchestrator rejects
    anything else). ``dtype`` is ``"uint8"`` (up to 256 experts) or ``"int16"``. Rows of a
    prompt prefix served from a KV cache are the experts that computed that cache.
    """

    data: str
    shape: list[int]
    dtype: Literal["uint8", "int16"]
    start: int


class CompletionLogprobs(TypedDict):
    """OpenAI's legacy completions ``logprobs`` (``logprobs: k`` in the request).

    One entry per token of the choice's text: the generated tokens, preceded with
    ``echo: true`` by every prompt token. ``token_logprobs[i]`` is the log-probability of
    token i (None for the first prompt token: nothing predicts it); ``top_logprobs[i]`` maps
    the ``k`` most likely tokens' text to theirs (None for that first token; the whole list
    is None when ``k`` is 0); ``text_offset[i]`` is where token i starts in ``text``.
    """

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    """OpenAI's chat ``logprobs.content[i]``: one generated token."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class _TokenFields(TypedDict):
    token_ids: list[int]  # the generated token ids, exactly as sampled
    policy_versions: list[int]  # the policy version that produced each of token_ids


class TokenFields(_TokenFields, total=False):
    """What every choice carries beyond OpenAI's fields (completions and chat alike)."""

    routed_experts: RoutedExperts  # only with return_routed_experts (and an MoE model)


class CompletionChoice(TokenFields):
    """One choice of ``/v1/completions``."""

    index: int
    text: str  # with echo: the prompt's text, then the completion's
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: CompletionLogprobs | None
    prompt_token_ids: list[int]  # this choice's prompt (a request may hold several prompts)


class ChatMessage(TypedDict, total=False):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict]  # OpenAI's shape; arguments are a JSON string


class ChatChoice(TokenFields):
    """One choice of ``/v1/chat/completions`` (and ``/v1/chat/completions/tokens``)."""

    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None
    logprobs: ChatLogprobs | None


class TokenLogprob(TypedDict):
    """``/inference/v1/generate``'s ``logprobs.content[i]``: tokens named ``"token_id:N"``."""

    token: str
    logprob: float
    top_logprobs: list[dict[str, Any]]  # [{"token": "token_id:N", "logprob": float}], the top k


class GenerateLogprobs(TypedDict):
    content: list[TokenLogprob]


class GenerateChoice(TokenFields):
    """One choice of ``/inference/v1/generate`` (``token_ids``, ``policy_versions`` and, when
    asked, ``routed_experts`` as on the OpenAI routes)."""

    index: int
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: GenerateLogprobs | None  # with sampling_params.logprobs


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# ---- responses --------------------------------------------------------------------------------


class CompletionResponse(TypedDict):
    """``/v1/completions``: choices in prompt order, ``n`` per prompt."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(TypedDict):
    """``/v1/chat/completions``: ``prompt_token_ids`` is the rendered conversation."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    prompt_token_ids: list[int]
    usage: Usage


class _GenerateResponse(TypedDict):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    choices: list[GenerateChoice]
    usage: Usage


class GenerateResponse(_GenerateResponse, total=False):
    """``/inference/v1/generate`` (vLLM's shape, as ``renderers.client.generate`` reads it)."""

    # with sampling_params.prompt_logprobs: per prompt token (the first None), its logprob and
    # top k by token id, as vLLM answers: {"N": {"logprob": float, "rank": int}}
    prompt_logprobs: list[dict[str, dict[str, float]] | None]


class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int
    tokens: list[int]


class Health(TypedDict):
    status: Literal["ok"]
    policy_version: int
    paused: bool


class WeightUpdateRequest(TypedDict, total=False):
    """``POST /admin/weights``: ``path`` (required) is an HF safetensors checkpoint directory,
    or one safetensors file (the co-located ``/dev/shm`` channel); ``version`` the policy
    version its tokens will report (default: the current one + 1). Requests in flight carry
    on; every later token reports the new version. A bad checkpoint is a 400 and changes
    nothing."""

    path: str
    version: int


class WeightUpdateResponse(TypedDict):
    policy_version: int
    seconds: float


class PauseResponse(TypedDict):
    paused: bool
    policy_version: int


class AdminStatus(TypedDict):
    policy_version: int
    paused: bool
    running: int  # sequences being generated
    waiting: int  # sequences queued for a slot
    kv_usage: float  # share of KV held by running sequences


class ErrorBody(TypedDict):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(TypedDict):
    """Any 4xx: OpenAI's error shape, with a reason a person can act on."""

    error: ErrorBody


def inference_urls(cfg: Any) -> list[str]:
    """The inference servers' base URLs: those the launcher started (the run-time record,
    :mod:`primerl.runtime`), else ``inference.urls`` when set (servers started otherwise),
    else replica i on ``inference.host:inference.port + i``."""
    from primerl.runtime import read_runtime

    inf = cfg.inference
    started = read_runtime(cfg.output_dir)
    if started is not None and started.inference_urls:
        return [u.rstrip("/") for u in started.inference_urls]
    if inf.urls:
        return [u.rstrip("/") for u in inf.urls]
    if inf.prefill_replicas:  # prefill/decode pools: every server, prefill first
        prefill, decode = pd_urls(cfg)
        return prefill + decode
    return [f"http://{inf.host}:{inf.port + i}" for i in range(inf.replicas)]


def pd_urls(cfg: Any) -> tuple[list[str], list[str]]:
    """(prefill servers, decode servers) of a prefill/decode run: the launcher's (the
    run-time record), else ``inference.prefill_urls`` / ``decode_urls``, else the pools on
    consecutive ports from ``inference.port``."""
    from primerl.runtime import read_runtime

    started = read_runtime(cfg.output_dir)
    if started is not None and started.prefill_urls and started.decode_urls:
        return [u.rstrip("/") for u in started.prefill_urls], [u.rstrip("/") for u in started.decode_urls]
    return cfg.inference.pd_urls()
