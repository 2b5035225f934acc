"""What every server speaking primerl's OpenAI-compatible API does with its tokenizer.

The embedded engine's server and the vLLM backend's proxy answer the same requests the
same way up to the point where an engine runs: prompts given as text, token ids or lists
of either become token ids; chats go through the model's chat template; errors take
OpenAI's shape. :class:`TokenizerFrontend` holds that part once, so the two servers cannot
drift apart in what they accept; each subclass supplies ``tokenizer`` and its endpoints
(typed with its own request models, which FastAPI reads).
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

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
    """Prompt and chat handling shared by every primerl inference server."""

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
