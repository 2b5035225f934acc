"""The serving API, written down once: every endpoint's path, request and response.

What ``primerl inference`` answers, whatever the backend (the embedded engine, vLLM behind
its proxy), and what the orchestrator, the env bridges and the trainer send: the
OpenAI-compatible API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``),
vLLM's extensions that RL libraries call (``/v1/chat/completions/tokens``, ``/tokenize``,
``/detokenize``, the token-in ``/inference/v1/generate``), ``/health``, ``/metrics`` and
primerl's admin endpoints (``/admin/weights``, ``/admin/pause``, ``/admin/resume``,
``/admin/status``). The serving front (:mod:`primerl.serving.front`) parses the requests
and shapes the responses; a backend only generates.

* **Requests** are pydantic models: only what we serve is accepted; unknown fields are
  ignored as OpenAI does, but a field we accept with a wrong value is a 400 that names it.
  Beyond OpenAI's fields every route accepts ``top_k``, ``stop_token_ids``, ``ignore_eos``
  and ``return_routed_experts``; chat requests also vLLM's ``return_token_ids`` and
  ``chat_template_kwargs``. ``echo`` on completions is OpenAI's: the prompt's text before
  the completion's and, with ``logprobs``, its tokens' log-probabilities (the first is
  null) before the completion's.
* **Responses** are ``TypedDict`` records (a response is a plain JSON object; these name its
  keys and their types, at no cost per request). Every backend returns at least these
  fields; OpenAI's other fields may come too. What RL needs beyond OpenAI:

  - token exactness: ``prompt_token_ids`` and every choice's ``token_ids``, the ids the
    engine actually ran and sampled (never re-tokenized text);
  - the sampling log-probability of every generated token (``logprobs``), as
    :mod:`primerl.sampling` defines it (float32 ``log_softmax(logits / T)``, T = 0 scored
    at 1, top-k/top-p not renormalised), which the trainer's importance ratio compares
    against;
  - the policy version of every generated token (``policy_versions``): a weight update may
    land in the middle of a request, and staleness is counted per token;
  - with ``return_routed_experts``, the experts each MoE layer routed every processed token
    to (:class:`RoutedExperts`), for router replay (R3);
  - the admin endpoints (:data:`ADMIN_WEIGHTS` ...) through which the orchestrator loads
    each new policy into every server without stopping generation.

Records with optional keys are split into a required base and a ``total=False`` subclass
(Python 3.10 has no ``NotRequired``). Needs the ``train`` extra (pydantic, through fastapi).
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pydantic import BaseModel, Field, field_validator, model_validator

__all__ = [
    "ADMIN_PAUSE",
    "ADMIN_RESUME",
    "ADMIN_STATUS",
    "ADMIN_WEIGHTS",
    "AdminStatus",
    "AssistantMessage",
    "CHAT_COMPLETIONS",
    "CHAT_COMPLETIONS_TOKENS",
    "COMPLETIONS",
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTokenLogprob",
    "ChatTokensRequest",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DETOKENIZE",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorBody",
    "ErrorResponse",
    "GENERATE",
    "GenerateChoice",
    "GenerateLogprobs",
    "GenerateRequest",
    "GenerateResponse",
    "GenerateSamplingParams",
    "HEALTH",
    "Health",
    "METRICS",
    "MODELS",
    "ModelCard",
    "ModelList",
    "PauseResponse",
    "PrefillResponse",
    "PrefillTransfer",
    "PrefilledPrompt",
    "RoutedExperts",
    "TOKENIZE",
    "TokenFields",
    "TokenLogprob",
    "TokenizeRequest",
    "TokenizeResponse",
    "Tool",
    "TopLogprob",
    "Usage",
    "WeightUpdateRequest",
    "WeightUpdateResponse",
]


# ---- endpoints --------------------------------------------------------------------------------

COMPLETIONS = "/v1/completions"  # POST CompletionRequest -> CompletionResponse (PrefillResponse: a prefill phase)
CHAT_COMPLETIONS = "/v1/chat/completions"  # POST ChatCompletionRequest -> ChatCompletionResponse
CHAT_COMPLETIONS_TOKENS = "/v1/chat/completions/tokens"  # POST ChatTokensRequest -> ChatCompletionResponse
TOKENIZE = "/tokenize"  # POST TokenizeRequest -> TokenizeResponse (vLLM's)
DETOKENIZE = "/detokenize"  # POST DetokenizeRequest -> DetokenizeResponse
MODELS = "/v1/models"  # GET -> ModelList (OpenAI's)
HEALTH = "/health"  # GET -> Health, 200 once the server accepts requests
METRICS = "/metrics"  # GET -> Prometheus text
GENERATE = "/inference/v1/generate"  # POST GenerateRequest -> GenerateResponse (vLLM's token-in API)
ADMIN_WEIGHTS = "/admin/weights"  # POST WeightUpdateRequest -> WeightUpdateResponse
ADMIN_PAUSE = "/admin/pause"  # POST -> PauseResponse (stop scheduling; in-flight requests wait)
ADMIN_RESUME = "/admin/resume"  # POST -> PauseResponse
ADMIN_STATUS = "/admin/status"  # GET -> AdminStatus
# any 4xx (and a 503 with Retry-After when the queue is full): ErrorResponse


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


class AssistantMessage(TypedDict, total=False):
    """A chat choice's ``message``."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict]  # OpenAI's shape; arguments are a JSON string


class ChatChoice(TokenFields):
    """One choice of ``/v1/chat/completions`` (and ``/v1/chat/completions/tokens``)."""

    index: int
    message: AssistantMessage
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


class DetokenizeResponse(TypedDict):
    prompt: str


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int  # as vLLM reports it


class ModelList(TypedDict):
    """``GET /v1/models``: the one model served."""

    object: Literal["list"]
    data: list[ModelCard]


class PrefilledPrompt(TypedDict):
    prompt_token_ids: list[int]
    blocks: int  # full blocks of the prompt the KV store holds
    policy_version: int  # the weights that computed them


class PrefillTransfer(TypedDict):
    """``kv_transfer_params`` of a prefill phase's answer: send it with the same request to a
    decode server (its decode phase)."""

    do_remote_prefill: Literal[True]
    block_size: int
    prompts: list[PrefilledPrompt]


class PrefillResponse(TypedDict):
    """A completion or chat request with ``kv_transfer_params: {"do_remote_decode": true}``
    (prefill/decode's prefill phase): the prompts ran, nothing was sampled."""

    id: str
    object: Literal["primerl.prefill"]
    created: int
    model: str
    usage: Usage
    kv_transfer_params: PrefillTransfer


class Health(TypedDict):
    status: Literal["ok"]
    policy_version: int
    paused: bool


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


# ---- requests -----------------------------------------------------------------------------------


class _Streamless(BaseModel):
    stream: bool = False

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported by primerl's inference API; set stream=false")
        return v


class _SamplingFields(BaseModel):
    """The sampling fields every route accepts (OpenAI's, vLLM's extensions)."""

    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    n: int = Field(default=1, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_routed_experts: bool = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class _Sampling(_SamplingFields, _Streamless):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # prefill/decode disaggregation (vLLM's): {"do_remote_decode": true} asks for the prefill
    # phase, the prefill's answer for the decode phase (primerl.serving.front)
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo: the prompt is scored and nothing generated (how lm-eval-style scoring may ask)
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt's text (and with logprobs its tokens' logprobs) before the completion's

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo: the prompt is scored, nothing generated)")
        return self


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "observation"]
    content: str | list[dict[str, Any]] | None = ""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict[str, Any]] | None) -> str | None:
        """Content parts are joined when they are all text; images and audio are not served."""
        if not isinstance(v, list):
            return v
        kinds = {part.get("type") for part in v}
        if kinds - {"text"}:
            raise ValueError(f"only text content parts are supported, got {sorted(map(str, kinds - {'text'}))}")
        return "".join(str(part.get("text", "")) for part in v)


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, Any]

    @field_validator("function")
    @classmethod
    def _named(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(v.get("name"), str) or not v["name"]:
            raise ValueError("a tool's function needs a non-empty 'name'")
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    # "auto" (default with tools) parses tool calls out of the output; "none" leaves the text alone
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = True  # always returned; accepted for vLLM clients that ask

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump() for t in self.tools] if self.tools else None

    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class ChatTokensRequest(ChatCompletionRequest):
    """``/v1/chat/completions/tokens``: ``tokens`` is the prompt; ``messages`` and ``tools``
    say what it holds (tools still decide whether tool calls are parsed from the output)."""

    tokens: list[int] = Field(min_length=1)


class GenerateSamplingParams(_SamplingFields):
    """``sampling_params`` of ``/inference/v1/generate`` (vLLM's ``SamplingParams`` names; the
    fields primerl serves, unknown ones ignored; ``return_routed_experts`` here too, for
    clients that pass ``sampling_params`` only)."""

    max_tokens: int | None = Field(default=16, ge=0)  # 0: score the prompt only (with prompt_logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the sampled token's (and the top k)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    skip_special_tokens: bool = True  # accepted: the answer is tokens, nothing is detokenized

    @model_validator(mode="after")
    def _zero_tokens_score_the_prompt(self) -> GenerateSamplingParams:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be >= 1 (0 only with prompt_logprobs: the prompt is scored)")
        return self


class GenerateRequest(_Streamless):
    """``POST /inference/v1/generate``: vLLM's token-in generation (what verifiers' training
    clients call through ``renderers.client.generate``)."""

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    cache_salt: str | None = Field(default=None, min_length=1)  # prefixes are reused only under the same salt
    priority: int = 0  # lower runs first (vLLM's priority scheduling); equal: arrival order
    return_routed_experts: bool = False
    request_id: str | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class WeightUpdateRequest(BaseModel):
    """``POST /admin/weights``: ``path`` is an HF safetensors checkpoint directory, or one
    safetensors file (the co-located ``/dev/shm`` channel); ``version`` the policy version its
    tokens will report (default: the current one + 1). Requests in flight carry on; every
    later token reports the new version. A bad checkpoint is a 400 and changes nothing."""

    path: str
    version: int | None = None
