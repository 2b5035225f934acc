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

from typing import Any

import attrs

from primerl.envs import Environment, Task


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


class AgentEnv(Environment):
    """An environment that runs whole groups of episodes itself (in an env worker process).

    Subclasses implement ``tasks`` and ``run_group``. Options for time limits come from the
    env config's ``episode_timeout_s`` when it has one (the whole group must finish in it).
    """

    def run_group(self, task: Task, endpoint: Endpoint, n: int) -> list[Episode]:
        """``n`` episodes of ``task`` sampled from ``endpoint``; rewards may be group-relative."""
        raise NotImplementedError


def interleave(calls: list[ModelCall]) -> list[dict[str, Any]]:
    """The training samples of one episode: runs of calls with the extension property merge.

    Each sample has ``tokens``, ``loss_mask`` (1 on sampled tokens), ``logprobs`` and
    ``versions`` (0.0 / -1 on tokens the model did not sample), ``routed_experts`` (the last
    merged call's payload, which covers the whole sample) and ``turns``.
    """
    samples: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for call in calls:
        if not call.completion_ids:
            continue  # nothing sampled (e.g. the prompt was already too long): nothing to learn
        if cur is not None and call.prompt_ids[: len(cur["tokens"])] == cur["tokens"]:
            bridge = call.prompt_ids[len(cur["tokens"]):]  # the env's turn, as the model saw it
        else:
            if cur is not None:
                samples.append(cur)
            cur = {"tokens": [], "loss_mask": [], "logprobs": [], "versions": [], "turns": 0}
            bridge = call.prompt_ids
        n = len(call.completion_ids)
        cur["tokens"] += bridge + call.completion_ids
        cur["loss_mask"] += [0] * len(bridge) + [1] * n
        cur["logprobs"] += [0.0] * len(bridge) + list(call.logprobs)
        cur["versions"] += [-1] * len(bridge) + list(call.versions)
        cur["routed_experts"] = call.routed_experts
        cur["turns"] += 1
    if cur is not None:
        samples.append(cur)
    return samples


__all__ = ["AgentEnv", "Endpoint", "Episode", "ModelCall", "interleave"]
