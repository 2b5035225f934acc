"""What every server speaking primerl's OpenAI-compatible API does with its tokenizer.

The embedded engine's server and the vLLM backend's proxy answer the same requests the
same way up to the point where an engine runs: prompts given as text, token ids or lists
of either become token ids; chats go through the model's chat template; errors take
OpenAI's shape. :class:`TokenizerFrontend` holds that part once, so the two servers cannot
drift apart in what they accept; each subclass supplies ``tokenizer`` and its endpoints
(typed with its own request models, which FastAPI reads).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    """An error response in OpenAI's shape."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": status}})


class TokenizerFrontend:
    """Prompt and chat handling shared by every primerl inference server."""

    tokenizer: Any

    def piece(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

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
