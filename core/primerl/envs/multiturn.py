"""Multi-turn and tool-using environments.

A :class:`MultiTurnEnv` talks with the model until it says the episode is done::

    class Guess(MultiTurnEnv):
        def tasks(self, split): ...
        def setup(self, task):                        # per-episode state (picklable)
            return {"tries": 0}
        def respond(self, task, state, completion):   # the env's turn
            state["tries"] += 1
            done = completion.strip() == task.answer
            return Turn([{"role": "user", "content": "yes" if done else "no"}], done=done)
        def reward(self, task, state):                # at the end, in [0, 1]
            return 1.0 / state["tries"] if state.get("solved") else 0.0

A :class:`ToolEnv` gives the model Python functions as tools. Their JSON schemas (from
signatures and docstrings) are shown in the system prompt; the model calls them by
writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes/Qwen
format that OpenAI-compatible servers parse into ``tool_calls``), and each result comes
back as a ``tool`` message. A turn without a tool call, or a call of a tool listed in
``stop_tools`` (``submit``), ends the episode.

Everything an env does runs in worker processes (:mod:`primerl.envs.workers`), so state
travels between calls: keep it a plain picklable dict. The orchestrator keeps the
trajectory token-exact: it never re-tokenizes what the model produced, only appends the
tokens of the env's turns (see :func:`turn_suffix`), and only model tokens carry loss.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs

from primerl.envs import EnvConfig, Environment, Message, Task, TaskError
from primerl.errors import PrimerlError


@attrs.define(kw_only=True)
class MultiTurnConfig(EnvConfig):
    """Options every multi-turn env accepts (``--env.max_turns 12``)."""

    max_turns: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    turn_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))  # one env turn
    episode_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))  # a whole episode


@attrs.define
class Turn:
    """The env's reply to one model turn."""

    messages: list[Message] = attrs.Factory(list)  # appended to the conversation
    done: bool = False
    state: dict[str, Any] | None = None  # the episode state after the turn (set by the runner)


class MultiTurnEnv(Environment):
    """The model and the env alternate until ``respond`` says done or ``max_turns`` is hit."""

    Config: ClassVar[type[EnvConfig]] = MultiTurnConfig
    rollout: ClassVar[str | None] = "primerl.envs.rollouts:MultiTurn"

    def setup(self, task: Task) -> dict[str, Any]:
        """Per-episode state, created before the first model turn (e.g. a scratch checkout)."""
        return {}

    def respond(self, task: Task, state: dict[str, Any], completion: str) -> Turn:
        raise NotImplementedError

    def reward(self, task: Task, state: dict[str, Any]) -> float:
        raise NotImplementedError

    def cleanup(self, task: Task, state: dict[str, Any]) -> None:
        """Release what ``setup`` made; called once per episode, also after a failure."""

    def system(self) -> str | None:
        return self.system_prompt

    # -- the calls the orchestrator makes (in worker processes) --------------------------

    def score(self, task: Task, state: dict[str, Any]) -> float:
        r = float(self.reward(task, state))
        if not 0.0 <= r <= 1.0 or r != r:
            raise ValueError(f"{type(self).__name__}.reward returned {r} for task {task.id!r}; rewards must be in [0, 1]")
        return r

    def step(self, task: Task, state: dict[str, Any], completion: str) -> Turn:
        turn = self.respond(task, state, completion)
        if not isinstance(turn, Turn):
            raise TypeError(f"{type(self).__name__}.respond must return a Turn, got {type(turn).__name__}")
        turn.state = state
        return turn


# ---------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI function schema of a Python function: name, docstring, typed parameters."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for name, p in sig.parameters.items():
        if name in ("self", "state"):
            continue
        t = hints.get(name, str)
        props[name] = {"type": _JSON_TYPES.get(typing.get_origin(t) or t, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc.split("\n\n")[0],
        "parameters": {"type": "object", "properties": props, "required": required},
    }}


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> list[dict[str, Any]] | str:
    """``[{"name", "arguments"}]`` from ``<tool_call>{json}</tool_call>`` blocks, or an error
    message (for the model) when a block is not valid JSON of that shape."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as e:
            return f"error: tool call is not valid JSON ({e.msg} at {e.pos})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return 'error: a tool call must be {"name": "...", "arguments": {...}}'
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return "error: tool call arguments must be a JSON object"
        if not isinstance(args, dict):
            return "error: tool call arguments must be a JSON object"
        calls.append({"name": call["name"], "arguments": args})
    return calls


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(text without its tool-call blocks, calls)`` as an OpenAI-compatible server returns a
    message; when a block is malformed nothing is parsed and the text comes back whole."""
    calls = parse_tool_calls(text)
    if isinstance(calls, str) or not calls:
        return text, []
    return _TOOL_CALL.sub("", text).strip(), calls


class ToolEnv(MultiTurnEnv):
    """Tools are methods named in ``tools``, called as ``method(state, **arguments)``;
    results (strings) go back as ``tool`` messages."""

    tools: ClassVar[tuple[str, ...]] = ()
    stop_tools: ClassVar[tuple[str, ...]] = ("submit",)
    max_tool_output: ClassVar[int] = 4000  # characters of a result shown to the model

    def tool(self, name: str) -> Callable[..., Any]:
        """The method tool ``name`` (one of ``tools``) names."""
        return getattr(self, name)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(self.tool(name)) for name in self.tools]

    def system(self) -> str:
        """The system prompt, listing the tools compactly: ``name(arg: type, ...): what it does``."""
        base = self.system_prompt or "You are an agent that solves the task with tools."
        lines = []
        for spec in self.schemas():
            f = spec["function"]
            req = set(f["parameters"]["required"])
            args = ", ".join(f"{a}: {p['type']}" + ("" if a in req else "?") for a, p in f["parameters"]["properties"].items())
            lines.append(f"{f['name']}({args}): {f['description']}")
        return (base + "\nTools:\n" + "\n".join(lines) + '\nCall: <tool_call>{"name": ..., "arguments": {...}}</tool_call>')

    def respond(self, task: Task, state: dict[str, Any], completion: str) -> Turn:
        calls = parse_tool_calls(completion)
        if isinstance(calls, str):
            return Turn([{"role": "tool", "content": calls}])
        if not calls:
            return Turn(done=True)  # the model answered without a tool: the episode ends
        messages, done = [], False
        for call in calls:
            name = call["name"]
            if name not in self.tools:
                result = f"error: unknown tool {name!r}; tools: {', '.join(self.tools)}"
            else:
                try:
                    result = str(self.tool(name)(state, **call["arguments"]))
                except (TaskError, PrimerlError):
                    raise  # the harness failed, not the model: never a message to learn from
                except TypeError as e:
                    result = f"error: bad arguments for {name}: {e}"
                except Exception as e:  # noqa: BLE001 - a tool failing is information for the model
                    result = f"error: {type(e).__name__}: {e}"
                done = done or name in self.stop_tools
            if len(result) > self.max_tool_output:
                result = result[: self.max_tool_output] + f"\n... ({len(result) - self.max_tool_output} more characters)"
            messages.append({"role": "tool", "content": result})
        state["tool_calls"] = state.get("tool_calls", 0) + len(calls)
        return Turn(messages, done=done)


# ---------------------------------------------------------------------------------------
# Token-exact turns
# ---------------------------------------------------------------------------------------


def prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """The chat template's token ids for ``messages`` plus the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, Mapping):  # a dict or transformers' BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def turn_suffix(tokenizer: Any, history: list[Message], new: list[Message]) -> list[int]:
    """Token ids to append after ``history`` (whose last message is the model's turn) so that
    the conversation continues with ``new`` and a generation prompt.

    Rendered as text with the chat template, ``history + new`` must extend ``history``; the
    extension alone is tokenized, so nothing the model produced is ever re-tokenized.
    """
    before = tokenizer.apply_chat_template(history, tokenize=False)
    after = tokenizer.apply_chat_template(history + new, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError(
            "the chat template does not render conversations append-only (history + new does not start "
            "with history), so turns cannot be appended token-exactly"
        )
    return list(tokenizer.encode(after[len(before):], add_special_tokens=False))


__all__ = ["MultiTurnConfig", "MultiTurnEnv", "ToolEnv", "Turn", "parse_tool_calls", "prompt_ids",
           "split_tool_calls", "tool_schema", "turn_suffix"]
