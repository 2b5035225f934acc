"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Only what we serve is accepted; unknown fields are ignored as OpenAI does, but a field
we accept with a wrong value is a 400 that names it. Beyond OpenAI's fields we accept
``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``return_routed_experts``, and every
response carries the token ids of prompt and completion (``prompt_token_ids``,
``token_ids``) and the policy version of every generated token (``policy_versions``), so
training is token-exact.

``echo`` on completions is OpenAI's: the prompt's text before the completion's and, with
``logprobs``, its tokens' log-probabilities (the first is null) before the completion's.

Beyond OpenAI, what vLLM serves and RL libraries use (verifiers' token client, prime-rl):
``return_token_ids`` and ``chat_template_kwargs`` on chat requests, ``POST
/v1/chat/completions/tokens`` (a chat request whose prompt is given as ``tokens``, so a
multi-turn episode's earlier turns are never re-tokenized), ``POST /tokenize`` and ``POST
/detokenize``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator


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
    path: str
    version: int | None = None
