"""The one serving front: every endpoint of ``primerl inference``, written once, over a generator.

What: the OpenAI-compatible API (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``), vLLM's extensions that RL libraries call (``/v1/chat/completions/tokens``,
``/tokenize``, ``/detokenize``, and the token-in ``/inference/v1/generate``), ``/health``, ``/metrics`` and the admin endpoints
(``/admin/weights``, ``/admin/pause``, ``/admin/resume``, ``/admin/status``), each with the
request and response :mod:`primerl.serving.protocol` writes down: request parsing, prompts
and chat templates (:class:`TokenizerFrontend`), and the shaping of every response (text,
stop strings, logprobs in OpenAI's two shapes, tool calls, usage, and primerl's token-exact
fields: ``token_ids``, ``policy_versions``, ``routed_experts``). In front of every endpoint,
:class:`Guard`: the API key and the body size.

Why: a backend implements only :class:`Generator` — prompt ids and sampling in; tokens,
logprobs, policy versions and routed experts out (:class:`Generation`) — plus its admin
calls. The embedded engine and the vLLM proxy therefore accept and refuse the same bodies
and answer in the same shape, and the token-in routes and the OpenAI routes are two views
of one call. A backend refuses a request by raising :class:`Refused` (status, message,
param, kind), which becomes an OpenAI-shaped error.

Prefill/decode disaggregation is vLLM's ``kv_transfer_params`` on a completion or chat
request: ``{"do_remote_decode": true}`` asks for the prefill phase (the generator's
:meth:`Generator.prefill` answers the decode phase's params), ``{"do_remote_prefill": true,
...}`` (that answer) is the decode phase. A generator that does not serve phases
(``serves_phases`` False) runs such a request whole.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from primerl.envs.multiturn import split_tool_calls
from primerl.serving import protocol as api
from primerl.serving.protocol import (
    ChatCompletionRequest,
    ChatTokensRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    WeightUpdateRequest,
)

__all__ = ["MAX_BODY_BYTES", "Generation", "Generator", "Guard", "Refused", "Sampling", "TokenizerFrontend",
           "create_app", "error", "prometheus"]


MAX_BODY_BYTES = 8 * 1024 * 1024  # a request body above this is refused (413) before it is parsed


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    """An error response in OpenAI's shape."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": status}})


class Guard:
    """ASGI middleware in front of every endpoint: the API key, then the body size.

    * ``api_key`` set: a request without ``Authorization: Bearer <key>`` gets 401 (compared
      in constant time), whatever the endpoint, admin ones included;
    * a body over ``max_body_bytes`` gets 413, whether its ``Content-Length`` says so or it
      arrives chunked: the body is read here up to the limit and handed on only if it fits,
      so an oversized request never reaches the JSON parser and memory stays bounded.
    """

    def __init__(self, app: Any, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            response = error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's "
                                  "inference.api_key or PRIMERL_API_KEY)", kind="authentication_error")
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_body_bytes:
            return await self._too_large(scope, receive, send, int(size))
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                return await self._too_large(scope, receive, send, None)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, delivered = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any, size: int | None) -> None:
        what = f"of {size} bytes " if size is not None else ""
        response = error(413, f"request body {what}exceeds the limit of {self.max_body_bytes} bytes")
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


class TokenizerFrontend:
    """What the front does with the tokenizer before a generator runs: prompts given as text,
    token ids or lists of either become token ids; chats go through the model's chat
    template."""

    tokenizer: Any

    def piece(self, tok: int) -> str:
        """One token's text, as logprobs report it; remembered (a response asks for every
        token's, and decoding one token costs tens of microseconds)."""
        pieces = self.__dict__.setdefault("_pieces", {})
        if tok not in pieces:
            pieces[tok] = self.tokenizer.decode([tok])
        return pieces[tok]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
               template_kwargs: dict[str, Any] | None) -> list[int]:
        """Token ids of a conversation through the chat template; ValueError names what failed."""
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=False, **(template_kwargs or {}))
        except Exception as exc:
            raise ValueError(f"messages could not be rendered with the chat template: {exc}") from exc
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def prompts_of(self, req: Any) -> tuple[list[list[int]], list[str | None]]:
        """Token ids of each prompt of a completion request, and its text when given as text
        (echo returns it verbatim); ValueError when the prompt is none of the accepted shapes."""
        p, enc = req.prompt, self.tokenizer.encode
        if isinstance(p, str):
            return [enc(p, add_special_tokens=False)], [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)], [None]
        if p and all(isinstance(x, str) for x in p):
            return [enc(x, add_special_tokens=False) for x in p], list(p)
        if p and all(isinstance(x, list) for x in p):
            return [list(x) for x in p], [None] * len(p)
        raise ValueError("prompt must be a non-empty string, list of strings, or token id list(s)")


class Refused(Exception):
    """A request the backend will not or cannot serve: an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def response(self) -> JSONResponse:
        r = error(self.status, self.message, self.param, kind=self.kind)
        r.headers.update(self.headers)
        return r


@attrs.frozen(slots=True)
class Sampling:
    """What to sample for one prompt (a backend maps it to its engine's parameters)."""

    n: int = 1
    max_tokens: int = 16  # 0: score the prompt only (echo with logprobs)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's and the top k alternatives
    prompt_logprobs: int | None = None  # echo: the prompt's tokens' too (and their top k)
    return_routed_experts: bool = False
    phase: str | None = None  # prefill/decode: "prefill", "decode", or None (the whole request)
    kv_transfer_params: dict[str, Any] | None = None  # the decode phase's, from its prefill
    cache_salt: str | None = None  # cached prefixes are reused only by requests of the same salt
    priority: int = 0  # lower is scheduled first; equal priorities in arrival order

    @classmethod
    def of(cls, req: Any, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
           phase: str | None = None) -> Sampling:
        return cls(n=req.n, max_tokens=16 if max_tokens is None else max_tokens, temperature=req.temperature,
                   top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=tuple(req.stop_list()),
                   stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logprobs=logprobs,
                   prompt_logprobs=prompt_logprobs, return_routed_experts=req.return_routed_experts, phase=phase,
                   kv_transfer_params=req.kv_transfer_params if phase else None)


@attrs.define(slots=True)
class Generation:
    """One sampled sequence, as a backend hands it to the front."""

    token_ids: list[int]
    logprobs: list[float]  # the sampling log-probability of each token (primerl.sampling)
    policy_versions: list[int]  # the policy version that produced each token
    finish_reason: str | None
    top_logprobs: list[dict[int, float]] = attrs.Factory(list)  # per token: the top k alternatives
    text: str | None = None  # the text when a stop string cut it; None: the tokens decoded
    routed_experts: api.RoutedExperts | None = None
    prompt_logprobs: list[float | None] | None = None  # echo: one per prompt token (the first None)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


class Generator(Protocol):
    """What a backend implements for the front (:func:`create_app`)."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    serves_phases: bool  # prefill/decode phases (kv_transfer_params) are served, not ignored

    def check(self, prompt_ids: list[int], sampling: Sampling) -> None:
        """Raise :class:`Refused` for a request this backend cannot run (before any work)."""

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> list[Generation]:
        """``sampling.n`` sequences from ``prompt_ids``; :class:`Refused` when it cannot."""

    async def prefill(self, prompts: list[list[int]], sampling: Sampling) -> api.PrefillResponse:
        """Prefill/decode's prefill phase: run the prompts, sample nothing, hand their KV on;
        the response (with the decode phase's ``kv_transfer_params``)."""

    def health(self) -> api.Health: ...

    async def status(self) -> api.AdminStatus: ...

    async def metrics(self) -> str:
        """Prometheus text of the backend's figures (primerl's policy version included)."""

    async def update_weights(self, req: WeightUpdateRequest) -> api.WeightUpdateResponse:
        """Load ``req.path`` as version ``req.version``; :class:`Refused` (the old weights kept)
        when it cannot."""

    async def pause(self) -> api.PauseResponse: ...

    async def resume(self) -> api.PauseResponse: ...

    def routes(self) -> Sequence[tuple[str, str, Callable[..., Any]]]:
        """The backend's own endpoints beside the front's: ``(method, path, handler)``."""


def phase_of(req: Any) -> str | None:
    """``"prefill"``, ``"decode"`` or None (a whole request) from ``kv_transfer_params``."""
    kv = req.kv_transfer_params or {}
    if kv.get("do_remote_decode"):
        return "prefill"
    if kv.get("do_remote_prefill"):
        return "decode"
    return None


def _check_handoff(req: Any, prompts: list[list[int]]) -> None:
    """A decode phase's prompts must be the ones its prefill ran (else a client bug: 400)."""
    given = [p.get("prompt_token_ids") for p in req.kv_transfer_params.get("prompts") or [] if isinstance(p, dict)]
    if given and given != prompts:
        raise Refused(400, "the decode request's prompt differs from the one its kv_transfer_params were prefilled "
                           "for: send the prefill phase's answer with the same request", "kv_transfer_params")


class Front(TokenizerFrontend):
    """The endpoints, as methods over a :class:`Generator`."""

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.tokenizer = gen.tokenizer
        self.started = time.time()

    def _phase(self, req: Any) -> str | None:
        return phase_of(req) if self.gen.serves_phases else None

    # ---- shaping --------------------------------------------------------------------------
    def text_of(self, g: Generation) -> str:
        return g.text if g.text is not None else self.tokenizer.decode(g.token_ids, skip_special_tokens=True)

    @staticmethod
    def token_fields(g: Generation) -> api.TokenFields:
        out = api.TokenFields(token_ids=g.token_ids, policy_versions=g.policy_versions)
        if g.routed_experts is not None:
            out["routed_experts"] = g.routed_experts
        return out

    @staticmethod
    def usage(prompt_tokens: int, generations: list[Generation]) -> api.Usage:
        completion = sum(len(g.token_ids) for g in generations)
        return api.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion)

    def completion_logprobs(self, g: Generation, prompt_ids: list[int], top: int, echo: bool) -> api.CompletionLogprobs:
        """OpenAI's legacy shape over the choice's tokens: the prompt's first (with ``echo``),
        whose first token has no log-probability, then the generated ones."""
        ids, lps, tops = list(g.token_ids), list(g.logprobs), list(g.top_logprobs)
        if echo:
            ids = prompt_ids + ids
            lps = list(g.prompt_logprobs or [None] * len(prompt_ids)) + lps
            tops = list(g.prompt_top_logprobs or [None] * len(prompt_ids)) + tops
        tokens = [self.piece(t) for t in ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return api.CompletionLogprobs(
            tokens=tokens, token_logprobs=lps, text_offset=offsets,
            top_logprobs=[None if d is None else {self.piece(k): v for k, v in d.items()} for d in tops]
            if top else None,
        )

    def chat_logprobs(self, g: Generation) -> api.ChatLogprobs:
        content = []
        for j, (tok, val) in enumerate(zip(g.token_ids, g.logprobs)):
            alts = g.top_logprobs[j] if j < len(g.top_logprobs) else {}
            piece = self.piece(tok)
            content.append(api.ChatTokenLogprob(
                token=piece, logprob=val, bytes=list(piece.encode()),
                top_logprobs=[api.TopLogprob(token=self.piece(k), logprob=v, bytes=list(self.piece(k).encode()))
                              for k, v in alts.items()],
            ))
        return api.ChatLogprobs(content=content)

    # ---- the OpenAI API -------------------------------------------------------------------
    async def health(self) -> api.Health:
        return self.gen.health()

    async def models(self) -> api.ModelList:
        return api.ModelList(object="list", data=[api.ModelCard(
            id=self.gen.model_name, object="model", created=int(self.started), owned_by="primerl",
            max_model_len=self.gen.max_model_len)])

    async def completions(self, req: CompletionRequest) -> Any:
        try:
            prompts, texts = self.prompts_of(req)
        except ValueError as exc:
            return error(400, str(exc), "prompt")
        # echo + logprobs: the prompt is scored too (a logprob per token after the first)
        sampling = Sampling.of(req, req.max_tokens, req.logprobs, prompt_logprobs=req.logprobs if req.echo else None,
                               phase=self._phase(req))
        try:
            for ids in prompts:
                self.gen.check(ids, sampling)
            if sampling.phase == "prefill":
                return JSONResponse(await self.gen.prefill(prompts, sampling))
            if sampling.phase == "decode":
                _check_handoff(req, prompts)
            results = await asyncio.gather(*(self.gen.generate(ids, sampling) for ids in prompts))
        except Refused as exc:
            return exc.response()
        choices: list[api.CompletionChoice] = []
        for ids, text, gens in zip(prompts, texts, results):
            for g in gens:
                out = self.text_of(g)
                if req.echo:
                    out = (text if text is not None else self.tokenizer.decode(ids)) + out
                choices.append(api.CompletionChoice(
                    index=len(choices), text=out, finish_reason=g.finish_reason,
                    logprobs=self.completion_logprobs(g, ids, req.logprobs, req.echo) if req.logprobs is not None
                    else None,
                    prompt_token_ids=ids, **self.token_fields(g),
                ))
        # The records hold plain JSON data (str, int, float, None, lists, dicts), so they are
        # written as they are: FastAPI's jsonable_encoder, which walks every value first, took
        # a third of the server's CPU with per-token logprobs.
        return JSONResponse(api.CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()),
            model=self.gen.model_name, choices=choices,
            usage=self.usage(sum(len(i) for i in prompts), [g for r in results for g in r])))

    async def chat_completion(self, req: ChatCompletionRequest, ids: list[int]) -> Any:
        """A chat turn from its prompt's token ids (rendered messages, or given tokens)."""
        top = req.top_logprobs if req.logprobs else None
        sampling = Sampling.of(req, req.max_completion_tokens or req.max_tokens, (top or 0) if req.logprobs else None,
                               phase=self._phase(req))
        try:
            self.gen.check(ids, sampling)
            if sampling.phase == "prefill":
                return JSONResponse(await self.gen.prefill([ids], sampling))
            if sampling.phase == "decode":
                _check_handoff(req, [ids])
            gens = await self.gen.generate(ids, sampling)
        except Refused as exc:
            return exc.response()
        choices: list[api.ChatChoice] = []
        for i, g in enumerate(gens):
            text, finish = self.text_of(g), g.finish_reason
            message = api.AssistantMessage(role="assistant", content=text)
            if req.parses_tools():
                rest, calls = split_tool_calls(text)
                if calls:
                    message["content"] = rest or None
                    message["tool_calls"] = [
                        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                        for c in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append(api.ChatChoice(index=i, message=message, finish_reason=finish,
                                          logprobs=self.chat_logprobs(g) if req.logprobs else None,
                                          **self.token_fields(g)))
        return JSONResponse(api.ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()),
            model=self.gen.model_name, choices=choices, prompt_token_ids=ids, usage=self.usage(len(ids), gens)))

    async def chat(self, req: ChatCompletionRequest) -> Any:
        try:
            ids = self.render(req.template_messages(), req.template_tools(), req.add_generation_prompt,
                              req.chat_template_kwargs)
        except ValueError as exc:
            return error(400, str(exc), "messages")
        return await self.chat_completion(req, ids)

    async def chat_tokens(self, req: ChatTokensRequest) -> Any:
        """A chat turn whose prompt arrives as token ids: the engine's own tokens of the earlier
        turns plus the new turn's, so nothing the model produced is re-tokenized."""
        return await self.chat_completion(req, list(req.tokens))

    async def generate(self, req: GenerateRequest) -> Any:
        """vLLM's token-in generation: ``token_ids`` and ``sampling_params`` in; per choice the
        sampled ids, their logprobs as ``"token_id:N"`` entries, policy versions and (asked)
        routed experts out."""
        sp, ids = req.sampling_params, list(req.token_ids)
        sampling = Sampling(n=sp.n, max_tokens=sp.max_tokens if sp.max_tokens is not None else 16,
                            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed,
                            stop=tuple(sp.stop_list()), stop_token_ids=tuple(sp.stop_token_ids or ()),
                            ignore_eos=sp.ignore_eos, logprobs=sp.logprobs, prompt_logprobs=sp.prompt_logprobs,
                            return_routed_experts=req.return_routed_experts or sp.return_routed_experts,
                            cache_salt=req.cache_salt,
                            priority=req.priority)
        try:
            self.gen.check(ids, sampling)
            gens = await self.gen.generate(ids, sampling)
        except Refused as exc:
            return exc.response()
        choices: list[api.GenerateChoice] = []
        for i, g in enumerate(gens):
            logprobs = None
            if sp.logprobs is not None:
                logprobs = api.GenerateLogprobs(content=[
                    api.TokenLogprob(token=f"token_id:{t}", logprob=lp, top_logprobs=[
                        {"token": f"token_id:{k}", "logprob": v}
                        for k, v in (g.top_logprobs[j] if j < len(g.top_logprobs) else {}).items()])
                    for j, (t, lp) in enumerate(zip(g.token_ids, g.logprobs))])
            choices.append(api.GenerateChoice(index=i, finish_reason=g.finish_reason, logprobs=logprobs,
                                              **self.token_fields(g)))
        out = api.GenerateResponse(request_id=req.request_id or f"gen-{uuid.uuid4().hex}", model=self.gen.model_name,
                                   prompt_token_ids=ids, choices=choices, usage=self.usage(len(ids), gens))
        if sp.prompt_logprobs is not None and gens:
            g = gens[0]
            out["prompt_logprobs"] = [
                None if lp is None else {str(t): {"logprob": lp},
                                         **{str(k): {"logprob": v} for k, v in (top or {}).items() if k != t}}
                for t, lp, top in zip(ids, g.prompt_logprobs or [None] * len(ids),
                                      g.prompt_top_logprobs or [None] * len(ids))]
        return JSONResponse(out)

    async def tokenize(self, req: TokenizeRequest) -> Any:
        if (req.prompt is None) == (req.messages is None):
            return error(400, "give exactly one of 'prompt' (text) or 'messages' (a conversation)")
        if req.prompt is not None:
            ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            try:
                ids = self.render([m.model_dump(exclude_none=True) for m in req.messages],
                                  [t.model_dump() for t in req.tools] if req.tools else None,
                                  req.add_generation_prompt, req.chat_template_kwargs)
            except ValueError as exc:
                return error(400, str(exc), "messages")
        return api.TokenizeResponse(count=len(ids), max_model_len=self.gen.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> Any:
        n = len(self.tokenizer)
        if any(t < 0 or t >= n for t in req.tokens):
            return error(400, f"token ids must be in [0, {n})", "tokens")
        return api.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(await self.gen.metrics(), media_type="text/plain; version=0.0.4")

    # ---- admin ----------------------------------------------------------------------------
    async def update_weights(self, req: WeightUpdateRequest) -> Any:
        try:
            return await self.gen.update_weights(req)
        except Refused as exc:
            return exc.response()

    async def pause(self) -> Any:
        try:
            return await self.gen.pause()
        except Refused as exc:
            return exc.response()

    async def resume(self) -> Any:
        try:
            return await self.gen.resume()
        except Refused as exc:
            return exc.response()

    async def status(self) -> api.AdminStatus:
        return await self.gen.status()


def prometheus(lines: Sequence[tuple[str, str, str, Any]]) -> str:
    """``(name, type, help, value)`` rows as Prometheus text."""
    return "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in lines)


async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    return error(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(first.get("msg")), loc or None)


async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error(exc.status_code, str(exc.detail))


def create_app(gen: Generator, *, api_key: str | None = None, title: str = "primerl inference") -> FastAPI:
    """The app: :class:`Front` over ``gen`` routed at :mod:`primerl.serving.protocol`'s
    endpoints (and the generator's own :meth:`~Generator.routes`), behind the :class:`Guard`
    (API key, body size)."""
    front = Front(gen)
    app = FastAPI(title=title)
    app.state.front = front
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_middleware(Guard, api_key=api_key)
    for method, path, handler in [
        ("GET", api.HEALTH, front.health),
        ("GET", api.MODELS, front.models),
        ("POST", api.COMPLETIONS, front.completions),
        ("POST", api.CHAT_COMPLETIONS, front.chat),
        ("POST", api.CHAT_COMPLETIONS_TOKENS, front.chat_tokens),
        ("POST", api.GENERATE, front.generate),
        ("POST", api.TOKENIZE, front.tokenize),
        ("POST", api.DETOKENIZE, front.detokenize),
        ("GET", api.METRICS, front.metrics),
        ("POST", api.ADMIN_WEIGHTS, front.update_weights),
        ("POST", api.ADMIN_PAUSE, front.pause),
        ("POST", api.ADMIN_RESUME, front.resume),
        ("GET", api.ADMIN_STATUS, front.status),
        *gen.routes(),
    ]:
        # response_model=None: the records are documentation (TypedDicts), not a second validation
        app.add_api_route(path, handler, methods=[method], response_model=None)
    return app
