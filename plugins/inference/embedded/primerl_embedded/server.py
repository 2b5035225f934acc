"""The HTTP face of the embedded engine: OpenAI-compatible API, metrics and admin.

Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics`` (Prometheus text); vLLM's extensions that RL libraries call
(``/v1/chat/completions/tokens``, ``/tokenize``, ``/detokenize``); and the admin
endpoints a trainer or launcher calls: ``POST /admin/weights`` (``{"path": DIR_OR_FILE, "version": N}``, an HF safetensors
checkpoint directory, or one safetensors file in /dev/shm for the co-located channel),
``POST /admin/pause``, ``POST /admin/resume`` and ``GET /admin/status``.

Malformed or oversized requests get a 4xx with OpenAI's error shape and a reason; the
server stays up. Handlers never touch the model: they hand work to the engine thread
and await the result.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from pathlib import Path
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from primerl.envs.multiturn import split_tool_calls
from primerl_embedded.engine import Engine, RequestError, SamplingParams, Sequence
from primerl_embedded.protocol import (
    ChatCompletionRequest,
    ChatTokensRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    WeightUpdateRequest,
)

MAX_BODY_BYTES = 8 * 1024 * 1024


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": status}})


def create_app(engine: Engine, tokenizer: Any, model_name: str,
               load_weights: Callable[[str], Any] | None = None) -> FastAPI:
    """The app. ``load_weights(path)`` prepares a checkpoint (outside the engine's step gap) and
    returns a callable that copies it into the served model (run by the engine between steps)."""
    if load_weights is None:
        from primerl.weights import adopt, stage

        def load_weights(path: str) -> Callable[[], Any]:
            pairs = stage(engine.model, path, writable=True)
            return lambda: adopt(pairs)

    app = FastAPI(title="primerl embedded inference")
    started = time.time()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(first.get("msg")), loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            return error(413, f"request body of {size} bytes exceeds the limit of {MAX_BODY_BYTES}")
        return await call_next(request)

    async def run(prompt_ids: list[int], params: SamplingParams) -> list[Sequence]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        remaining = [params.n]

        def done(_seq: Sequence) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

        seqs = engine.submit(prompt_ids, params, on_done=done)
        try:
            await fut
        except asyncio.CancelledError:
            engine.abort(seqs)  # the client went away (or the server is stopping)
            raise
        return seqs

    def params_from(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens or 16, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed, n=req.n, stop=req.stop_list(), stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, logprobs=logprobs, return_routed_experts=req.return_routed_experts,
        )

    def text_of(seq: Sequence) -> str:
        text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        if seq.stop_text_at is not None:
            text = tokenizer.decode(seq.output_ids)[: seq.stop_text_at]
        return text

    def extras(seq: Sequence) -> dict[str, Any]:
        out: dict[str, Any] = {"token_ids": seq.output_ids, "policy_versions": seq.versions}
        if seq.params.return_routed_experts:
            routed = seq.routed_experts()
            if routed is not None:  # vLLM's layout: data first, rows from token `start` of the prompt
                out["routed_experts"] = {
                    "data": base64.b64encode(routed.contiguous().numpy().tobytes()).decode(),
                    "shape": list(routed.shape), "dtype": str(routed.dtype).replace("torch.", ""), "start": 0,
                }
        return out

    def piece(tok: int) -> str:
        return tokenizer.decode([tok])

    def usage(prompt_len: int, seqs: list[Sequence]) -> dict[str, int]:
        completion = sum(len(s.output_ids) for s in seqs)
        return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "policy_version": engine.version, "paused": engine.paused}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(started),
                                            "owned_by": "primerl", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        prompts: list[list[int]]
        p = req.prompt
        if isinstance(p, str):
            prompts = [tokenizer.encode(p, add_special_tokens=False)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [tokenizer.encode(x, add_special_tokens=False) for x in p]  # type: ignore[union-attr]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        else:
            return error(400, "prompt must be a non-empty string, list of strings, or token id list(s)", "prompt")
        params = params_from(req, req.max_tokens, req.logprobs)
        try:
            for ids in prompts:
                engine.validate(ids, params)
            results = await asyncio.gather(*(run(ids, params) for ids in prompts))
        except RequestError as exc:
            return error(400, str(exc))
        choices = []
        for ids, seqs in zip(prompts, results):
            for seq in seqs:
                choice: dict[str, Any] = {"index": len(choices), "text": text_of(seq), "finish_reason": seq.finish_reason,
                                          "prompt_token_ids": ids, **extras(seq)}
                if req.logprobs is not None:
                    tokens = [piece(t) for t in seq.output_ids]
                    offsets, pos = [], 0
                    for t in tokens:
                        offsets.append(pos)
                        pos += len(t)
                    choice["logprobs"] = {
                        "tokens": tokens, "token_logprobs": seq.logprobs, "text_offset": offsets,
                        "top_logprobs": [{piece(k): v for k, v in d.items()} for d in seq.top_logprobs]
                        if req.logprobs else None,
                    }
                else:
                    choice["logprobs"] = None
                choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": choices,
                "usage": usage(sum(len(i) for i in prompts) , [s for r in results for s in r])}

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
               template_kwargs: dict[str, Any] | None) -> list[int]:
        """Token ids of a conversation through the chat template; ValueError names what failed."""
        try:
            ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                tokenize=True, return_dict=False, **(template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise ValueError(f"messages could not be rendered with the chat template: {exc}") from exc
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    async def chat_completion(req: ChatCompletionRequest, ids: list[int]) -> Any:
        top = req.top_logprobs if req.logprobs else None
        params = params_from(req, req.max_completion_tokens or req.max_tokens, (top or 0) if req.logprobs else None)
        try:
            seqs = await run(ids, params)
        except RequestError as exc:
            return error(400, str(exc))
        choices = []
        for i, seq in enumerate(seqs):
            lp = None
            if req.logprobs:
                content = []
                for j, (tok, val) in enumerate(zip(seq.output_ids, seq.logprobs)):
                    alts = seq.top_logprobs[j] if j < len(seq.top_logprobs) else {}
                    content.append({
                        "token": piece(tok), "logprob": val, "bytes": list(piece(tok).encode()),
                        "top_logprobs": [{"token": piece(k), "logprob": v, "bytes": list(piece(k).encode())}
                                         for k, v in alts.items()],
                    })
                lp = {"content": content}
            text, finish = text_of(seq), seq.finish_reason
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if req.parses_tools():
                rest, calls = split_tool_calls(text)
                if calls:
                    message["content"] = rest or None
                    message["tool_calls"] = [
                        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                        for c in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": lp, **extras(seq)})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name, "choices": choices, "prompt_token_ids": ids, "usage": usage(len(ids), seqs)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        try:
            ids = render(req.template_messages(), req.template_tools(), req.add_generation_prompt,
                         req.chat_template_kwargs)
        except ValueError as exc:
            return error(400, str(exc), "messages")
        return await chat_completion(req, ids)

    @app.post("/v1/chat/completions/tokens")
    async def chat_tokens(req: ChatTokensRequest) -> Any:
        """A chat turn whose prompt arrives as token ids: the engine's own tokens of the earlier
        turns plus the new turn's, so nothing the model produced is re-tokenized."""
        return await chat_completion(req, list(req.tokens))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        if (req.prompt is None) == (req.messages is None):
            return error(400, "give exactly one of 'prompt' (text) or 'messages' (a conversation)")
        if req.prompt is not None:
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            try:
                ids = render([m.model_dump(exclude_none=True) for m in req.messages],
                             [t.model_dump() for t in req.tools] if req.tools else None,
                             req.add_generation_prompt, req.chat_template_kwargs)
            except ValueError as exc:
                return error(400, str(exc), "messages")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        if any(t < 0 or t >= len(tokenizer) for t in req.tokens):
            return error(400, f"token ids must be in [0, {len(tokenizer)})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        s = engine.stats
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

    @app.post("/admin/weights")
    async def update_weights(req: WeightUpdateRequest) -> Any:
        from primerl.weights import WeightsError

        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            # load_into checks names and shapes before touching a parameter: a bad checkpoint changes nothing
            if not Path(req.path).exists():
                raise WeightsError(f"weights path '{req.path}' does not exist")
            # stage (map, validate) while the engine keeps decoding, then copy in its step gap
            copy_in = await loop.run_in_executor(None, load_weights, req.path)
            version = await loop.run_in_executor(None, lambda: engine.update_weights(copy_in, req.version))
        except WeightsError as exc:
            return error(400, str(exc), "path")
        except Exception as exc:  # noqa: BLE001 - report, keep serving the old weights
            return error(400, f"could not load weights from '{req.path}': {type(exc).__name__}: {exc}", "path")
        return {"policy_version": version, "seconds": time.perf_counter() - t0}

    @app.post("/admin/pause")
    async def pause() -> dict[str, Any]:
        engine.pause()
        return {"paused": True, "policy_version": engine.version}

    @app.post("/admin/resume")
    async def resume() -> dict[str, Any]:
        engine.resume()
        return {"paused": False, "policy_version": engine.version}

    @app.get("/admin/status")
    async def status() -> dict[str, Any]:
        return {"policy_version": engine.version, "paused": engine.paused, "running": len(engine.running),
                "waiting": len(engine.waiting), "kv_usage": engine.kv_usage()}

    return app
