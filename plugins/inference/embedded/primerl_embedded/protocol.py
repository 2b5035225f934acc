"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Only what we serve is accepted; unknown fields are ignored as OpenAI does, but a field
we accept with a wrong value is a 400 that names it. Beyond OpenAI's fields we accept
``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``return_routed_experts``, and every
response carries the token ids of prompt and completion (``prompt_token_ids``,
``token_ids``) and the policy version of every generated token (``policy_versions``), so
training is token-exact.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    n: int = Field(default=1, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    return_routed_experts: bool = False

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported by the embedded engine; set stream=false")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported; the prompt's token ids are returned as prompt_token_ids")
        return v


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "observation"]
    content: str | None = ""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True


class WeightUpdateRequest(BaseModel):
    path: str
    version: int | None = None
