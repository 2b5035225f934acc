"""Environments that run their own episodes: other RL libraries' envs and agent harnesses.

A :class:`MultiTurnEnv` answers one model turn at a time and the orchestrator drives the
conversation. Some environments cannot be driven that way: a verifiers environment owns
its rollout loop (its ``rollout`` calls the model itself, through an OpenAI client), and
an agent harness runs its own scaffold. An :class:`AgentEnv` gets the inference endpoint
instead and returns, for each episode, the **model calls** it made: the exact prompt and
completion token ids of each call, the sampled tokens' logprobs and policy versions, and
the routed experts of MoE models. It runs in an env worker process like every env.

The orchestrator then turns each episode into training samples with :func:`interleave`:
consecutive calls whose prompt starts with everything before it (the previous call's
prompt + completion) merge into one sample, so a 50-turn episode trains as one sequence;
where that *extension property* breaks (the env rewrote its history: compaction, thinking
stripped) a new sample starts. Either way the trainer sees exactly the tokens the model
saw and produced, and only sampled tokens carry loss.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from primerl.envs import EnvConfig, Environment, Task
from primerl.samples import NO_VERSION, Sample, decode_routed_experts


@attrs.frozen
class Endpoint:
    """Where and how an AgentEnv samples: an OpenAI-compatible server and the run's settings."""

    base_url: str  # "http://host:port/v1"
    model: str
    max_tokens: int  # per model call
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 1024
    return_routed_experts: bool = False  # R3: ask the engine for every token's experts
    # the served model's tokenizer folder (its checkpoint), for envs that render prompts to
    # token ids themselves; None: a preset, served with primerl's byte tokenizer
    tokenizer: str | None = None
    # the servers' API key (inference.api_key / PRIMERL_API_KEY), for the env's client:
    # OpenAI's clients send it as "Authorization: Bearer <key>"; None: servers need none
    api_key: str | None = attrs.field(default=None, repr=False)

    def sampling(self) -> dict[str, Any]:
        """OpenAI sampling arguments, with primerl's extensions in ``extra_body``."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "extra_body": {"return_routed_experts": self.return_routed_experts}}


@attrs.frozen
class ModelCall:
    """One request to the model, token-exact: what it was given and what it sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # [len(completion_ids)] sampling logprobs
    versions: list[int]  # [len(completion_ids)] policy version of each sampled token
    # the engine's routed experts for prompt + completion (its JSON payload), or None
    routed_experts: dict[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(f"a model call needs one logprob and one version per completion token: {n} tokens, "
                             f"{len(self.logprobs)} logprobs, {len(self.versions)} versions")


@attrs.frozen
class Episode:
    """One finished episode: its model calls in order, its reward and the env's metrics."""

    calls: list[ModelCall]
    reward: float
    metrics: dict[str, float] = attrs.Factory(dict)
    error: str | None = None  # why the env ended it early, if it did (the episode still trains)


@attrs.define(kw_only=True)
class AgentConfig(EnvConfig):
    """Options every agent env accepts (its ``Config`` subclasses this one)."""

    # a whole group of episodes must finish in this time, else it fails (and is counted)
    episode_timeout_s: float = attrs.field(default=1800.0, validator=attrs.validators.gt(0))


class AgentEnv(Environment):
    """An environment that runs whole groups of episodes itself (in an env worker process).

    Subclasses implement ``tasks`` and ``run_group``; ``Config`` is :class:`AgentConfig` or a
    subclass (``episode_timeout_s`` bounds a whole group).
    """

    Config: ClassVar[type[EnvConfig]] = AgentConfig
    rollout: ClassVar[str | None] = "primerl.envs.rollouts:Agent"

    def run_group(self, task: Task, endpoint: Endpoint, n: int) -> list[Episode]:
        """``n`` episodes of ``task`` sampled from ``endpoint``; rewards may be group-relative."""
        raise NotImplementedError


def interleave(calls: list[ModelCall]) -> list[Sample]:
    """The training samples of one episode: runs of calls with the extension property merge.

    Each sample has the calls' tokens, ``loss_mask`` 1 on sampled tokens, their logprobs
    and versions (0.0 / ``NO_VERSION`` on tokens the model did not sample), the routed
    experts of the last merged call (whose prompt + completion covers the whole sample)
    and ``turns``; reward and advantage are the caller's to set.
    """
    runs: list[list[ModelCall]] = []
    tokens: list[int] = []
    for call in calls:
        if not call.completion_ids:
            continue  # nothing sampled (e.g. the prompt was already too long): nothing to learn
        if runs and call.prompt_ids[: len(tokens)] == tokens:
            runs[-1].append(call)
        else:
            runs.append([call])
        tokens = call.prompt_ids + call.completion_ids
    return [_merge(run) for run in runs]


def _merge(run: list[ModelCall]) -> Sample:
    """One sample from calls that each extend the previous one's prompt + completion."""
    tokens: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for call in run:
        bridge = call.prompt_ids[len(tokens):]  # the env's turn, as the model saw it
        n = len(call.completion_ids)
        tokens += bridge + call.completion_ids
        loss_mask += [0] * len(bridge) + [1] * n
        logprobs += [0.0] * len(bridge) + list(call.logprobs)
        versions += [NO_VERSION] * len(bridge) + list(call.versions)
    return Sample(tokens=tokens, loss_mask=loss_mask, logprobs=logprobs, versions=versions, turns=len(run),
                  routed_experts=decode_routed_experts(run[-1].routed_experts))


__all__ = ["AgentConfig", "AgentEnv", "Endpoint", "Episode", "ModelCall", "interleave"]
