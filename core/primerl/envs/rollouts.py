"""Rollout kinds: how the orchestrator turns one task into a group of samples, per kind of env.

An environment provides its kind (``Environment.rollout``, set by the base classes):

* :class:`SingleTurn` (``SingleTurnEnv``): one chat request with ``n = group size``, so the
  prompt is prefilled once; the env scores each completion (in threads: rewards may call slow
  verifiers).
* :class:`MultiTurn` (``MultiTurnEnv``, ``ToolEnv``): ``group size`` independent episodes,
  each token-exact: model turns through ``/v1/completions`` on the growing token sequence,
  env turns computed in the env's worker processes and appended as tokens
  (:func:`primerl.envs.multiturn.turn_suffix`); only model tokens carry loss.
* :class:`Agent` (``AgentEnv``): the env runs the whole group itself in a worker, against an
  inference endpoint, and returns its model calls, which :func:`primerl.envs.agent.interleave`
  turns into token-exact samples.

The orchestrator builds one kind for its env with a :class:`RolloutContext` (the run's
config, its inference client, the env's workers, the tokenizer) and calls
:meth:`Rollout.run` for every group; a kind fills ``group.samples`` and ``group.tokens``.
What a kind needs of the inference client is :class:`RolloutClient`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import attrs

from primerl.envs.agent import AgentConfig, Endpoint, interleave
from primerl.envs.multiturn import MultiTurnConfig, prompt_ids, turn_suffix
from primerl.samples import NO_VERSION, Sample, decode_routed_experts

if TYPE_CHECKING:  # pragma: no cover
    from primerl.serving.protocol import RoutedExperts


class RolloutClient(Protocol):
    """What rollouts ask of the inference servers (``primerl.orchestrator.client.Client``)."""

    async def chat(self, body: dict[str, Any], session: str | None = None) -> dict[str, Any]: ...

    async def completions(self, body: dict[str, Any], session: str | None = None) -> dict[str, Any]: ...

    async def endpoint(self, session: str) -> tuple[str, int]: ...

    async def lost_since(self, url: str, token: int) -> bool: ...

    def count_resent(self) -> None: ...


class GroupLike(Protocol):
    """The orchestrator's group: a task, its size and temperature, the samples to fill."""

    task: Any
    size: int
    temperature: float
    session: str
    samples: list[Sample]
    tokens: int
    env_metrics: list[dict[str, float]]


@attrs.define
class RolloutContext:
    """What every kind runs with (the orchestrator builds it once)."""

    cfg: Any  # the RunConfig
    env: Any  # the Environment
    client: RolloutClient
    env_cfg: Any = None  # the env's config (its source's, in a run of several; else cfg.env)
    workers: Any = None  # EnvWorkers: the env's worker processes (multi-turn and agent envs)
    tokenizer: Any = None  # the model's tokenizer (multi-turn envs append the env's turns as tokens)
    scorer: ThreadPoolExecutor | None = None  # single-turn rewards, overlapped
    want_routed: bool = False  # routed experts travel with each sample (R3, routing metrics)
    closing: Any = None  # a callable: True once the run is shutting down (cleanup is the workers' then)


class Rollout(Protocol):
    """One kind of rollout (see the module docstring)."""

    uses_workers: ClassVar[bool]  # the env runs in worker processes
    needs_tokenizer: ClassVar[bool]

    def __init__(self, ctx: RolloutContext) -> None: ...

    async def run(self, group: GroupLike) -> None:
        """Fill ``group.samples`` (and ``group.tokens``, the tokens sampled); raise to fail the group."""


class SingleTurn:
    """One chat request with ``n = group.size``: the prompt is prefilled once."""

    uses_workers = False
    needs_tokenizer = False

    def __init__(self, ctx: RolloutContext) -> None:
        self.ctx = ctx

    async def run(self, group: GroupLike) -> None:
        ctx, o = self.ctx, self.ctx.cfg.orchestrator
        body = {
            "model": ctx.cfg.model.name,
            "messages": group.task.messages(ctx.env.system_prompt),
            "n": group.size, "max_tokens": o.max_tokens, "temperature": group.temperature, "top_p": o.top_p,
            "logprobs": True, "return_routed_experts": ctx.want_routed,
        }
        resp = await ctx.client.chat(body, session=group.session)
        prompt = resp["prompt_token_ids"]
        loop = asyncio.get_running_loop()
        rewards = await asyncio.gather(*(  # score the group's samples concurrently
            loop.run_in_executor(ctx.scorer, ctx.env.score, group.task, c["message"]["content"] or "")
            for c in resp["choices"]
        ))
        for choice, reward in zip(resp["choices"], rewards):
            ids = choice["token_ids"]
            n_prompt = len(prompt)
            group.samples.append(Sample(
                tokens=prompt + ids,
                loss_mask=[0] * n_prompt + [1] * len(ids),
                logprobs=[0.0] * n_prompt + [c["logprob"] for c in choice["logprobs"]["content"]],
                versions=[NO_VERSION] * n_prompt + choice["policy_versions"],
                reward=reward,
                temperature=group.temperature,
                routed_experts=decode_routed_experts(choice.get("routed_experts")),
                task_id=group.task.id,
            ))
            group.tokens += len(ids)


class MultiTurn:
    """``group.size`` independent episodes of one task; any failed episode fails the group."""

    uses_workers = True
    needs_tokenizer = True

    def __init__(self, ctx: RolloutContext) -> None:
        self.ctx = ctx

    async def run(self, group: GroupLike) -> None:
        env_cfg = self.ctx.env_cfg or self.ctx.cfg.env
        timeout = env_cfg.episode_timeout_s if isinstance(env_cfg, MultiTurnConfig) else None
        jobs = [asyncio.create_task(self.episode(group.task, f"{group.session}-{i}", group.temperature))
                for i in range(group.size)]
        try:
            _, late = await asyncio.wait(jobs, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # a failed, late or cancelled group stops its other episodes and collects every outcome
            for job in jobs:
                job.cancel()
            outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
        if failed:
            raise failed[0]
        if late:
            raise TimeoutError(f"an episode of task {group.task.id} took longer than env.episode_timeout_s "
                               f"({timeout:.0f}s)")
        for sample in outcomes:
            group.samples.append(sample)
            group.tokens += sample.sampled_tokens

    async def episode(self, task: Any, session: str, temperature: float) -> Sample:
        """One token-exact multi-turn episode: model turns via /v1/completions on the growing
        token sequence, env turns from the env workers, appended as tokens."""
        ctx = self.ctx
        o, env, tok, workers = ctx.cfg.orchestrator, ctx.env, ctx.tokenizer, ctx.workers
        env_cfg: MultiTurnConfig = ctx.env_cfg or ctx.cfg.env
        turn_timeout = env_cfg.turn_timeout_s
        max_len = ctx.cfg.inference.max_model_len
        state = await workers.call("setup", task, timeout=turn_timeout)
        try:
            messages = task.messages(env.system())
            ids = prompt_ids(tok, messages)
            mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [NO_VERSION] * len(ids)
            routed: RoutedExperts | None = None
            end = len(ids)
            for _ in range(env_cfg.max_turns):
                budget = min(o.max_tokens, max_len - len(ids) - 1)
                if budget <= 0:
                    break
                resp = await ctx.client.completions({
                    "model": ctx.cfg.model.name, "prompt": ids, "max_tokens": budget,
                    "temperature": temperature, "top_p": o.top_p, "logprobs": 0,
                    "return_routed_experts": ctx.want_routed,
                }, session=session)
                choice = resp["choices"][0]
                out = choice["token_ids"]
                ids, mask = ids + out, mask + [1] * len(out)
                logprobs += choice["logprobs"]["token_logprobs"]
                versions += choice["policy_versions"]
                routed = choice.get("routed_experts") or routed
                end = len(ids)  # the trajectory ends with a model turn: later env tokens teach nothing
                text = tok.decode(out, skip_special_tokens=True)
                turn = await workers.call("step", task, state, text, timeout=turn_timeout)
                state = turn.state
                messages = messages + [{"role": "assistant", "content": text}]
                if turn.done or not turn.messages:
                    break
                delta = turn_suffix(tok, messages, turn.messages)
                messages = messages + turn.messages
                if len(ids) + len(delta) >= max_len:
                    break  # no room for another model turn
                ids, mask = ids + delta, mask + [0] * len(delta)
                logprobs, versions = logprobs + [0.0] * len(delta), versions + [NO_VERSION] * len(delta)
            reward = await workers.call("score", task, state, timeout=turn_timeout)
        finally:
            try:
                if not ctx.closing():  # at shutdown the workers' env.close() releases everything
                    await workers.call("cleanup", task, state, timeout=turn_timeout)
            except Exception as e:  # noqa: BLE001 - cleanup failing must not lose the episode
                print(f"[orchestrator] cleanup of task {task.id} failed: {e}", flush=True)
        return Sample(tokens=ids[:end], loss_mask=mask[:end], logprobs=logprobs[:end], versions=versions[:end],
                      reward=reward, temperature=temperature, routed_experts=decode_routed_experts(routed),
                      task_id=task.id, turns=sum(1 for m in messages if m["role"] == "assistant"))


class Agent:
    """The env runs the group in a worker; every episode's calls become samples.

    The worker calls the inference server itself, so a server lost during the group cannot
    be re-sent call by call: the whole group runs again on another server (counted in
    ``inference/resent``) and the lost attempt's episodes are discarded."""

    uses_workers = True
    needs_tokenizer = False

    def __init__(self, ctx: RolloutContext) -> None:
        self.ctx = ctx

    async def run(self, group: GroupLike) -> None:
        ctx, o = self.ctx, self.ctx.cfg.orchestrator
        env_cfg = ctx.env_cfg or ctx.cfg.env
        timeout = env_cfg.episode_timeout_s if isinstance(env_cfg, AgentConfig) else None
        while True:
            url, token = await ctx.client.endpoint(group.session)
            endpoint = Endpoint(
                base_url=url + "/v1", model=ctx.cfg.model.name, max_tokens=o.max_tokens,
                temperature=group.temperature, top_p=o.top_p, max_model_len=ctx.cfg.inference.max_model_len,
                return_routed_experts=ctx.want_routed, api_key=ctx.cfg.inference.resolved_api_key(),
                tokenizer=str(d) if (d := ctx.cfg.model.checkpoint_dir()) else None)
            try:
                episodes = await ctx.workers.call("run_group", group.task, endpoint, group.size, timeout=timeout)
            except Exception:
                if await ctx.client.lost_since(url, token):
                    ctx.client.count_resent()
                    continue
                raise
            if any(ep.error for ep in episodes) and await ctx.client.lost_since(url, token):
                ctx.client.count_resent()
                continue
            break
        for i, ep in enumerate(episodes):
            if ep.error:
                print(f"[orchestrator] episode of task {group.task.id} ended early: {ep.error}", flush=True)
            group.env_metrics.append(ep.metrics)
            for sample in interleave(ep.calls):
                sample.reward, sample.temperature = float(ep.reward), group.temperature
                sample.task_id, sample.episode = group.task.id, i
                group.samples.append(sample)
                group.tokens += sample.sampled_tokens
        if not group.samples:
            raise RuntimeError(f"no episode of task {group.task.id} sampled a token")


def rollout_kind(cfg: Any, env: Any, env_cfg: Any, client: RolloutClient, *, tokenizer: Any,
                 scorer: ThreadPoolExecutor | None, want_routed: bool = False, closing: Any = None) -> tuple[Any, Any]:
    """The rollout kind an env names (``env.rollout``), over its own context, and the env's
    worker processes when the kind runs the env in them (``orchestrator.env_workers``);
    ``tokenizer``: a callable giving the model's tokenizer, called only when the kind needs it."""
    from primerl.envs.workers import EnvWorkers
    from primerl.errors import PrimerlError
    from primerl.registry import load_target

    if not env.rollout:
        raise PrimerlError(f"environment '{env_cfg.name}' ({type(env).__name__}) has no rollout kind: subclass "
                           "primerl.envs.SingleTurnEnv, primerl.envs.multiturn.MultiTurnEnv or "
                           "primerl.envs.agent.AgentEnv")
    kind = load_target(env.rollout)
    # multi-turn and agent envs run in worker processes; appending env turns needs the tokenizer
    workers = EnvWorkers(type(env), env_cfg, cfg.orchestrator.env_workers) if kind.uses_workers else None
    ctx = RolloutContext(cfg=cfg, env=env, env_cfg=env_cfg, client=client, workers=workers,
                         tokenizer=tokenizer() if kind.needs_tokenizer else None, scorer=scorer,
                         want_routed=want_routed, closing=closing or (lambda: False))
    return kind(ctx), workers
