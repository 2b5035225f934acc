"""The verifiers bridge: train on any environment built with the verifiers library.

With verifiers 0.4 installed (its ``verifiers.v1`` stack) the bridge runs v1 environments:
:mod:`primerl_verifiers.v1`. What follows is the classic API's path (verifiers 0.3).

verifiers (PrimeIntellect's environment library) packages an environment as a module with
``load_environment(**args)``; its classic API (``verifiers < 0.4``, ``verifiers.legacy``
in 0.3) runs a rollout itself: ``Environment.run_group`` calls the model through a
``vf.Client``, answers each turn (``env_response``, tools), scores the group with its
rubric and records every model call in ``state["trajectory"]`` with its token ids.

So the bridge is an :class:`~primerl.envs.agent.AgentEnv`. In an env worker process it
loads the environment by id (``--env.id vf-guess-number --env.args.max_turns 4``) and
runs each group against primerl's inference server with verifiers' own token client:
the first turn is an ordinary chat request; each later turn is sent as tokens
(``/v1/chat/completions/tokens``: the engine's own tokens of the earlier turns plus the
new messages rendered by ``/tokenize``), so nothing the model produced is re-tokenized.
The trajectory's calls, with the policy version of every sampled token and the routed
experts for router replay, become training samples in the orchestrator.

``--env.client messages`` sends every turn as plain chat messages instead (for envs that
rewrite their history); samples then split wherever a turn's tokens stop extending the
previous ones.
"""

from __future__ import annotations

import asyncio
import copy
import math
import os
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from primerl.envs import Task
from primerl.envs.agent import AgentConfig, AgentEnv, Endpoint, Episode, ModelCall


def _env_id(_inst: Any, _attr: attrs.Attribute, value: str) -> None:
    if not value:
        raise ValueError("id: set the verifiers environment to load, e.g. --env.id vf-guess-number (the id names "
                         "the installed module that defines load_environment; '-' becomes '_')")


def _named(_inst: Any, attr: attrs.Attribute, value: str) -> None:
    if not value:
        raise ValueError(f"{attr.name}: must name one (e.g. {attr.default!r})")


def _positive(_inst: Any, attr: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name}: must be >= 1, got {value}")


def _renderer(_inst: Any, _attr: attrs.Attribute, value: str) -> None:
    from primerl_verifiers.v1 import check_renderer

    check_renderer(value)


@attrs.define(kw_only=True)
class VerifiersConfig(AgentConfig):
    """``[env]`` options of the bridge (``episode_timeout_s``: a whole group)."""

    id: str = attrs.field(default="", validator=_env_id)
    # keyword arguments of load_environment (classic); the taskset's options (v1)
    args: dict[str, Any] = attrs.Factory(dict)
    client: Literal["tokens", "messages"] = "tokens"  # classic: tokens sends later turns as token ids
    # v1 (verifiers >= 0.4): the agent's harness ("null": the model answers, with the task's
    # tools if it has any; "bash", "mini_swe_agent"...), its runtime ("subprocess", "docker"...)
    harness: str = attrs.field(default="null", validator=_named)
    runtime: str = attrs.field(default="subprocess", validator=_named)
    max_turns: int = attrs.field(default=8, validator=_positive)  # v1: model turns per episode
    # v1: the null harness in the subprocess runtime runs its chat program inside the env worker
    # (primerl-null); false: verifiers starts it as a process (with uv) per rollout
    in_process: bool = True
    # v1: the turns' renderer by name (renderers' glm-5, kimi-k2, qwen3, default..., or primerl-byte);
    # "": primerl-byte for the byte tokenizer, else the checkpoint's model type's, else renderers' choice
    renderer: str = attrs.field(default="", validator=_renderer)


class VerifiersEnv(AgentEnv):
    Config = VerifiersConfig

    def __init__(self, config: VerifiersConfig | None = None) -> None:
        super().__init__(config)
        self._vf_env: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None  # one per worker, for every group it runs
        from primerl_verifiers import v1

        self._v1 = v1.V1Bridge(self.config) if v1.installed() else None  # verifiers >= 0.4

    @property
    def vf_env(self) -> Any:
        """The verifiers environment, loaded on first use (importing verifiers takes seconds)."""
        if self._vf_env is None:
            os.environ.setdefault("VF_LOG_LEVEL", "WARNING")
            try:
                import verifiers as vf
            except ImportError as e:
                raise ImportError("the verifiers bridge needs the verifiers library: pip install 'verifiers>=0.4' (or 0.3 for the classic API)") from e
            try:
                self._vf_env = vf.load_environment(self.config.id, **self.config.args)
            except ValueError as e:  # verifiers' "could not import" error
                raise ValueError(f"{e} (install it, e.g. pip install -e examples/verifiers-env for vf-guess-number)") from None
        return self._vf_env

    def tasks(self, split: str) -> Iterable[Task]:
        if self._v1 is not None:
            yield from self._v1.tasks(split)
            return
        env = self.vf_env
        if split == "eval":
            if env.eval_dataset is None and getattr(env, "eval_dataset_source", None) is None:
                return
            rows = env.get_eval_dataset()
        else:
            rows = env.get_dataset()
        for i, row in enumerate(rows):
            row = dict(row)
            prompt = row.get("prompt") or ""
            yield Task(id=f"{self.config.id}/{row.get('example_id', i)}", prompt=prompt,
                       answer=str(row["answer"]) if row.get("answer") is not None else None,
                       info={"vf_input": row})

    def run_group(self, task: Task, endpoint: Endpoint, n: int) -> list[Episode]:
        # One loop for the worker's lifetime: whatever the env created on it (semaphores,
        # HTTP sessions of its rubric) stays usable from one group to the next.
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        group = self._v1.run_group(task, endpoint, n) if self._v1 is not None else self._run_group(task, endpoint, n)
        return self._loop.run_until_complete(group)

    def close(self) -> None:
        if self._loop is not None:
            if self._v1 is not None:
                self._loop.run_until_complete(self._v1.aclose())
            self._loop.close()

    async def _run_group(self, task: Task, endpoint: Endpoint, n: int) -> list[Episode]:
        from openai import AsyncOpenAI

        env = self.vf_env
        env.set_max_seq_len(endpoint.max_model_len)
        http = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key or "primerl", max_retries=0,
                           timeout=self.config.episode_timeout_s)
        client = _client_class(self.config.client)(http)
        sampling = {**endpoint.sampling(), "logprobs": True}
        inputs = [copy.deepcopy(task.info["vf_input"]) for _ in range(n)]
        try:
            outputs = await env.run_group(inputs, client, endpoint.model, sampling, state_columns=["trajectory"])
        finally:
            await http.close()
        return [_episode(out) for out in outputs]


def _episode(output: Any) -> Episode:
    """A verifiers RolloutOutput (with its trajectory) as the model calls it made."""
    calls = []
    for step in output.get("trajectory") or []:
        tokens = step.get("tokens")
        if tokens is None:
            raise RuntimeError("a verifiers trajectory step has no token ids; the inference server must return "
                               "prompt_token_ids, token_ids and logprobs (primerl's and vLLM's do)")
        completion = list(tokens["completion_ids"])
        response_tokens = getattr(getattr(step.get("response"), "message", None), "tokens", None)
        versions = getattr(response_tokens, "policy_versions", None)
        versions = list(versions)[: len(completion)] if versions is not None else [-1] * len(completion)
        routed = tokens.get("routed_experts")
        if routed is not None:  # verifiers hands the base64 text as a memoryview: make it picklable
            routed = {**routed, "data": routed["data"] if isinstance(routed["data"], str) else bytes(routed["data"])}
        calls.append(ModelCall(prompt_ids=list(tokens["prompt_ids"]), completion_ids=completion,
                               logprobs=[float(x) for x in tokens["completion_logprobs"]], versions=versions,
                               routed_experts=routed))
    reward = float(output.get("reward") or 0.0)
    if not math.isfinite(reward):
        raise ValueError(f"the verifiers rubric returned reward {reward}")
    error = output.get("error")
    if error is not None:
        error = str(error.get("error_chain_repr") or error) if isinstance(error, dict) else str(error)
    metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items() if isinstance(v, int | float)}
    return Episode(calls=calls, reward=reward, metrics=metrics, error=error)


_CLIENTS: dict[str, type] = {}


def _client_class(kind: str) -> type:
    """verifiers' OpenAI chat client (``messages``) or token client (``tokens``), keeping the
    policy version of every sampled token that primerl's server returns with each choice."""
    if kind not in _CLIENTS:
        from verifiers.legacy.clients import OpenAIChatCompletionsClient, OpenAIChatCompletionsTokenClient

        base = OpenAIChatCompletionsTokenClient if kind == "tokens" else OpenAIChatCompletionsClient

        class VersionedClient(base):  # type: ignore[valid-type, misc]
            async def from_native_response(self, response: Any) -> Any:
                out = await super().from_native_response(response)
                versions = (response.choices[0].model_extra or {}).get("policy_versions")
                if out.message.tokens is not None and versions is not None:
                    out.message.tokens.policy_versions = list(versions)
                return out

        VersionedClient.__name__ = f"Primerl{base.__name__}"
        _CLIENTS[kind] = VersionedClient
    return _CLIENTS[kind]
