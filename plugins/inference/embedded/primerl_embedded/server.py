"""The HTTP face of the embedded engine: OpenAI-compatible API, metrics and admin.

Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics`` (Prometheus text); vLLM's extensions that RL libraries call
(``/v1/chat/completions/tokens``, ``/tokenize``, ``/detokenize``); and the admin
endpoints a trainer or launcher calls: ``POST /admin/weights`` (``{"path": DIR_OR_FILE, "version": N}``, an HF safetensors
checkpoint directory, or one safetensors file in /dev/shm for the co-located channel),
``POST /admin/pause``, ``POST /admin/resume`` and ``GET /admin/status``. The response
records are :mod:`primerl.inference`'s, the contract every backend keeps.

``/v1/completions`` with ``echo: true`` returns the prompt's text before the completion's
and, with ``logprobs``, a log-probability for every prompt token after the first (the
first is null, as OpenAI and vLLM answer), computed by the engine from the same forward
and the same function as sampled tokens; ``max_tokens: 0`` then scores the prompt alone.
That is what lm-evaluation-harness's loglikelihood (multiple-choice) tasks send.

Prefill/decode disaggregation takes vLLM's ``kv_transfer_params`` on completion and chat
requests: ``{"do_remote_decode": true}`` runs only the prefill, writes the prompt's KV blocks
to the shared KV store and answers the ``kv_transfer_params`` of the decode phase; the same
request with those is the decode phase, whose prompt KV comes from the store (409
``kv_missing`` when it is gone: prefill again). See "prefill/decode disaggregation" below.

Malformed or oversized requests get a 4xx with OpenAI's error shape and a reason; the
server stays up. Handlers never touch the model: they hand work to the engine thread
and await the result.

Layout: :class:`Handlers` holds the server's state (engine, tokenizer, weight loader) and
has one method per endpoint plus the helpers that shape responses; :func:`create_app`
wires them into a FastAPI app with the error handlers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from primerl import inference as api
from primerl.envs.multiturn import split_tool_calls
from primerl.serving.frontend import Guard, TokenizerFrontend, error
from primerl.serving.protocol import (
    ChatCompletionRequest,
    ChatTokensRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    WeightUpdateRequest,
)
from primerl_embedded.engine import KV_MISSING, Engine, QueueFull, RequestError, SamplingParams, Sequence


class Handlers(TokenizerFrontend):
    """The endpoints of one server, as methods over its state.

    ``load_weights(path)`` prepares a checkpoint (outside the engine's step gap) and returns
    a callable that copies it into the served model (run by the engine between steps).
    """

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str,
                 load_weights: Callable[[str], Callable[[], Any]] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.load_weights = load_weights or self._stage_and_adopt
        self.started = time.time()

    def _stage_and_adopt(self, path: str) -> Callable[[], Any]:
        from primerl.weights import adopt, stage

        pairs = stage(self.engine.model, path, writable=True)
        return lambda: adopt(pairs)

    # ---- running requests on the engine ------------------------------------------------------
    async def run(self, prompt_ids: list[int], params: SamplingParams, phase: str | None = None) -> list[Sequence]:
        """Submit one prompt's ``params.n`` sequences and wait for all of them; a cancelled
        request (the client went away, the server is stopping) aborts them. ``phase``: P/D's
        ``"prefill"`` or ``"decode"`` (:func:`pd_phase`)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        remaining = [params.n]

        def done(_seq: Sequence) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

        seqs = self.engine.submit(prompt_ids, params, on_done=done, phase=phase)
        try:
            await fut
        except asyncio.CancelledError:
            self.engine.abort(seqs)
            raise
        return seqs

    @staticmethod
    def params_from(req: Any, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, seed=req.seed, n=req.n, stop=req.stop_list(), stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            return_routed_experts=req.return_routed_experts,
        )

    # ---- shaping responses -------------------------------------------------------------------
    def text_of(self, seq: Sequence) -> str:
        if seq.stop_text_at is not None:
            return self.tokenizer.decode(seq.output_ids)[: seq.stop_text_at]
        return self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)

    @staticmethod
    def token_fields(seq: Sequence) -> api.TokenFields:
        out = api.TokenFields(token_ids=seq.output_ids, policy_versions=seq.versions)
        if seq.params.return_routed_experts:
            routed = seq.routed_experts()
            if routed is not None:  # vLLM's layout: data first, rows from token `start` of the prompt
                out["routed_experts"] = api.RoutedExperts(
                    data=base64.b64encode(routed.contiguous().numpy().tobytes()).decode(),
                    shape=list(routed.shape), dtype=str(routed.dtype).replace("torch.", ""), start=0,
                )
        return out

    @staticmethod
    def usage(prompt_len: int, seqs: list[Sequence]) -> api.Usage:
        completion = sum(len(s.output_ids) for s in seqs)
        return api.Usage(prompt_tokens=prompt_len, completion_tokens=completion, total_tokens=prompt_len + completion)

    def completion_logprobs(self, seq: Sequence, top: int, echo: bool) -> api.CompletionLogprobs:
        """OpenAI's legacy shape over the choice's tokens: the prompt's first (with ``echo``),
        whose first token has no log-probability, then the generated ones."""
        ids, lps, tops = list(seq.output_ids), list(seq.logprobs), list(seq.top_logprobs)
        if echo:
            ids = seq.prompt_ids + ids
            lps = list(seq.prompt_logprobs or [None] * len(seq.prompt_ids)) + lps
            tops = list(seq.prompt_top_logprobs or [None] * len(seq.prompt_ids)) + tops
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

    def chat_logprobs(self, seq: Sequence) -> api.ChatLogprobs:
        content = []
        for j, (tok, val) in enumerate(zip(seq.output_ids, seq.logprobs)):
            alts = seq.top_logprobs[j] if j < len(seq.top_logprobs) else {}
            content.append(api.ChatTokenLogprob(
                token=self.piece(tok), logprob=val, bytes=list(self.piece(tok).encode()),
                top_logprobs=[api.TopLogprob(token=self.piece(k), logprob=v, bytes=list(self.piece(k).encode()))
                              for k, v in alts.items()],
            ))
        return api.ChatLogprobs(content=content)

    # ---- OpenAI API --------------------------------------------------------------------------
    async def health(self) -> api.Health:
        return api.Health(status="ok", policy_version=self.engine.version, paused=self.engine.paused)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(self.started),
                                            "owned_by": "primerl", "max_model_len": self.engine.max_model_len}]}

    async def completions(self, req: PDCompletionRequest) -> Any:
        try:
            prompts, texts = self.prompts_of(req)
        except ValueError as exc:
            return error(400, str(exc), "prompt")
        # echo + logprobs: the engine scores the prompt (a logprob per token after the first)
        params = self.params_from(req, req.max_tokens, req.logprobs,
                                  prompt_logprobs=req.logprobs if req.echo else None)
        phase = pd_phase(req)
        try:
            for ids in prompts:
                self.engine.validate(ids, params)
            if phase == "prefill":
                return await self.prefill(prompts)
            if phase == "decode" and (differs := handoff_differs(req, prompts)) is not None:
                return differs
            results = await asyncio.gather(*(self.run(ids, params, phase) for ids in prompts))
        except QueueFull as exc:
            return busy(exc)
        except RequestError as exc:
            return error(400, str(exc))
        if phase == "decode" and (missing := kv_missing(s for r in results for s in r)) is not None:
            return missing
        choices: list[api.CompletionChoice] = []
        for ids, text, seqs in zip(prompts, texts, results):
            for seq in seqs:
                out = self.text_of(seq)
                if req.echo:
                    out = (text if text is not None else self.tokenizer.decode(ids)) + out
                choices.append(api.CompletionChoice(
                    index=len(choices), text=out, finish_reason=seq.finish_reason,
                    logprobs=self.completion_logprobs(seq, req.logprobs, req.echo) if req.logprobs is not None else None,
                    prompt_token_ids=ids, **self.token_fields(seq),
                ))
        return JSONResponse(api.CompletionResponse(  # plain JSON data: see chat_completion
            id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()), model=self.model_name,
            choices=choices, usage=self.usage(sum(len(i) for i in prompts), [s for r in results for s in r])))

    async def chat_completion(self, req: PDChatRequest, ids: list[int]) -> Any:
        """A chat turn from its prompt's token ids (rendered messages, or given tokens)."""
        top = req.top_logprobs if req.logprobs else None
        params = self.params_from(req, req.max_completion_tokens or req.max_tokens,
                                  (top or 0) if req.logprobs else None)
        phase = pd_phase(req)
        try:
            if phase == "prefill":
                self.engine.validate(ids, params)
                return await self.prefill([ids])
            if phase == "decode" and (differs := handoff_differs(req, [ids])) is not None:
                return differs
            seqs = await self.run(ids, params, phase)
        except QueueFull as exc:
            return busy(exc)
        except RequestError as exc:
            return error(400, str(exc))
        if phase == "decode" and (missing := kv_missing(seqs)) is not None:
            return missing
        choices: list[api.ChatChoice] = []
        for i, seq in enumerate(seqs):
            text, finish = self.text_of(seq), seq.finish_reason
            message = api.ChatMessage(role="assistant", content=text)
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
                                          logprobs=self.chat_logprobs(seq) if req.logprobs else None,
                                          **self.token_fields(seq)))
        # The records hold plain JSON data (str, int, float, None, lists, dicts), so they are
        # written as they are: FastAPI's jsonable_encoder, which walks every value first, took
        # a third of the server's CPU with per-token logprobs.
        return JSONResponse(api.ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()),
            model=self.model_name, choices=choices, prompt_token_ids=ids, usage=self.usage(len(ids), seqs)))

    async def chat(self, req: PDChatRequest) -> Any:
        try:
            ids = self.render(req.template_messages(), req.template_tools(), req.add_generation_prompt,
                              req.chat_template_kwargs)
        except ValueError as exc:
            return error(400, str(exc), "messages")
        return await self.chat_completion(req, ids)

    async def chat_tokens(self, req: PDChatTokensRequest) -> Any:
        """A chat turn whose prompt arrives as token ids: the engine's own tokens of the earlier
        turns plus the new turn's, so nothing the model produced is re-tokenized."""
        return await self.chat_completion(req, list(req.tokens))

    async def prefill(self, prompts: list[list[int]]) -> dict[str, Any]:
        """P/D's prefill phase: run every prompt, sample nothing, and write its KV blocks (with
        their routed experts) to the KV store every server shares; answer what the decode
        server needs, as ``kv_transfer_params`` to send along with the same request."""
        results = await asyncio.gather(*(self.run(ids, SamplingParams(max_tokens=0), "prefill") for ids in prompts))
        return {
            "id": f"prefill-{uuid.uuid4().hex}", "object": "primerl.prefill", "created": int(time.time()),
            "model": self.model_name,
            "usage": self.usage(sum(len(i) for i in prompts), []),
            "kv_transfer_params": {
                "do_remote_prefill": True, "block_size": self.engine.handoff.block_size,
                # per prompt: its ids, the full blocks the store holds, the weights that computed them
                "prompts": [{"prompt_token_ids": ids, "blocks": seqs[0].handoff_blocks,
                             "policy_version": seqs[0].kv_version} for ids, seqs in zip(prompts, results)],
            },
        }

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
        return api.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> Any:
        n = len(self.tokenizer)
        if any(t < 0 or t >= n for t in req.tokens):
            return error(400, f"token ids must be in [0, {n})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def metrics(self) -> PlainTextResponse:
        s, engine = self.engine.stats, self.engine
        lines = [
            ("primerl_requests_total", "counter", "Requests received", s.requests),
            ("primerl_prompt_tokens_total", "counter", "Prompt tokens processed", s.prompt_tokens),
            ("primerl_generation_tokens_total", "counter", "Tokens generated", s.generated_tokens),
            ("primerl_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache", s.prefix_hit_tokens),
            ("primerl_engine_steps_total", "counter", "Scheduler steps", s.steps),
            ("primerl_batch_size", "gauge", "Sequences in the running batch", s.last_batch_size),
            ("primerl_waiting_sequences", "gauge", "Sequences waiting for a slot", len(engine.waiting)),
            ("primerl_kv_cache_usage", "gauge", "Share of KV slots held by running sequences", engine.kv_usage()),
            ("primerl_policy_version", "gauge", "Version of the weights being served", engine.version),
            ("primerl_weight_updates_total", "counter", "Weight updates applied", s.weight_updates),
            ("primerl_weight_update_seconds", "gauge", "Duration of the last weight copy", s.last_update_seconds),
        ]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in lines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ---- admin -------------------------------------------------------------------------------
    async def update_weights(self, req: WeightUpdateRequest) -> Any:
        from primerl.weights import WeightsError

        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            # load_into checks names and shapes before touching a parameter: a bad checkpoint changes nothing
            if not Path(req.path).exists():
                raise WeightsError(f"weights path '{req.path}' does not exist")
            # stage (map, validate) while the engine keeps decoding, then copy in its step gap
            copy_in = await loop.run_in_executor(None, self.load_weights, req.path)
            version = await loop.run_in_executor(None, lambda: self.engine.update_weights(copy_in, req.version))
        except WeightsError as exc:
            return error(400, str(exc), "path")
        except Exception as exc:  # noqa: BLE001 - report, keep serving the old weights
            return error(400, f"could not load weights from '{req.path}': {type(exc).__name__}: {exc}", "path")
        return api.WeightUpdateResponse(policy_version=version, seconds=time.perf_counter() - t0)

    async def pause(self) -> api.PauseResponse:
        self.engine.pause()
        return api.PauseResponse(paused=True, policy_version=self.engine.version)

    async def resume(self) -> api.PauseResponse:
        self.engine.resume()
        return api.PauseResponse(paused=False, policy_version=self.engine.version)

    async def status(self) -> api.AdminStatus:
        e = self.engine
        return api.AdminStatus(policy_version=e.version, paused=e.paused, running=len(e.running),
                               waiting=len(e.waiting), kv_usage=e.kv_usage())


# ---- prefill/decode disaggregation ----------------------------------------------------------------
# A P/D request is an ordinary completion or chat request with vLLM's ``kv_transfer_params``:
# ``{"do_remote_decode": true}`` asks for the prefill phase (Handlers.prefill answers the params
# of the decode phase), ``{"do_remote_prefill": true, ...}`` (that answer) for the decode phase.
# Without them a request runs whole, on any server.


class PDCompletionRequest(CompletionRequest):
    kv_transfer_params: dict[str, Any] | None = None


class PDChatRequest(ChatCompletionRequest):
    kv_transfer_params: dict[str, Any] | None = None


class PDChatTokensRequest(ChatTokensRequest):
    kv_transfer_params: dict[str, Any] | None = None


def pd_phase(req: Any) -> str | None:
    """``"prefill"``, ``"decode"`` or None (a whole request) from the request's ``kv_transfer_params``."""
    kv = getattr(req, "kv_transfer_params", None) or {}
    if kv.get("do_remote_decode"):
        return "prefill"
    if kv.get("do_remote_prefill"):
        return "decode"
    return None


def handoff_differs(req: Any, prompts: list[list[int]]) -> JSONResponse | None:
    """A 400 when a decode phase's prompts are not the ones its prefill ran (a client bug)."""
    given = [p.get("prompt_token_ids") for p in req.kv_transfer_params.get("prompts") or [] if isinstance(p, dict)]
    if given and given != prompts:
        return error(400, "the decode request's prompt differs from the one its kv_transfer_params were "
                          "prefilled for: send the prefill phase's answer with the same request", "kv_transfer_params")
    return None


def kv_missing(seqs: Any) -> JSONResponse | None:
    """409 ``kv_missing`` when a decode phase did not find its prompt's blocks in the KV store:
    the client runs the prefill again."""
    if any(s.finish_reason == KV_MISSING for s in seqs):
        return error(409, "the prompt's KV blocks are not in the KV store (evicted, their server left the pool, "
                          "or the weights changed since the prefill): run the prefill phase again",
                     "kv_transfer_params", kind=KV_MISSING)
    return None


# ---- the app ------------------------------------------------------------------------------------


async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    return error(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(first.get("msg")), loc or None)


async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error(exc.status_code, str(exc.detail))


def busy(exc: QueueFull) -> JSONResponse:
    """503 with Retry-After: the engine's queue is full; the server keeps serving what it holds."""
    response = error(503, str(exc), kind="server_busy")
    response.headers["Retry-After"] = "1"
    return response


def create_app(engine: Engine, tokenizer: Any, model_name: str,
               load_weights: Callable[[str], Any] | None = None, *, api_key: str | None = None) -> FastAPI:
    """The app: :class:`Handlers` routed at :mod:`primerl.inference`'s endpoints, behind the
    :class:`~primerl.serving.frontend.Guard` (API key, body size)."""
    h = Handlers(engine, tokenizer, model_name, load_weights)
    app = FastAPI(title="primerl embedded inference")
    app.state.handlers = h
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_middleware(Guard, api_key=api_key)
    for method, path, handler in [
        ("GET", api.HEALTH, h.health),
        ("GET", api.MODELS, h.models),
        ("POST", api.COMPLETIONS, h.completions),
        ("POST", api.CHAT_COMPLETIONS, h.chat),
        ("POST", api.CHAT_COMPLETIONS_TOKENS, h.chat_tokens),
        ("POST", api.TOKENIZE, h.tokenize),
        ("POST", api.DETOKENIZE, h.detokenize),
        ("GET", api.METRICS, h.metrics),
        ("POST", api.ADMIN_WEIGHTS, h.update_weights),
        ("POST", api.ADMIN_PAUSE, h.pause),
        ("POST", api.ADMIN_RESUME, h.resume),
        ("GET", api.ADMIN_STATUS, h.status),
    ]:
        # response_model=None: the records are documentation (TypedDicts), not a second validation
        app.add_api_route(path, handler, methods=[method], response_model=None)
    return app
