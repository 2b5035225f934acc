"""A ``renderers`` renderer for primerl's byte tokenizer, so verifiers' train client runs v1
environments on the tiny presets token-exactly, tools and several turns included.

verifiers 0.4's train client renders every turn to token ids with a renderer (the
``renderers`` package) and samples from ``/inference/v1/generate``. For a tokenizer it has
no hand-written renderer for it falls back to ``DefaultRenderer`` (the tokenizer's chat
template), which serves the byte tokenizer badly in two ways:

* its tool parsers find ``<tool_call>`` by *token id*, and the byte tokenizer has no such
  token (it writes the eleven bytes), so no tool call the model makes would ever parse;
* it never bridges turns: each one is re-rendered from text, and the byte chat template
  does not write the end-of-text token the model sampled, so every later turn would fork
  the trace into a branch (a training sample) of its own.

:class:`ByteRenderer` keeps ``DefaultRenderer``'s rendering and adds both: tool calls are
found on the byte ids (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what
the template writes and primerl's server parses), and a turn is bridged append-only, the
way primerl's own multi-turn envs and the classic bridge's token client do it: the
previous prompt and the engine's completion exactly, then the template's rendering of the
new messages (:func:`primerl.envs.multiturn.turn_suffix`'s rule) and the generation prompt.
A multi-turn episode is then one branch, one sample.

verifiers loads it as a renderers custom renderer::

    renderers.CustomRendererConfig(import_path="primerl_verifiers.renderer.ByteRenderer")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from renderers import DefaultRenderer, DefaultRendererConfig
from renderers.base import (
    ParsedToolCall,
    RenderedTokens,
    ToolCallParseStatus,
    extract_message_tool_names,
    reject_assistant_in_extension,
)
from renderers.configs import BaseRendererConfig

IMPORT_PATH = "primerl_verifiers.renderer.ByteRenderer"
_OPEN, _CLOSE = list(b"<tool_call>"), list(b"</tool_call>")  # byte ids are byte values
# what a bridged turn's new messages follow: the suffix of history + new over history
# does not depend on the history's content in the byte template (one block per message)
_HISTORY = [{"role": "assistant", "content": ""}]


def is_byte_tokenizer(folder: str | Path) -> bool:
    """Whether the tokenizer saved in ``folder`` is primerl's byte tokenizer (a tiny preset's
    checkpoint carries it): its chat template is the byte tokenizer's."""
    from primerl.tokenizer import CHAT_TEMPLATE

    folder = Path(folder)
    template = folder / "chat_template.jinja"
    if template.is_file():
        return template.read_text() == CHAT_TEMPLATE
    config = folder / "tokenizer_config.json"
    try:
        return json.loads(config.read_text()).get("chat_template") == CHAT_TEMPLATE
    except (OSError, ValueError):
        return False


def _find(ids: list[int], seq: list[int], start: int) -> int:
    n = len(seq)
    for i in range(start, len(ids) - n + 1):
        if ids[i:i + n] == seq:
            return i
    return -1


class ByteToolParser:
    """Hermes-style tool calls written in bytes: ``<tool_call>{json}</tool_call>`` blocks
    (renderers' ``ToolParser``: content ids before the first block, one record per block)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def extract(self, ids: list[int]) -> tuple[list[int], list[ParsedToolCall]]:
        start = _find(ids, _OPEN, 0)
        if start == -1:
            return ids, []
        calls: list[ParsedToolCall] = []
        i = start
        while i != -1:
            body = i + len(_OPEN)
            end = _find(ids, _CLOSE, body)
            raw = self._tokenizer.decode(ids[body:end if end != -1 else len(ids)], skip_special_tokens=False).strip()
            if end == -1:
                calls.append(ParsedToolCall(raw=raw, token_span=(i, len(ids)), status=ToolCallParseStatus.UNCLOSED_BLOCK))
                break
            span = (i, end + len(_CLOSE))
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError:
                calls.append(ParsedToolCall(raw=raw, token_span=span, status=ToolCallParseStatus.INVALID_JSON))
            else:
                parsed = parsed if isinstance(parsed, dict) else {}
                name = parsed.get("name") if isinstance(parsed.get("name"), str) else None
                calls.append(ParsedToolCall(raw=raw, name=name or None, arguments=parsed.get("arguments", {}),
                                            token_span=span,
                                            status=ToolCallParseStatus.OK if name else ToolCallParseStatus.MISSING_NAME))
            i = _find(ids, _OPEN, span[1])
        return ids[:start], calls


class ByteRendererConfig(BaseRendererConfig):
    """No options: the byte tokenizer has one chat template and no reasoning format."""

    name: Literal["primerl-byte"] = "primerl-byte"


class ByteRenderer(DefaultRenderer):
    """``DefaultRenderer`` over the byte chat template, with byte tool calls and bridged turns."""

    config_class = ByteRendererConfig

    def __init__(self, tokenizer: Any, config: ByteRendererConfig | None = None) -> None:
        super().__init__(tokenizer, DefaultRendererConfig())
        self._tool_parser = ByteToolParser(tokenizer)

    @property
    def is_prefix_stable(self) -> bool:
        return True  # one block per message, the tools first: appending never changes a prefix

    def _suffix(self, new_messages: list[dict[str, Any]]) -> tuple[list[int], list[int]] | None:
        """The ids that continue a conversation after the model's turn with ``new_messages``
        and the generation prompt, and the index of the message each id renders (-1: the
        generation prompt)."""
        def text(messages: list[dict[str, Any]], generation: bool = False) -> str:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

        ids: list[int] = []
        owners: list[int] = []
        before = text(_HISTORY)
        for i in range(len(new_messages) + 1):
            after = text(_HISTORY + new_messages[: i + 1], generation=i == len(new_messages))
            if not after.startswith(before):
                return None
            piece = list(self._tokenizer.encode(after[len(before):], add_special_tokens=False))
            ids += piece
            owners += [i if i < len(new_messages) else -1] * len(piece)
            before = after
        return ids, owners

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list[dict[str, Any]], *, tools: list[Any] | None = None) -> RenderedTokens | None:
        if not previous_prompt_ids or not new_messages or reject_assistant_in_extension(new_messages):
            return None
        suffix = self._suffix(new_messages)
        if suffix is None:
            return None
        ext, owners = suffix
        previous = [*previous_prompt_ids, *previous_completion_ids]  # exactly what the engine ran
        return RenderedTokens(token_ids=previous + ext, message_indices=[-1] * len(previous) + owners,
                              sampled_mask=[False] * (len(previous) + len(ext)),
                              message_roles=[m.get("role") or "" for m in new_messages],
                              message_tool_names=extract_message_tool_names(new_messages))
